"""Pull Qwen3/Hermes-style tool calls (`<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`) out of
generated content, incrementally, as OpenAI `tool_calls`, streaming each call's arguments as they decode.

Policies:
- Same format and split as vLLM's hermes parser and llama.cpp's Qwen handling.
- Streaming as OpenAI streams: once a block's text reads `{"name": "N", "arguments": {` the call is announced
  (a ("call", {id, type, function: {name, arguments: ""}}) piece), then its arguments arrive as ("args", text)
  pieces while they decode; the block's closing `}`, trailing whitespace and a partial `</tool_call>` are held
  back so a fragment is never taken back; ("done", call) marks its end (APIs that send calls whole, like
  Ollama's, wait for it). `arguments` is the model's own text of the value, so the streamed fragments join to
  exactly the non-stream `arguments`.
- A block whose text does not start that way (other key order, "parameters") is held until its closing tag and
  then, if its JSON has a string `name`, announced whole with its arguments re-encoded as a JSON string; a block
  that does not parse is passed through as content, so nothing is lost. An announced call stays a call even if
  the model is cut off before its closing tag.
- Newlines the template puts around calls are not content: trailing newlines are held back and dropped when a call
  follows, and after the first call newline-only text is dropped.
"""
from __future__ import annotations

import json
import re
import secrets
from typing import Any, Callable

from appliance.protocol.reasoning import _partial_tag_len

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=\{)')

Piece = tuple[str, Any]    # ("content", str) | ("call", dict) | ("args", str) | ("done", dict: the whole call)


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def parse_call_body(body: str, call_id: str) -> dict[str, Any] | None:
    """The OpenAI tool call of one block's JSON, or None when it is not a call."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(args, str):
        args = json.dumps(args, ensure_ascii=False)
    return {"id": call_id, "type": "function", "function": {"name": obj["name"], "arguments": args}}


class ToolCallParser:
    def __init__(self, new_id: Callable[[], str] = new_call_id):
        self._new_id = new_id
        self._buf = ""            # possible partial open tag (outside) or the block so far (inside)
        self._inside = False
        self._args_at = -1        # inside a streaming call: where its arguments start in _buf (-1: not yet)
        self._pending_nl = ""     # trailing newlines of content, dropped if a call follows
        self.calls: list[dict[str, Any]] = []

    def _content(self, out: list[Piece], text: str, final: bool = False) -> None:
        text = self._pending_nl + text
        body = text.rstrip("\n")
        self._pending_nl = text[len(body):]
        if final and not self.calls:
            body, self._pending_nl = body + self._pending_nl, ""
        if body:
            if out and out[-1][0] == "content":
                out[-1] = ("content", out[-1][1] + body)
            else:
                out.append(("content", body))

    def _announce(self, out: list[Piece], call: dict[str, Any]) -> None:
        self._pending_nl = ""
        self.calls.append(call)
        out.append(("call", {**call, "function": dict(call["function"])}))

    def _args(self, out: list[Piece], text: str) -> None:
        if text:
            self.calls[-1]["function"]["arguments"] += text
            out.append(("args", text))

    def _stream_args(self, out: list[Piece], region: str, closed: bool) -> None:
        """Release the part of a streaming call's argument text that can no longer be its closing (trailing
        whitespace, the block's `}` and the whitespace before it; a partial close tag while open). Per token:
        looks at the region's end only, never rescans the arguments so far."""
        if not closed:
            region = region[:len(region) - _partial_tag_len(region, CLOSE_TAG)]
        final = region.rstrip()
        if final.endswith("}"):
            final = final[:-1].rstrip()
        sent = self.calls[-1]["function"]["arguments"]
        if final.startswith(sent):
            self._args(out, final[len(sent):])

    def push(self, text: str) -> list[Piece]:
        out: list[Piece] = []
        buf = self._buf + text
        while True:
            if not self._inside:
                i = buf.find(OPEN_TAG)
                if i < 0:
                    keep = _partial_tag_len(buf, OPEN_TAG)
                    self._content(out, buf[:len(buf) - keep])
                    self._buf = buf[len(buf) - keep:]
                    return out
                self._content(out, buf[:i])
                buf = buf[i + len(OPEN_TAG):]
                self._inside, self._args_at = True, -1
                continue
            if self._args_at < 0:
                m = _HEADER.match(buf)
                if m:
                    self._announce(out, {"id": self._new_id(), "type": "function",
                                         "function": {"name": json.loads(m.group(1)), "arguments": ""}})
                    self._args_at = m.end()
            j = buf.find(CLOSE_TAG)
            if j < 0:
                if self._args_at >= 0:
                    self._stream_args(out, buf[self._args_at:], closed=False)
                self._buf = buf
                return out
            if self._args_at >= 0:
                self._stream_args(out, buf[self._args_at:j], closed=True)
                out.append(("done", self.calls[-1]))
            else:
                call = parse_call_body(buf[:j].strip(), self._new_id())
                if call is None:
                    self._content(out, OPEN_TAG + buf[:j + len(CLOSE_TAG)])
                else:
                    self._announce(out, {**call, "function": {**call["function"], "arguments": ""}})
                    self._args(out, call["function"]["arguments"])
                    out.append(("done", self.calls[-1]))
            buf = buf[j + len(CLOSE_TAG):]
            self._inside = False

    def flush(self) -> list[Piece]:
        """At the end: an unterminated block is content after all (the model was cut off), unless its call was
        already announced: then the rest of its text is the (truncated) arguments."""
        out: list[Piece] = []
        buf, self._buf = self._buf, ""
        if self._inside:
            self._inside = False
            if self._args_at >= 0:
                sent = self.calls[-1]["function"]["arguments"]
                rest = buf[self._args_at:]
                self._args(out, rest[len(sent):] if rest.startswith(sent) else "")
                out.append(("done", self.calls[-1]))
                return out
            buf = OPEN_TAG + buf
        self._content(out, buf, final=True)
        return out
