"""Pull Qwen3/Hermes-style tool calls (`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`) out of
generated content, incrementally, as OpenAI `tool_calls`.

Policies:
- Same format and split as vLLM's hermes parser and llama.cpp's Qwen handling: text inside a complete
  <tool_call> block whose JSON has a string `name` becomes a call (arguments re-encoded as a JSON string, as
  OpenAI sends them); a block that does not parse is passed through as content, so nothing is lost.
- A block is held back until its closing tag (a call is emitted whole, in one delta); a tag split across pushes
  is held back like the think tags.
- Newlines the template puts around calls are not content: trailing newlines are held back and dropped when a call
  follows, and after the first call newline-only text is dropped.
"""
from __future__ import annotations

import json
import secrets
from typing import Any, Callable

from appliance.protocol.reasoning import _partial_tag_len

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"

Piece = tuple[str, Any]    # ("content", str) | ("tool_call", dict)


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
                self._inside = True
            else:
                j = buf.find(CLOSE_TAG)
                if j < 0:
                    self._buf = buf
                    return out
                call = parse_call_body(buf[:j].strip(), self._new_id())
                if call is None:
                    self._content(out, OPEN_TAG + buf[:j + len(CLOSE_TAG)])
                else:
                    self._pending_nl = ""
                    self.calls.append(call)
                    out.append(("tool_call", call))
                buf = buf[j + len(CLOSE_TAG):]
                self._inside = False

    def flush(self) -> list[Piece]:
        """At the end: an unterminated block is content after all (the model was cut off)."""
        out: list[Piece] = []
        buf, self._buf = self._buf, ""
        if self._inside:
            self._inside = False
            buf = OPEN_TAG + buf
        self._content(out, buf, final=True)
        return out
