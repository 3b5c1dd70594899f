"""Pull Qwen3-Coder-style XML tool calls (the format of Qwen3.5's and Qwen3-Coder's chat templates) out of generated
content, incrementally, as OpenAI `tool_calls`:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

-> {"name": "get_weather", "arguments": '{"city":"Paris","days":3}'}.

Policies:
- Which models: those whose chat template writes calls this way (ChatTemplate.tool_format == "xml": it renders an
  assistant call as `<function=NAME>` and `<parameter=P>` blocks), never chosen by model name; llama.cpp picks its
  Qwen3-Coder handler the same way (common/chat.cpp: `<tool_call>`, `<function=`, `<parameter=` in the template).
- A value is the text between `<parameter=P>` and `</parameter>` less one leading and one trailing newline (the
  template writes `<parameter=P>\\n` VALUE `\\n</parameter>`). A parameter whose schema is a string (type "string",
  or an enum / const of strings) becomes a JSON string of that text, as llama.cpp's parser does; any other value is
  taken as JSON when it parses as JSON, else as a string. Arguments are compact JSON in the order the model wrote
  the parameters: `{"P":V,...}` (llama.cpp's separators); a parameter the tools do not declare is typed as an
  undeclared one (JSON if it parses).
- The same pieces as tool_calls.ToolCallParser, so every API's assembler takes either parser: ("content", text),
  ("call", {id, type, function: {name, arguments: ""}}) once `<function=NAME>` is read, ("args", text) while the
  arguments decode, ("done", call) at `</function>`. A string value streams as its JSON-escaped characters while
  they decode (a newline and a partial `</parameter>` at the end are held back until what follows shows whether
  they are part of the value); another value comes whole when its `</parameter>` arrives. The streamed fragments
  join to exactly the non-stream `arguments`.
- Several `<function=...>` blocks inside one `<tool_call>`, and several `<tool_call>` blocks, are several calls.
  Newlines the template puts around calls are not content (as tool_calls.py). A `<tool_call>` block that does not
  start with `<function=` is content, tags and all, when it closes.
- Cut off (max_tokens): an announced call ends with exactly the arguments released so far (a partial object, a
  prefix of what the whole call would have had);
  a block cut before `<function=NAME>` was complete is dropped when it could still have become one, else content.
"""
from __future__ import annotations

import json
import re
from typing import Any, Callable, Iterable, Mapping

from appliance.protocol.reasoning import _partial_tag_len
from appliance.protocol.tool_calls import CLOSE_TAG, OPEN_TAG, ContentPieces, Piece, new_call_id

FUNCTION_OPEN = "<function="
FUNCTION_CLOSE = "</function>"
PARAM_OPEN = "<parameter="
PARAM_CLOSE = "</parameter>"
_FUNCTION = re.compile(r"\s*<function=([^>\n]*)>")
_PARAM = re.compile(r"\s*<parameter=([^>\n]*)>")
_FUNCTION_END = re.compile(r"\s*</function>")


def is_string_schema(schema: Any) -> bool:
    """The parameter's value is text (a JSON string): type "string", or an enum / const of strings only."""
    if not isinstance(schema, Mapping):
        return False
    if schema.get("type") == "string":
        return True
    values = schema.get("enum", [schema["const"]] if "const" in schema else None)
    return isinstance(values, list) and bool(values) and all(isinstance(v, str) for v in values)


