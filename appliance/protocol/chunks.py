"""Response objects: chat and text completions, streamed chunks and the seed's extension events.

Policies:
- Shapes are OpenAI's (field names and order as its API sends them), so the official client's pydantic types
  load every object; `timings` on the final chunk / response is an extra field mirroring llama.cpp's server.
- Builders return dicts; sse.sse_event / sse.json_bytes turn them into bytes.
- With stream_options.include_usage, every choice chunk carries `"usage": null` and the usage chunk has
  `"choices": []`, as OpenAI streams it.
- The extension events (`chat.completion.metrics`, `chat.completion.tokens`) are the seed's exact shapes; the
  server sends them only on request (they are not chunks, so the openai client would choke on them).
"""
from __future__ import annotations

import secrets
from typing import Any, Iterable, Mapping, Sequence

from appliance.protocol.logprobs import LogprobEntry, chat_logprobs, completion_logprobs
from appliance.protocol.stats import GenerationStats

TimingsArg = GenerationStats | Mapping[str, Any] | None


def new_completion_id(prefix: str = "chatcmpl") -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def _timings(t: TimingsArg) -> dict[str, Any] | None:
    if t is None:
        return None
    return t.timings() if isinstance(t, GenerationStats) else dict(t)


def usage_dict(prompt_tokens: int, completion_tokens: int, reasoning_tokens: int | None = None,
               prompt_details: Mapping[str, int] | None = None) -> dict[str, Any]:
    u: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                         "total_tokens": prompt_tokens + completion_tokens}
    if prompt_details is not None:
        u["prompt_tokens_details"] = dict(prompt_details)
    if reasoning_tokens is not None:
        u["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return u


def metrics_event(stats: GenerationStats) -> dict[str, Any]:
    return {"object": "chat.completion.metrics", "metrics": stats.metrics()}


def tokens_event(ids: Iterable[int]) -> dict[str, Any]:
    return {"object": "chat.completion.tokens", "tokens": [int(i) for i in ids]}


class _Chunks:
    object_name = ""

    def __init__(self, completion_id: str, model: str, created: int, *, include_usage: bool = False,
                 system_fingerprint: str | None = None):
        self.completion_id = completion_id
        self.model = model
        self.created = created
        self.include_usage = include_usage
        self.system_fingerprint = system_fingerprint

    def _chunk(self, choices: list[dict[str, Any]], usage: Any = ..., timings: TimingsArg = None) -> dict[str, Any]:
        d: dict[str, Any] = {"id": self.completion_id, "object": self.object_name, "created": self.created,
                             "model": self.model}
        if self.system_fingerprint is not None:
            d["system_fingerprint"] = self.system_fingerprint
        d["choices"] = choices
        if usage is not ...:
            d["usage"] = usage
        elif self.include_usage:
            d["usage"] = None
        t = _timings(timings)
        if t is not None:
            d["timings"] = t
        return d

    def usage(self, prompt_tokens: int, completion_tokens: int, reasoning_tokens: int | None = None,
              prompt_details: Mapping[str, int] | None = None) -> dict[str, Any]:
        """The usage chunk (stream_options.include_usage): no choices, just the token counts."""
        return self._chunk([], usage=usage_dict(prompt_tokens, completion_tokens, reasoning_tokens, prompt_details))

    def metrics(self, stats: GenerationStats) -> dict[str, Any]:
        return metrics_event(stats)

    def tokens(self, ids: Iterable[int]) -> dict[str, Any]:
        return tokens_event(ids)


class ChatChunks(_Chunks):
    """Builds the `chat.completion.chunk` objects of one streamed chat completion (a single choice)."""
    object_name = "chat.completion.chunk"

    def _choice(self, delta: dict[str, Any], logprobs: Any = None, finish_reason: str | None = None):
        return [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]

    def role(self) -> dict[str, Any]:
        """The first event: the assistant role, empty content (sent before prefill)."""
        return self._chunk(self._choice({"role": "assistant", "content": ""}))

    def delta(self, content: str | None = None, reasoning_content: str | None = None,
              logprobs: Sequence[LogprobEntry] | None = None,
              tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        d: dict[str, Any] = {}
        if content is not None:
            d["content"] = content
        if reasoning_content is not None:
            d["reasoning_content"] = reasoning_content
        if tool_calls is not None:
            d["tool_calls"] = tool_calls
        lp = chat_logprobs(logprobs) if logprobs is not None else None
        return self._chunk(self._choice(d, lp))

    def finish(self, reason: str, timings: TimingsArg = None) -> dict[str, Any]:
        """The closing choice chunk: empty delta, finish_reason, and llama.cpp-style timings."""
        return self._chunk(self._choice({}, None, reason), timings=timings)


class CompletionChunks(_Chunks):
    """Builds the streamed `text_completion` objects of /v1/completions (a single choice)."""
    object_name = "text_completion"

    def _choice(self, text: str, logprobs: Any = None, finish_reason: str | None = None):
        return [{"text": text, "index": 0, "logprobs": logprobs, "finish_reason": finish_reason}]

    def text(self, text: str, logprobs: Sequence[LogprobEntry] | None = None,
             text_offset: int = 0) -> dict[str, Any]:
        """A piece of completion text; `text_offset` is the length of the text streamed before it."""
        lp = completion_logprobs(logprobs, text_offset) if logprobs is not None else None
        return self._chunk(self._choice(text, lp))

    def finish(self, reason: str, timings: TimingsArg = None) -> dict[str, Any]:
        return self._chunk(self._choice("", None, reason), timings=timings)


def chat_completion(completion_id: str, model: str, created: int, *, content: str | None,
                    finish_reason: str, prompt_tokens: int, completion_tokens: int,
                    reasoning_content: str | None = None, timings: TimingsArg = None,
                    logprobs: Sequence[LogprobEntry] | None = None,
                    tool_calls: list[dict[str, Any]] | None = None,
                    reasoning_tokens: int | None = None, prompt_details: Mapping[str, int] | None = None,
                    system_fingerprint: str | None = None) -> dict[str, Any]:
    """The non-stream `chat.completion` response."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning_content is not None:
        message["reasoning_content"] = reasoning_content
    if tool_calls:
        message["tool_calls"] = tool_calls
    d: dict[str, Any] = {"id": completion_id, "object": "chat.completion", "created": created, "model": model}
    if system_fingerprint is not None:
        d["system_fingerprint"] = system_fingerprint
    d["choices"] = [{"index": 0, "message": message,
                     "logprobs": chat_logprobs(logprobs) if logprobs is not None else None,
                     "finish_reason": finish_reason}]
    d["usage"] = usage_dict(prompt_tokens, completion_tokens, reasoning_tokens, prompt_details)
    t = _timings(timings)
    if t is not None:
        d["timings"] = t
    return d


def text_completion(completion_id: str, model: str, created: int, *, text: str, finish_reason: str,
                    prompt_tokens: int, completion_tokens: int, timings: TimingsArg = None,
                    logprobs: Sequence[LogprobEntry] | None = None, text_offset: int = 0,
                    prompt_details: Mapping[str, int] | None = None,
                    system_fingerprint: str | None = None) -> dict[str, Any]:
    """The non-stream `text_completion` response of /v1/completions (`text_offset`: where the generated
    tokens start in `text`, i.e. the echoed prompt's length when echo is on)."""
    d: dict[str, Any] = {"id": completion_id, "object": "text_completion", "created": created, "model": model}
    if system_fingerprint is not None:
        d["system_fingerprint"] = system_fingerprint
    d["choices"] = [{"text": text, "index": 0,
                     "logprobs": completion_logprobs(logprobs, text_offset) if logprobs is not None else None,
                     "finish_reason": finish_reason}]
    d["usage"] = usage_dict(prompt_tokens, completion_tokens, prompt_details=prompt_details)
    t = _timings(timings)
    if t is not None:
        d["timings"] = t
    return d


def model_list(model_ids: Sequence[str], created: int, owned_by: str = "kestrel") -> dict[str, Any]:
    """GET /v1/models."""
    return {"object": "list",
            "data": [{"id": m, "object": "model", "created": created, "owned_by": owned_by} for m in model_ids]}
