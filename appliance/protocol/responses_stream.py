"""One generation's engine events -> the Responses API's SSE events (POST /v1/responses) or its response object.

Policies:
- The documented event sequence: `response.created` and `response.in_progress` (sent before prefill), then per
  output item `response.output_item.added`, for a message `response.content_part.added` (output_text), one
  `response.output_text.delta` per decoded token that releases text, `response.output_text.done`,
  `response.content_part.done`, `response.output_item.done`; finally `response.completed` (or
  `response.incomplete` with incomplete_details.reason "max_output_tokens" when the token limit cut it).
  Every event is `event: <type>` + `data: <json>` and carries `sequence_number` (0, 1, 2, ... per response);
  there is no [DONE] sentinel.
- Qwen3's <think> text is a reasoning item (content part `reasoning_text`, events
  `response.reasoning_text.delta` / `.done`), before the message, as open-weight servers send it.
- A tool call is a `function_call` item (id fc_..., call_id call_...), emitted whole when its block closes:
  output_item.added (arguments ""), one `response.function_call_arguments.delta` with all arguments,
  `.arguments.done`, output_item.done. A call the token limit cut (released only at the end) is an item with
  status "incomplete" and the arguments the model produced, in a `response.incomplete`.
- Non-stream: the same state machine runs over the same tokens; the response object is what
  response.completed would carry. Nothing is stored (store: false).
- Errors inside a stream are an `error` event (type, code, message, param, sequence_number).
"""
from __future__ import annotations

import secrets
import time
from typing import Any, Callable, Sequence

from appliance.protocol import Phase, ToolFormat, ToolsArg
from appliance.protocol.errors import ApiError
from appliance.protocol.logprobs import LogprobEntry
from appliance.protocol.router import OutputRouter
from appliance.protocol.sse import SSE_HEADERS, json_bytes, sse_comment
from appliance.protocol.stats import GenerationStats


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def typed_event(obj: dict[str, Any]) -> bytes:
    """`event: <type>` + `data: <json>`: the Responses API's SSE framing."""
    return b"event: " + obj["type"].encode("ascii") + b"\ndata: " + json_bytes(obj) + b"\n\n"


def usage(prompt_tokens: int, completion_tokens: int, reasoning_tokens: int | None,
          cached_tokens: int = 0) -> dict[str, Any]:
    """cached_tokens: prompt tokens the engine reused from an earlier sequence's KV (not prefilled again)."""
    return {"input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
            "output_tokens": completion_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens or 0},
            "total_tokens": prompt_tokens + completion_tokens}


