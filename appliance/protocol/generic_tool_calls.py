"""The generic tool-call format's output -> content and OpenAI `tool_calls`, incrementally (the parser for models
whose chat template has no tool section; the request side, and why, is protocol/generic_tools.py).

The model answers with one JSON object, as llama.cpp's generic format has it:
  {"response": "text"}                                             -> content "text"
  {"response": <a JSON value>}  (with a response_format)           -> content: that value's JSON text
  {"tool_call": {"name": "N", "arguments": {...}}}                  -> one call
  {"tool_calls": [{"name": "N", "arguments": {...}}, ...]}          -> one or more calls

Policies:
- The same pieces as tool_calls.ToolCallParser, so every API's assembler takes either parser: ("content", text),
  ("call", {id, type, function: {name, arguments: ""}}) once a call's `{"name": "N", "arguments": ` is read,
  ("args", text) while its arguments decode, ("done", call) when its arguments value ends. `arguments` is the
  model's own text of the value, so stream fragments join to exactly the non-stream arguments.
- A string response streams as its decoded characters (json_scan.JsonStringDecoder: an escape is held until
  complete); any other response value streams as its JSON text.
- Whitespace between the format's own tokens is allowed (the grammar writes none); the format's wrapper (the
  outer braces, `]`, what follows the object) never reaches content or arguments.
- Text that cannot start the format is content, unchanged (the grammar makes that impossible unless the
  request's constraint was not applied). Cut off (max_tokens): an announced call keeps exactly the arguments
  produced; a call cut before its name and the start of its arguments, or an object cut before its first key,
  is dropped (finish_reason "length" says why); a response keeps what was decoded.
"""
from __future__ import annotations

import json
import re
from typing import Any, Callable

from appliance.protocol.json_scan import JsonStringDecoder, JsonValueEnd
from appliance.protocol.tool_calls import Piece, new_call_id

_HEAD = re.compile(r'\s*\{\s*"(response|tool_calls|tool_call)"\s*:\s*')
_LIST = re.compile(r'\s*\[\s*')
_CALL = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=\S)')
_NEXT = re.compile(r'\s*\}\s*(,|\])')
_HEADS = ('{"response":', '{"tool_call":', '{"tool_calls":[')
_CALL_HEAD = '{"name":"'


def _could_become(buf: str, *templates: str, then_more: bool = False) -> bool:
    """The text (whitespace aside) is still a beginning of one of the templates (then_more: or one of them
    followed by more text, as a call's name and `"arguments": ` follow `{"name":"`)."""
    compact = re.sub(r"\s+", "", buf)
    return any(t.startswith(compact) or (then_more and compact.startswith(t)) for t in templates)


class GenericToolCallParser:
    def __init__(self, new_id: Callable[[], str] = new_call_id):
        self._new_id = new_id
        self._buf = ""           # text not yet consumed by the current state
        self._state = "head"     # head | list | call | args | between | string | value | done | content
        self._many = False       # "tool_calls": a list of calls
        self._string = JsonStringDecoder()
        self._value = JsonValueEnd()
        self.calls: list[dict[str, Any]] = []

    def push(self, text: str) -> list[Piece]:
        out: list[Piece] = []
        self._buf += text
        while self._step(out):
            pass
        return out

    def _step(self, out: list[Piece]) -> bool:
        """Advance one state on the buffered text; False when it needs more text."""
        buf, state = self._buf, self._state
        if state == "content":
            if buf:
                out.append(("content", buf))
            self._buf = ""
            return False
        if state == "done":
            self._buf = ""
            return False
        if state == "head":
            m = _HEAD.match(buf)
            if m is None:
                if not _could_become(buf, *_HEADS):
                    self._state = "content"
                    return True
                return False
            key, rest = m.group(1), buf[m.end():]
            if key == "response":
                rest = rest.lstrip()
                if not rest:
                    return False
                if rest[0] == '"':
                    self._state, self._string, rest = "string", JsonStringDecoder(), rest[1:]
                else:
                    self._state, self._value = "value", JsonValueEnd()
            else:
                self._many = key == "tool_calls"
                self._state = "list" if self._many else "call"
            self._buf = rest
            return True
        if state == "list":
            m = _LIST.match(buf)
            if m is None:
                return self._wait_or_give_up(buf, "[")
            self._state, self._buf = "call", buf[m.end():]
            return True
        if state == "call":
            m = _CALL.match(buf)
            if m is None:
                return self._wait_or_give_up(buf, _CALL_HEAD, then_more=True)
            call: dict[str, Any] = {"id": self._new_id(), "type": "function",
                    "function": {"name": json.loads(m.group(1)), "arguments": ""}}
            self.calls.append(call)
            out.append(("call", {**call, "function": dict(call["function"])}))
            self._state, self._value, self._buf = "args", JsonValueEnd(), buf[m.end():]
            return True
        if state == "args":
            n = self._value.feed(buf)
            if n:
                self.calls[-1]["function"]["arguments"] += buf[:n]
                out.append(("args", buf[:n]))
            self._buf = buf[n:]
            if not self._value.ended:
                return False
            out.append(("done", self.calls[-1]))
            self._state = "between" if self._many else "done"
            return True
        if state == "between":
            m = _NEXT.match(buf)
            if m is None:
                return self._wait_or_give_up(buf, "}]", "},")
            self._state, self._buf = ("call" if m.group(1) == "," else "done"), buf[m.end():]
            return True
        if state == "string":
            text, n = self._string.feed(buf)
            if text:
                out.append(("content", text))
            self._buf = buf[n:]
            if self._string.ended:
                self._state = "done"
                return True
            return False
        # state == "value": a response that is not a string, as its JSON text
        n = self._value.feed(buf)
        if n:
            out.append(("content", buf[:n]))
        self._buf = buf[n:]
        if self._value.ended:
            self._state = "done"
            return True
        return False

    def _wait_or_give_up(self, buf: str, *templates: str, then_more: bool = False) -> bool:
        """Inside the format, the next token does not fit yet: wait for more text while it still could, else
        the rest is not the format (ignored: it follows calls already made)."""
        if _could_become(buf, *templates, then_more=then_more):
            return False
        self._state = "done"
        return True

    def flush(self) -> list[Piece]:
        """At the end of the text: see the policies (cut-off calls, responses, an unfinished head)."""
        out: list[Piece] = []
        buf, self._buf = self._buf, ""
        state, self._state = self._state, "done"
        if state == "content" and buf:
            out.append(("content", buf))
        elif state == "head" and buf.strip() and not _could_become(buf, *_HEADS):
            out.append(("content", buf))
        elif state == "args":
            out.append(("done", self.calls[-1]))
        elif state == "string":
            tail = self._string.flush()
            if tail:
                out.append(("content", tail))
        return out
