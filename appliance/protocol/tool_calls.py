"""Pull Qwen3/Hermes-style tool calls (`<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`) out of
generated content, incrementally, as OpenAI `tool_calls`, streaming each call's arguments as they decode.

Policies:
- Same format and split as vLLM's hermes parser and llama.cpp's Qwen handling.
- Streaming as OpenAI streams: once a block's text reads `{"name": "N", "arguments": {` the call is announced
  (a ("call", {id, type, function: {name, arguments: ""}}) piece), then its arguments arrive as ("args", text)
  pieces while they decode, up to the `}` that closes the arguments object (found by bracket counting,
  json_scan.JsonValueEnd); what follows it (the block's own `}`, whitespace, `</tool_call>`) is the wrapper and
  never part of the arguments; a partial `</tool_call>` is held back so a fragment is never taken back; ("done",
  call) marks its end (APIs that send calls whole, like Ollama's, wait for it). `arguments` is the model's own
  text of the value, so the streamed fragments join to exactly the non-stream `arguments`.
- A block whose text does not start that way (other key order, "parameters") is held until its closing tag and
  then, if its JSON has a string `name`, announced whole with its arguments re-encoded as a JSON string; a block
  that does not parse is passed through as content, so nothing is lost.
- Cut off (max_tokens) inside a block: an announced call stays a call whose arguments are exactly the text the
  model produced of them (a partial object; the wrapper's tail never joins them); a block cut before its call
  was announced (`<tool_call>` and the start of its JSON) is dropped with the newlines before it, so no markup
  reaches content; finish_reason "length" says why. A cut block whose text does not start with `{` (the model
  writing about the tag) stays content.
- Newlines the template puts around calls are not content: trailing newlines are held back and dropped when a call
  follows, and after the first call newline-only text is dropped.
"""
from __future__ import annotations

import json
import re
import secrets
from typing import Any, Callable

from appliance.protocol.json_scan import JsonValueEnd
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


class ContentPieces:
    """Content between tool calls, as both tool-call parsers emit it: merged into one piece, its trailing newlines
    held back (dropped if a call follows, kept at the end when no call came)."""
    _pending_nl: str
    calls: list[dict[str, Any]]

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


class ToolCallParser(ContentPieces):
    def __init__(self, new_id: Callable[[], str] = new_call_id):
        self._new_id = new_id
        self._buf = ""            # possible partial open tag (outside) or the block so far (inside)
        self._inside = False
        self._args_at = -1        # inside a streaming call: where its arguments start in _buf (-1: not yet)
        self._scanned = 0         # characters of those arguments fed to _end
        self._end = JsonValueEnd()
        self._pending_nl = ""     # trailing newlines of content, dropped if a call follows
        self.calls: list[dict[str, Any]] = []

    def _announce(self, out: list[Piece], call: dict[str, Any]) -> None:
        self._pending_nl = ""
        self.calls.append(call)
        out.append(("call", {**call, "function": dict(call["function"])}))

    def _args(self, out: list[Piece], text: str) -> None:
        if text:
            self.calls[-1]["function"]["arguments"] += text
            out.append(("args", text))

    def _stream_args(self, out: list[Piece], region: str, closed: bool) -> None:
        """Release the new part of a streaming call's argument text (`region`: everything after
        `"arguments": ` so far) up to the end of the arguments value; a partial close tag at the end is held
        while the block is open. Per token: feeds the new characters only."""
        if not closed:
            region = region[:len(region) - _partial_tag_len(region, CLOSE_TAG)]
        if self._end.ended or len(region) <= self._scanned:
            return
        new = region[self._scanned:]
        self._scanned = len(region)
        self._args(out, new[:self._end.feed(new)])

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
                self._scanned, self._end = 0, JsonValueEnd()
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
        """At the end: an unterminated block whose call was announced ends that call (its arguments as far as
        the model wrote them); one cut before that is dropped, or is content if it cannot be a call."""
        out: list[Piece] = []
        buf, self._buf = self._buf, ""
        if self._inside:
            self._inside = False
            if self._args_at >= 0:
                self._stream_args(out, buf[self._args_at:], closed=False)
                out.append(("done", self.calls[-1]))
                return out
            if not buf.strip() or buf.lstrip().startswith("{"):
                self._pending_nl = ""            # a call cut before its name and arguments: not content
                return out
            buf = OPEN_TAG + buf
        self._content(out, buf, final=True)
        return out
