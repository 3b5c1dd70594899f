"""One generation's engine events -> Anthropic's Messages API: the SSE event sequence (`event: <type>` + `data:`),
or the one message object; and Anthropic's error shape.

Policies:
- The stream: `message_start` (the message with empty content and the prompt's input_tokens, sent before
  queueing and prefill: the role frame), then per content block `content_block_start` / `content_block_delta`s /
  `content_block_stop`, then `message_delta` (stop_reason, stop_sequence, usage) and `message_stop`. While the
  request waits in line or in a long prefill, `ping` events keep the stream alive (what Anthropic sends, and what
  its SDKs skip). One event per decoded token that releases text: each token's text goes through the shared
  OutputRouter (reasoning / content / tool calls, protocol/router.py) and becomes a `thinking_delta` (inside
  <think>), a `text_delta`, or a tool call's start (`content_block_start` of a tool_use block, input {}) and its
  arguments as `input_json_delta`s as they decode; a token that opens a block writes its start and its first
  delta together (one write). A thinking block stops with the token that closes </think>, a tool_use block with
  the one that closes its </tool_call>, a text block when the next block starts or the message ends.
- Blocks: thinking blocks carry `signature: ""` (there is nothing to sign; Anthropic's SDKs and Claude Code send
  them back as received, and the request parser ignores it); text blocks `{"type": "text", "text": ...}`;
  tool_use blocks have ids `toolu_...` and, non-stream, `input` the parsed arguments (arguments that are not a
  JSON object, a call cut by max_tokens, become `{"arguments": text}`, as on the Ollama route).
- stop_reason: "tool_use" when the turn made calls and ended by itself, "stop_sequence" (with `stop_sequence`,
  the string matched) for a stop sequence, "end_turn" at the end of turn, "max_tokens" when it produced the
  max_tokens the client asked for, "model_context_window_exceeded" when it stopped earlier at the context's end
  (max_tokens lowered to fit, anthropic_requests.py).
- usage: input_tokens counts the prompt tokens prefilled, cache_read_input_tokens those reused from an earlier
  sequence's KV (prefix reuse: Anthropic's "read from cache"), cache_creation_input_tokens is 0 (nothing is
  written on request). message_start, sent before prefill, counts the whole prompt as input_tokens; the
  message_delta's usage (cumulative, as Anthropic's) sets the split.
- Errors: `{"type": "error", "error": {"type": ..., "message": ...}}` with Anthropic's error types for the status;
  inside a stream, an `error` event (the SDKs raise it) and the stream ends.
"""
from __future__ import annotations

import json
import secrets
from typing import Any, Callable, Sequence

from appliance.protocol import ToolFormat, ToolsArg
from appliance.protocol.errors import ApiError
from appliance.protocol.logprobs import LogprobEntry
from appliance.protocol.router import OutputRouter
from appliance.protocol.sse import SSE_HEADERS, json_bytes
from appliance.protocol.stats import GenerationStats

# status -> Anthropic's error type (https://docs.anthropic.com/en/api/errors)
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def error_object(err: ApiError) -> dict[str, Any]:
    kind = ERROR_TYPES.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def error_body(err: ApiError) -> bytes:
    return json_bytes(error_object(err))


def typed_event(obj: dict[str, Any]) -> bytes:
    """`event: <type>` + `data: <json>`: Anthropic's SSE framing."""
    return b"event: " + obj["type"].encode("ascii") + b"\ndata: " + json_bytes(obj) + b"\n\n"


PING = typed_event({"type": "ping"})


def tool_input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments)
    except ValueError:
        value = None
    return value if isinstance(value, dict) else {"arguments": arguments}


