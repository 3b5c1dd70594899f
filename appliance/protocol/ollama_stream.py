"""One generation's engine events -> Ollama's NDJSON stream (/api/chat, /api/generate) or its one JSON object.

Policies:
- Shapes are Ollama's: every line is one JSON object and a newline; chat lines carry `message` (role, content,
  thinking, tool_calls), generate lines carry `response` (and `thinking`). The last line has `done: true`,
  `done_reason` ("stop" / "length"), and the figures in nanoseconds: total_duration (queue wait + the engine's
  whole time), load_duration (the queue wait: the model is always loaded, so time-until-the-engine-is-ours is
  the only "loading" a request sees), prompt_eval_count / prompt_eval_duration (prefill), eval_count /
  eval_duration (decode). /api/generate's last line also has `context` (prompt + completion token ids).
- First bytes before prefill: NDJSON has no comments, so the stream opens with an empty assistant line
  (`content: ""`, `done: false`, what Ollama itself sends for tokens that release no text), repeated every
  keep-alive interval while the request waits in the queue or in a long prefill. Clients append "" and go on.
- One line per decoded token that releases text (reasoning, content or a completed tool call); tool-call
  arguments are objects, as Ollama sends them. An error inside a stream is a line `{"error": "..."}`.
- Timestamps (`created_at`) are RFC 3339 UTC with microseconds; the clock is passed in (byte-exact tests).
"""
from __future__ import annotations

import json
import time
from datetime import datetime, timezone
from typing import Any, Callable, Sequence

from appliance.protocol import Phase, ToolFormat, ToolsArg
from appliance.protocol.errors import ApiError
from appliance.protocol.logprobs import LogprobEntry
from appliance.protocol.router import OutputRouter
from appliance.protocol.sse import json_bytes
from appliance.protocol.stats import GenerationStats

NDJSON_HEADERS: list[tuple[bytes, bytes]] = [
    (b"Content-Type", b"application/x-ndjson"),
    (b"Cache-Control", b"no-cache"),
    (b"X-Accel-Buffering", b"no"),
]


def rfc3339(t: float | None = None) -> str:
    """An RFC 3339 UTC timestamp with microseconds (Ollama's created_at / modified_at)."""
    dt = datetime.fromtimestamp(time.time() if t is None else t, tz=timezone.utc)
    return dt.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def ndjson_line(obj: dict[str, Any]) -> bytes:
    return json_bytes(obj) + b"\n"


def error_line(message: str) -> bytes:
    return ndjson_line({"error": message})


def error_body(err: ApiError) -> bytes:
    """Ollama's error response body: `{"error": "..."}` (the status carries the rest)."""
    return json_bytes({"error": err.message})


def _ns(ms: float) -> int:
    return max(int(round(ms * 1_000_000)), 0)


def durations(stats: GenerationStats) -> dict[str, int]:
    return {"total_duration": _ns(stats.queue_ms + stats.total_ms), "load_duration": _ns(stats.queue_ms),
            "prompt_eval_count": stats.prompt_tokens,
            "prompt_eval_duration": _ns(stats.prefill_ms + stats.image_encode_ms),
            "eval_count": stats.completion_tokens, "eval_duration": _ns(stats.decode_ms)}


def ollama_tool_call(call: dict[str, Any], index: int) -> dict[str, Any]:
    """An OpenAI tool call (arguments a JSON string) -> Ollama's (arguments an object)."""
    fn = call["function"]
    try:
        args = json.loads(fn["arguments"])
    except ValueError:
        args = None
    if not isinstance(args, dict):
        args = {"arguments": fn["arguments"]}
    return {"id": call["id"], "function": {"index": index, "name": fn["name"], "arguments": args}}


class _OllamaAssembler:
    stream_headers = NDJSON_HEADERS

    def __init__(self, model: str, *, in_reasoning: bool = False, tools: ToolsArg = False,
                 tool_format: ToolFormat = "template", clock: Callable[[], str] = rfc3339,
                 new_id: Callable[[], str] | None = None):
        self.model = model
        self.clock = clock
        kw: dict[str, Any] = {"new_id": new_id} if new_id is not None else {}
        self.router = OutputRouter(in_reasoning=in_reasoning, tools=tools, tool_format=tool_format, **kw)

    def _head(self) -> dict[str, Any]:
        return {"model": self.model, "created_at": self.clock()}

    def _part(self, reasoning: str, content: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
        raise NotImplementedError

    def _line(self, routed) -> bytes:
        r, c, calls = routed
        if not (r or c or calls):
            return b""
        return ndjson_line({**self._head(), **self._part(r, c, calls), "done": False})

    def keepalive(self, phase: Phase) -> bytes:
        """The line sent before prefill and as keep-alive: nothing generated yet."""
        return self._nothing_yet()

    def _nothing_yet(self) -> bytes:
        return ndjson_line({**self._head(), **self._part("", "", []), "done": False})

    def start(self) -> list[bytes]:
        return [self._nothing_yet()]

    def error_event(self, err: ApiError) -> bytes:
        return error_line(err.message)

    def token(self, text: str, logprob: LogprobEntry | None = None) -> bytes:
        return self._line(self.router.token(text))

    def _final(self, reason: str, stats: GenerationStats, part: dict[str, Any], completion_ids) -> dict[str, Any]:
        return {**self._head(), **part, "done": True, "done_reason": reason, **durations(stats)}

    def finish(self, reason: str, text: str, stats: GenerationStats, prompt_ids: Sequence[int] = (),
               completion_ids: Sequence[int] = ()) -> list[bytes]:
        """The released tail's line (if any), then the done line."""
        head = self._line(self.router.push(text, final=True))
        last = ndjson_line(self._final(reason, stats, self._part("", "", []), completion_ids))
        return [head, last] if head else [last]

    def response(self, reason: str, text: str, stats: GenerationStats,
                 completion_ids: Sequence[int] = ()) -> dict[str, Any]:
        """The non-stream object, after every token went through token()."""
        self.router.push(text, final=True)
        r = self.router
        return self._final(reason, stats, self._part(r.reasoning, r.content, r.calls), completion_ids)


class OllamaChatAssembler(_OllamaAssembler):
    def _part(self, reasoning: str, content: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning:
            msg["thinking"] = reasoning
        if calls:
            every = self.router.calls                     # a completed call's index: its place among all
            msg["tool_calls"] = [ollama_tool_call(c, next(i for i, x in enumerate(every) if x is c)) for c in calls]
        return {"message": msg}


class OllamaGenerateAssembler(_OllamaAssembler):
    """/api/generate; `prompt_ids` are the prompt's tokens (the final `context` starts with them)."""

    def __init__(self, model: str, prompt_ids: Sequence[int] = (), **kw):
        super().__init__(model, **kw)
        self.prompt_ids = list(prompt_ids)

    def _part(self, reasoning: str, content: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
        d: dict[str, Any] = {"response": content}
        if reasoning:
            d["thinking"] = reasoning
        return d

    def _final(self, reason: str, stats: GenerationStats, part: dict[str, Any], completion_ids) -> dict[str, Any]:
        d = super()._final(reason, stats, part, completion_ids)
        d["context"] = [*self.prompt_ids, *(int(i) for i in completion_ids)]
        return d


def load_response(model: str, *, chat: bool, unload: bool, now: str) -> dict[str, Any]:
    """The answer to a load / unload request (nothing to generate)."""
    part = {"message": {"role": "assistant", "content": ""}} if chat else {"response": ""}
    return {"model": model, "created_at": now, **part, "done_reason": "unload" if unload else "load",
            "done": True}