class ResponsesAssembler:
    stream_headers = SSE_HEADERS

    def __init__(self, model: str, created_at: int, echo: dict[str, Any], *, in_reasoning: bool = False,
                 tools: ToolsArg = False, tool_format: ToolFormat = "template", response_id: str | None = None,
                 new_id: Callable[[str], str] = new_item_id, clock: Callable[[], float] = time.time):
        self.model = model
        self.created_at = created_at
        self.echo = echo
        self.id = response_id or new_id("resp")
        self._new_id = new_id
        self._clock = clock
        self.router = OutputRouter(in_reasoning=in_reasoning, tools=tools, tool_format=tool_format,
                                   new_id=lambda: new_id("call"))
        self.output: list[dict[str, Any]] = []    # items, final state once closed
        self._open: dict[str, Any] | None = None  # the item receiving text (a reasoning or message item)
        self._seq = 0

    # ---- objects -----------------------------------------------------------------------------------------
    def response_object(self, status: str, stats: GenerationStats | None = None) -> dict[str, Any]:
        done = status in ("completed", "incomplete")
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "background": False, "completed_at": int(self._clock()) if done else None, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": self.echo.get("instructions"), "max_output_tokens": self.echo.get("max_output_tokens"),
                "model": self.model, "output": list(self.output) if done else [],
                "parallel_tool_calls": self.echo.get("parallel_tool_calls", True), "previous_response_id": None,
                "reasoning": self.echo.get("reasoning", {"effort": None, "summary": None}), "store": False,
                "temperature": self.echo.get("temperature"), "text": self.echo.get("text", {"format": {"type": "text"}}),
                "tool_choice": self.echo.get("tool_choice", "auto"), "tools": self.echo.get("tools", []),
                "top_p": self.echo.get("top_p"), "truncation": "disabled",
                "usage": usage(stats.prompt_tokens, stats.completion_tokens, self.router.reasoning_tokens,
                               stats.cached_tokens)
                if stats is not None else None,
                "user": self.echo.get("user"), "metadata": self.echo.get("metadata", {})}

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        ev = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return ev

    # ---- items ---------------------------------------------------------------------------------------------
    def _open_item(self, kind: str, out: list[dict[str, Any]]) -> dict[str, Any]:
        if self._open is not None and self._open["kind"] == kind:
            return self._open
        self._close("completed", out)
        index = len(self.output)
        if kind == "reasoning":
            item = {"id": self._new_id("rs"), "type": "reasoning", "summary": [], "content": [],
                    "status": "in_progress"}
            part: dict[str, Any] = {"type": "reasoning_text", "text": ""}
        else:
            item = {"id": self._new_id("msg"), "type": "message", "status": "in_progress", "role": "assistant",
                    "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self.output.append(item)
        out.append(self._event("response.output_item.added", output_index=index, item=dict(item, content=[])))
        out.append(self._event("response.content_part.added", item_id=item["id"], output_index=index,
                               content_index=0, part=part))
        self._open = {"kind": kind, "index": index, "item": item, "parts": []}
        return self._open

    def _close(self, status: str, out: list[dict[str, Any]]) -> None:
        cur, self._open = self._open, None
        if cur is None:
            return
        item, index, text = cur["item"], cur["index"], "".join(cur["parts"])
        ids = {"item_id": item["id"], "output_index": index, "content_index": 0}
        if cur["kind"] == "reasoning":
            part: dict[str, Any] = {"type": "reasoning_text", "text": text}
            out.append(self._event("response.reasoning_text.done", **ids, text=text))
        else:
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            out.append(self._event("response.output_text.done", **ids, text=text, logprobs=[]))
        out.append(self._event("response.content_part.done", **ids, part=part))
        item.update(content=[part], status=status)
        out.append(self._event("response.output_item.done", output_index=index, item=dict(item)))

    def _text(self, kind: str, text: str, out: list[dict[str, Any]]) -> None:
        cur = self._open_item(kind, out)
        cur["parts"].append(text)
        ids = {"item_id": cur["item"]["id"], "output_index": cur["index"], "content_index": 0}
        if kind == "reasoning":
            out.append(self._event("response.reasoning_text.delta", **ids, delta=text))
        else:
            out.append(self._event("response.output_text.delta", **ids, delta=text, logprobs=[]))

    def _call(self, call: dict[str, Any], out: list[dict[str, Any]], status: str = "completed") -> None:
        self._close("completed", out)
        index, fn = len(self.output), call["function"]
        item = {"id": self._new_id("fc"), "type": "function_call", "status": "in_progress", "arguments": "",
                "call_id": call["id"], "name": fn["name"]}
        out.append(self._event("response.output_item.added", output_index=index, item=dict(item)))
        out.append(self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                               delta=fn["arguments"]))
        out.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                               arguments=fn["arguments"]))
        item.update(arguments=fn["arguments"], status=status)
        self.output.append(item)
        out.append(self._event("response.output_item.done", output_index=index, item=dict(item)))

    def _route(self, routed, call_status: str = "completed") -> list[dict[str, Any]]:
        r, c, calls = routed
        out: list[dict[str, Any]] = []
        if r:
            self._text("reasoning", r, out)
        if c:
            self._text("message", c, out)
        for call in calls:
            self._call(call, out, call_status)
        return out

    # ---- the assembler interface (Generation) ----------------------------------------------------------
    def start(self) -> list[bytes]:
        """response.created and response.in_progress, sent before queueing and prefill."""
        return [typed_event(self._event("response.created", response=self.response_object("in_progress"))),
                typed_event(self._event("response.in_progress", response=self.response_object("in_progress")))]

    def keepalive(self, phase: Phase) -> bytes:
        return sse_comment(phase)

    def error_event(self, err: ApiError) -> bytes:
        return typed_event(self._event("error", code=err.code or err.type, message=err.message, param=err.param))

    def token(self, text: str, logprob: LogprobEntry | None = None) -> bytes:
        return b"".join(typed_event(e) for e in self._route(self.router.token(text)))

    def _end(self, reason: str, text: str) -> tuple[list[dict[str, Any]], str]:
        status = "incomplete" if reason == "length" else "completed"
        events = self._route(self.router.push(text, final=True), call_status=status)
        self._close(status, events)
        return events, status

    def finish(self, reason: str, text: str, stats: GenerationStats, prompt_ids: Sequence[int] = (),
               completion_ids: Sequence[int] = ()) -> list[bytes]:
        events, status = self._end(reason, text)
        events.append(self._event(f"response.{status}", response=self.response_object(status, stats)))
        return [typed_event(e) for e in events]

    def response(self, reason: str, text: str, stats: GenerationStats,
                 completion_ids: Sequence[int] = ()) -> dict[str, Any]:
        _, status = self._end(reason, text)
        return self.response_object(status, stats)