class AnthropicAssembler:
    stream_headers = SSE_HEADERS

    def __init__(self, model: str, prompt_tokens: int, max_tokens: int, *, in_reasoning: bool = False,
                 tools: ToolsArg = False, tool_format: ToolFormat = "template", message_id: str | None = None,
                 make_id: Callable[[str], str] = new_id):
        self.model = model
        self.prompt_tokens = prompt_tokens          # set again once images are expanded (server/anthropic.py)
        self.max_tokens = max_tokens
        self.id = message_id or make_id("msg")
        self.router = OutputRouter(in_reasoning=in_reasoning, tools=tools, tool_format=tool_format,
                                   new_id=lambda: make_id("toolu"))
        self.blocks: list[dict[str, Any]] = []      # content blocks so far (tool_use: arguments text in "_args")
        self._open: int | None = None               # index of the block receiving deltas
        self._calls_by_index: dict[int, int] = {}   # router call index -> block index

    # ---- blocks --------------------------------------------------------------------------------------------
    def _start(self, block: dict[str, Any], out: list[dict[str, Any]]) -> int:
        self._stop(out)
        index = len(self.blocks)
        self.blocks.append(block)
        shown = {k: v for k, v in block.items() if not k.startswith("_")}
        out.append({"type": "content_block_start", "index": index, "content_block": shown})
        self._open = index
        return index

    def _stop(self, out: list[dict[str, Any]]) -> None:
        if self._open is not None:
            out.append({"type": "content_block_stop", "index": self._open})
            self._open = None

    def _text(self, kind: str, text: str, out: list[dict[str, Any]]) -> None:
        cur = self.blocks[self._open] if self._open is not None else None
        if cur is None or cur["type"] != kind:
            self._start({"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking"
                        else {"type": "text", "text": ""}, out)
        self.blocks[self._open][kind] += text            # type: ignore[index]
        delta = {"type": "thinking_delta", "thinking": text} if kind == "thinking" else \
            {"type": "text_delta", "text": text}
        out.append({"type": "content_block_delta", "index": self._open, "delta": delta})

    def _tool_deltas(self, deltas: list[dict[str, Any]], out: list[dict[str, Any]]) -> None:
        for d in deltas:
            if "id" in d:
                self._calls_by_index[d["index"]] = self._start(
                    {"type": "tool_use", "id": d["id"], "name": d["function"]["name"], "input": {}, "_args": ""}, out)
            args = d.get("function", {}).get("arguments", "")
            if args:
                index = self._calls_by_index[d["index"]]
                self.blocks[index]["_args"] += args
                out.append({"type": "content_block_delta", "index": index,
                            "delta": {"type": "input_json_delta", "partial_json": args}})

    def _route(self, routed) -> list[dict[str, Any]]:
        r, c, done = routed
        out: list[dict[str, Any]] = []
        if r:
            self._text("thinking", r, out)
        if self._open is not None and self.blocks[self._open]["type"] == "thinking" and not self.router.in_reasoning:
            self._stop(out)                       # </think> passed: the thinking block is whole
        if c:
            self._text("text", c, out)
        self._tool_deltas(self.router.deltas, out)
        if done and self._open is not None and self.blocks[self._open].get("id") == done[-1]["id"]:
            self._stop(out)                       # </tool_call> passed: the call is whole
        return out

    # ---- objects -------------------------------------------------------------------------------------------
    def _stop_reason(self, reason: str, stats: GenerationStats) -> str:
        if reason == "length":
            return "max_tokens" if stats.completion_tokens >= self.max_tokens else "model_context_window_exceeded"
        if stats.stop_sequence is not None:
            return "stop_sequence"
        return "tool_use" if self.router.calls else "end_turn"

    @staticmethod
    def usage(stats: GenerationStats) -> dict[str, int]:
        return {"input_tokens": stats.prompt_tokens - stats.cached_tokens, "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": stats.cached_tokens, "output_tokens": stats.completion_tokens}

    def _content(self) -> list[dict[str, Any]]:
        out = []
        for b in self.blocks:
            if b["type"] == "tool_use":
                out.append({"type": "tool_use", "id": b["id"], "name": b["name"], "input": tool_input(b["_args"])})
            else:
                out.append(dict(b))
        return out

    def message(self, stop_reason: str | None, stop_sequence: str | None, usage: dict[str, int],
                content: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage}

    # ---- the assembler interface (Generation) ----------------------------------------------------------------
    def start(self) -> list[bytes]:
        usage = {"input_tokens": self.prompt_tokens, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0,
                 "output_tokens": 0}
        return [typed_event({"type": "message_start", "message": self.message(None, None, usage, [])})]

    def keepalive(self, phase: str) -> bytes:
        return PING

    def error_event(self, err: ApiError) -> bytes:
        return typed_event(error_object(err))

    def token(self, text: str, logprob: LogprobEntry | None = None) -> bytes:
        return b"".join(typed_event(e) for e in self._route(self.router.token(text)))

    def finish(self, reason: str, text: str, stats: GenerationStats, prompt_ids: Sequence[int] = (),
               completion_ids: Sequence[int] = ()) -> list[bytes]:
        events = self._route(self.router.push(text, final=True))
        self._stop(events)
        events.append({"type": "message_delta",
                       "delta": {"stop_reason": self._stop_reason(reason, stats), "stop_sequence": stats.stop_sequence},
                       "usage": self.usage(stats)})
        events.append({"type": "message_stop"})
        return [typed_event(e) for e in events]

    def response(self, reason: str, text: str, stats: GenerationStats,
                 completion_ids: Sequence[int] = ()) -> dict[str, Any]:
        self._route(self.router.push(text, final=True))
        return self.message(self._stop_reason(reason, stats), stats.stop_sequence, self.usage(stats), self._content())