def string_params(tools: Iterable[Mapping[str, Any]] | bool | None) -> dict[str, set[str]]:
    """{function name: names of its string parameters} of a request's tools (OpenAI shape)."""
    out: dict[str, set[str]] = {}
    for t in tools if isinstance(tools, (list, tuple)) else ():
        fn = t.get("function") if isinstance(t, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            continue
        params = fn.get("parameters")
        props = params.get("properties") if isinstance(params, Mapping) else None
        out[fn["name"]] = {p for p, s in props.items() if is_string_schema(s)} if isinstance(props, Mapping) else set()
    return out


def value_json(text: str, as_string: bool) -> str:
    """A parameter value's JSON text (text: without the template's newlines)."""
    if not as_string:
        try:
            return json.dumps(json.loads(text), ensure_ascii=False, separators=(",", ":"))
        except ValueError:
            pass
    return json.dumps(text, ensure_ascii=False)


def _could_become(buf: str, pattern: str) -> bool:
    """buf (leading whitespace aside) is still a beginning of pattern."""
    s = buf.lstrip()
    return pattern.startswith(s) or s.startswith(pattern)


class XmlToolCallParser(ContentPieces):
    def __init__(self, new_id: Callable[[], str] = new_call_id,
                 tools: Iterable[Mapping[str, Any]] | bool | None = None):
        self._new_id = new_id
        self._strings = string_params(tools)
        self._buf = ""            # outside: a possible partial open tag; inside: the block's unconsumed text
        self._state = "out"       # out | block (before <function=) | fn (between parameters) | param | after
        self._param_string = False
        self._sent = 0            # characters of the current string value released
        self._n_params = 0
        self._pending_nl = ""
        self.calls: list[dict[str, Any]] = []

    # -- output helpers ---------------------------------------------------------------------------------------------
    def _args(self, out: list[Piece], text: str) -> None:
        if text:
            self.calls[-1]["function"]["arguments"] += text
            if out and out[-1][0] == "args":
                out[-1] = ("args", out[-1][1] + text)
            else:
                out.append(("args", text))

    def _release_string(self, out: list[Piece], value: str) -> None:
        """Stream the new part of a string value (value: its text so far, leading newline already dropped)."""
        if len(value) > self._sent:
            self._args(out, json.dumps(value[self._sent:], ensure_ascii=False)[1:-1])
            self._sent = len(value)

    def _release_open_string(self, out: list[Piece], buf: str) -> None:
        """Stream what is certain of an unclosed string value: not its first newline (the template's), nor a
        partial `</parameter>` at the end and a newline before it."""
        value = buf[1:] if buf.startswith("\n") else buf
        value = value[:len(value) - _partial_tag_len(value, PARAM_CLOSE)]
        self._release_string(out, value[:-1] if value.endswith("\n") else value)

    # -- the state machine ---------------------------------------------------------------------------------------
    def push(self, text: str) -> list[Piece]:
        out: list[Piece] = []
        self._buf += text
        while self._step(out):
            pass
        return out

    def _step(self, out: list[Piece]) -> bool:
        """Consume what the current state can; False when it needs more text."""
        buf = self._buf
        if self._state == "out":
            i = buf.find(OPEN_TAG)
            if i < 0:
                keep = _partial_tag_len(buf, OPEN_TAG)
                self._content(out, buf[:len(buf) - keep])
                self._buf = buf[len(buf) - keep:]
                return False
            self._content(out, buf[:i])
            self._buf, self._state = buf[i + len(OPEN_TAG):], "block"
            return True
        if self._state in ("block", "after"):
            m = _FUNCTION.match(buf)
            if m:
                self._open_call(out, m.group(1).strip())
                self._buf = buf[m.end():]
                return True
            j = buf.find(CLOSE_TAG)
            if j < 0:
                return False
            if self._state == "block":                       # not a call: content, tags and all
                self._content(out, OPEN_TAG + buf[:j + len(CLOSE_TAG)])
            self._buf, self._state = buf[j + len(CLOSE_TAG):], "out"   # after a call: the wrapper's tail
            return True
        if self._state == "fn":
            m = _PARAM.match(buf)
            if m:
                name = m.group(1).strip()
                fn = self.calls[-1]["function"]["name"]
                self._param_string = name in self._strings.get(fn, ())
                self._args(out, ("," if self._n_params else "{") + json.dumps(name, ensure_ascii=False) + ":")
                self._n_params += 1
                if self._param_string:
                    self._args(out, '"')
                self._buf, self._state, self._sent = buf[m.end():], "param", 0
                return True
            m = _FUNCTION_END.match(buf)
            if m:
                self._args(out, "}" if self._n_params else "{}")
                out.append(("done", self.calls[-1]))
                self._buf, self._state = buf[m.end():], "after"
                return True
            return False
        # param: the value up to </parameter>
        j = buf.find(PARAM_CLOSE)
        if j < 0:
            if self._param_string:
                self._release_open_string(out, buf)
            return False
        value = buf[:j]
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        if self._param_string:
            self._release_string(out, value)
            self._args(out, '"')
        else:
            self._args(out, value_json(value, as_string=False))
        self._buf, self._state = buf[j + len(PARAM_CLOSE):], "fn"
        return True

    def _open_call(self, out: list[Piece], name: str) -> None:
        self._pending_nl = ""
        call: dict[str, Any] = {"id": self._new_id(), "type": "function",
                                "function": {"name": name, "arguments": ""}}
        self.calls.append(call)
        out.append(("call", {**call, "function": {"name": name, "arguments": ""}}))
        self._state, self._n_params = "fn", 0

    def flush(self) -> list[Piece]:
        """At the end: an announced call ends with the arguments produced so far (a value cut in the middle keeps
        what was released of it); a block cut before its call was announced is dropped when it could still have
        become one, else it is content."""
        out: list[Piece] = []
        buf, self._buf = self._buf, ""
        state, self._state = self._state, "out"
        if state == "param" and self._param_string:
            self._release_open_string(out, buf)
        if state in ("fn", "param"):
            out.append(("done", self.calls[-1]))
            return out
        if state == "after":
            return out
        if state == "block":
            if not buf.strip() or _could_become(buf, FUNCTION_OPEN):   # cut before its name was complete
                self._pending_nl = ""
                return out
            buf = OPEN_TAG + buf
        self._content(out, buf, final=True)
        return out
