"""Turning a stream of token ids into a stream of text the caller may see.

Policies:
- IncrementalDetokenizer never releases part of a UTF-8 character: a token that ends mid-character (common for
  Chinese and emoji in byte-level BPE) holds its bytes back until the character completes. Bytes that can
  never form a character become U+FFFD, exactly as the tokenizer's decode() does, and flush() releases
  whatever is left, so the concatenated output always equals decode() of all the ids.
- StopMatcher never releases any part of a stop string. It holds back the longest tail of the text that could
  still begin a stop string, and releases it as soon as it cannot.
- Which stop wins: the one that completes first in the stream (the caller cannot wait for tokens that may
  never come — the same rule as vLLM and llama.cpp). When several complete on the same character, the one
  that starts earliest wins. This makes the result independent of how the text was cut into pushes.
  Empty stop strings are ignored.
"""
from __future__ import annotations

import codecs
from typing import Iterable, Protocol


class _TokenBytes(Protocol):
    def token_bytes(self, token_id: int, skip_special_tokens: bool = True) -> bytes: ...


class IncrementalDetokenizer:
    """push(token_id) -> the new complete text; flush() -> the rest (invalid bytes as U+FFFD)."""

    def __init__(self, tokenizer: _TokenBytes, skip_special_tokens: bool = True):
        self._token_bytes = tokenizer.token_bytes
        self._skip = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._utf8.decode(self._token_bytes(token_id, self._skip))

    def push_bytes(self, data: bytes) -> str:
        return self._utf8.decode(data)

    def flush(self) -> str:
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text

    @property
    def pending(self) -> bool:
        """True while bytes of an unfinished character are held back."""
        return bool(self._utf8.getstate()[0])


class StopMatcher:
    """push(text) -> (released, stopped); flush() -> the held-back tail once the stream ends without a stop."""

    def __init__(self, stops: Iterable[str] = ()):
        self.stops: tuple[str, ...] = tuple(dict.fromkeys(s for s in stops if s))
        self._longest = max((len(s) for s in self.stops), default=0)
        self._first_chars = frozenset(s[0] for s in self.stops)
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the stream

    def push(self, text: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self.stops:
            return text, False
        buf = self._held + text
        hit = self._first_completed(buf, len(self._held))
        if hit is not None:
            start, stop = hit
            self._held = ""
            self.stopped = True
            self.matched = stop
            return buf[:start], True
        keep = self._held_tail_length(buf)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep], False

    def flush(self) -> str:
        rest, self._held = self._held, ""
        return "" if self.stopped else rest

    @property
    def held(self) -> str:
        return self._held

    def _first_completed(self, buf: str, old: int) -> tuple[int, str] | None:
        """(start, stop) of the match that ends first in buf (ties: earliest start), or None.
        No match lies wholly inside the old held tail, so each search starts where a match could still end
        in the new text."""
        best = None  # (end, start, stop)
        for stop in self.stops:
            i = buf.find(stop, max(0, old - len(stop) + 1))
            if i >= 0:
                cand = (i + len(stop), i, stop)
                if best is None or cand[:2] < best[:2]:
                    best = cand
        return None if best is None else (best[1], best[2])

    def _held_tail_length(self, buf: str) -> int:
        """Length of the longest tail of buf that is a proper prefix of some stop string."""
        for j in range(max(0, len(buf) - self._longest + 1), len(buf)):
            if buf[j] in self._first_chars:
                tail = buf[j:]
                if any(len(s) > len(tail) and s.startswith(tail) for s in self.stops):
                    return len(buf) - j
        return 0
