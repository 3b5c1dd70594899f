"""Incremental JSON scanning for the tool-call parsers: where a JSON value being generated ends, and the decoded
text of a JSON string being generated, fed a piece of text at a time.

Policies:
- Each scanner sees every character once (feed() looks at the new text only, never at what came before), so a
  long argument streams in linear time.
- They do not validate: the text is a model's (usually grammar-constrained) output, and what they report is
  only where a value ends (brackets and strings balanced) or what a string's characters decode to. A value that
  never ends is simply never reported as ended.
- JsonStringDecoder holds back an escape sequence until it is complete (a `\\uXXXX` high surrogate until its
  low half), so decoded text is never taken back; a lone surrogate decodes to U+FFFD.
"""
from __future__ import annotations

_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_SCALAR_END = frozenset(",}] \t\r\n")


class JsonValueEnd:
    """Finds the end of one JSON value (object, array, string or scalar) whose text starts at the first
    non-whitespace character fed."""

    def __init__(self) -> None:
        self._depth = 0
        self._started = False
        self._kind = ""          # "container", "string" or "scalar"
        self._in_string = False
        self._escape = False
        self.ended = False

    def feed(self, text: str) -> int:
        """How many characters of `text` belong to the value: len(text) while it goes on, fewer once it ended
        inside `text` (the rest follows the value). 0 once it had ended before."""
        if self.ended:
            return 0
        for i, ch in enumerate(text):
            if not self._started:
                if ch in " \t\r\n":
                    continue
                self._started = True
                self._kind = "container" if ch in "{[" else "string" if ch == '"' else "scalar"
                if self._kind == "container":
                    self._depth = 1
                elif self._kind == "string":
                    self._in_string = True
                continue
            if self._kind == "scalar":
                if ch in _SCALAR_END:
                    self.ended = True
                    return i
                continue
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._in_string = False
                    if self._kind == "string":
                        self.ended = True
                        return i + 1
                continue
            if ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self.ended = True
                    return i + 1
        return len(text)


class JsonStringDecoder:
    """Decodes the characters of a JSON string after its opening quote; `ended` once its closing quote came."""

    def __init__(self) -> None:
        self._esc = ""           # an escape sequence so far (starts with a backslash)
        self._high = 0           # a decoded high surrogate waiting for its low half
        self.ended = False

    def feed(self, text: str) -> tuple[str, int]:
        """(decoded text released, characters of `text` consumed: all of them unless the string closed)."""
        out: list[str] = []
        if self.ended:
            return "", 0
        for i, ch in enumerate(text):
            if self._esc:
                self._esc += ch
                if self._esc[1] == "u" and len(self._esc) < 6:
                    continue
                self._escaped(self._esc, out)
                self._esc = ""
                continue
            if ch == "\\":
                self._esc = ch
                continue
            if self._high:
                out.append("\ufffd")
                self._high = 0
            if ch == '"':
                self.ended = True
                return "".join(out), i + 1
            out.append(ch)
        return "".join(out), len(text)

    def _escaped(self, seq: str, out: list[str]) -> None:
        if seq[1] != "u":
            text, code = _ESCAPES.get(seq[1], seq[1]), -1
        else:
            try:
                code = int(seq[2:], 16)
            except ValueError:
                code = 0xFFFD
            text = ""
        if self._high:
            if 0xDC00 <= code < 0xE000:
                out.append(chr(0x10000 + ((self._high - 0xD800) << 10) + (code - 0xDC00)))
                self._high = 0
                return
            out.append("\ufffd")
            self._high = 0
        if 0xD800 <= code < 0xDC00:
            self._high = code
        elif code >= 0:
            out.append("\ufffd" if 0xDC00 <= code < 0xE000 else chr(code))
        else:
            out.append(text)

    def flush(self) -> str:
        """At the end of the text: a held high surrogate is U+FFFD; a partial escape is dropped."""
        high, self._high, self._esc = self._high, 0, ""
        return "\ufffd" if high else ""
