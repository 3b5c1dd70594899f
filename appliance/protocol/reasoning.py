"""Split generated text into reasoning (between <think> and </think>) and content, incrementally.

Policies:
- Same split as llama.cpp's server and vLLM's Qwen3 parser: text inside a think block goes to
  `reasoning_content`, the rest to `content`. A tag is recognised wherever it appears; a tag split across pushes
  (tokens) is held back until it is complete or proven not to be a tag.
- Whitespace follows Qwen3's own chat template, which renders past turns as
  `<think>\\n` + reasoning.strip('\\n') + `\\n</think>\\n\\n` + content.lstrip('\\n'): newlines right after `<think>`
  and right after `</think>` are dropped, and newlines right before `</think>` are held back and dropped when the
  tag arrives. So streaming pieces concatenate to exactly what the template would store back.
- A prompt that already ends inside a think block (the template opened `<think>` for the model) starts in
  reasoning; `prompt_ends_in_reasoning` tells which.
"""
from __future__ import annotations

OPEN_TAG = "<think>"
CLOSE_TAG = "</think>"

Piece = tuple[str, str]   # ("reasoning" | "content", text)


def _partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def prompt_ends_in_reasoning(prompt: str) -> bool:
    """True when the rendered prompt leaves a think block open (the model continues inside it)."""
    return prompt.rfind(OPEN_TAG) > prompt.rfind(CLOSE_TAG)


class ReasoningSplitter:
    def __init__(self, in_reasoning: bool = False):
        self.in_reasoning = in_reasoning
        self.saw_reasoning = in_reasoning   # any think block seen (decides reasoning_content null vs "")
        self._buf = ""                      # text held back: a possible partial tag
        self._section_start = in_reasoning  # drop leading newlines of the current section
        self._pending_nl = ""               # trailing newlines of reasoning, released if more reasoning follows

    def _emit(self, out: list[Piece], text: str) -> None:
        if self._section_start:
            text = text.lstrip("\n")
            if text:
                self._section_start = False
        if self.in_reasoning:
            text = self._pending_nl + text
            body = text.rstrip("\n")
            self._pending_nl = text[len(body):]
            text = body
        if text:
            if out and out[-1][0] == self.kind:
                out[-1] = (self.kind, out[-1][1] + text)
            else:
                out.append((self.kind, text))

    @property
    def kind(self) -> str:
        return "reasoning" if self.in_reasoning else "content"

    def push(self, text: str) -> list[Piece]:
        out: list[Piece] = []
        buf = self._buf + text
        while True:
            tag = CLOSE_TAG if self.in_reasoning else OPEN_TAG
            i = buf.find(tag)
            if i < 0:
                keep = _partial_tag_len(buf, tag)
                self._emit(out, buf[:len(buf) - keep])
                self._buf = buf[len(buf) - keep:]
                return out
            self._emit(out, buf[:i])
            buf = buf[i + len(tag):]
            self._pending_nl = ""
            self.in_reasoning = not self.in_reasoning
            self.saw_reasoning = True
            self._section_start = True

    def flush(self) -> list[Piece]:
        """Release what is held back at the end of generation (a partial tag is plain text after all)."""
        out: list[Piece] = []
        buf, self._buf = self._buf, ""
        self._emit(out, buf)
        self._pending_nl = ""       # reasoning's trailing newlines are dropped, as the template strips them
        return out


def split_reasoning(text: str, in_reasoning: bool = False) -> tuple[str | None, str]:
    """(reasoning or None when no think block was involved, content) of a whole completion."""
    s = ReasoningSplitter(in_reasoning)
    parts: dict[str, list[str]] = {"reasoning": [], "content": []}
    for kind, piece in s.push(text) + s.flush():
        parts[kind].append(piece)
    reasoning = "".join(parts["reasoning"]) if s.saw_reasoning else None
    return reasoning, "".join(parts["content"])
