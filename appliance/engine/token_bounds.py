"""Proven lower bounds on how many tokens a text has, so that a prompt too long for the context is refused after a
bounded piece of work instead of after tokenizing all of it (a 1 MB prompt: 2 s of encoding, 500k token ids).

Policies:
- Bounds are proofs, never estimates: a text that fits is never refused. Two of them:
  1. bytes: a token stands for at most `max_token_bytes` bytes of normalized text, and the normalizer shrinks
     UTF-8 text by at most `normalizer_shrink` (none: 1; NFC: 4, Unicode's worst case being 3.5: U+1FBE U+0308
     U+0301 -> U+0390, 7 bytes -> 2). Only for byte-level vocabularies (every byte has a token, so there is no
     unknown token standing for any number of bytes) and normalizers whose shrinking is known.
  2. a prefix: the tokenizer splits the text into words (pre-tokens, added tokens among them) and tokenizes
     each word on its own, and the splitting is local (regexes without lookaround but `(?!\\S)`: a match
     depends on at most the character after it). So the words of a prefix, all but the last few, are words of
     the whole text with the same tokens: the tokens of all but the prefix's last WORD_MARGIN words are a lower
     bound for the whole text. The prefix is cut after a non-space before a space where there is one nearby,
     and never inside an added token (`<|im_start|>` cut in two would be several words of plain text).
- `encode_within(text, limit)`: the bytes bound, then prefixes of PREFIX_CHARS_PER_TOKEN * limit characters,
  growing x4, while one is shorter than the text; then the whole text once it is not provably too long. The work
  for a text that is refused is about that of one context's worth of text; for a text that fits, its own
  encoding (and, for a text of more than PREFIX_CHARS_PER_TOKEN characters per token, a third more).
- Encoding runs in the tokenizers library with the GIL released (`encode_batch*`): its `encode` holds the GIL
  for the whole run, which stalls every other Python thread, the event loop among them (measured: one 1 MB
  prompt, 2.3 s in which a 5 ms ticker thread woke 3 times; with encode_batch, 352 times).
"""
from __future__ import annotations

import json
import re
from typing import Iterable, Sequence

WORD_MARGIN = 4                # words at a prefix's end whose tokens may differ in the whole text
PREFIX_CHARS_PER_TOKEN = 8     # the first prefix: this many characters per token of the limit (English: ~4.5)
CUT_BACKOFF = 1024             # how far back a prefix's cut looks for a space
NFC_SHRINK = 4
_LOOKAROUND = re.compile(r"\(\?(?:=|!|<)")
_ALLOWED_LOOKAROUND = "(?!\\S)"


class TooManyTokens(ValueError):
    """The text has at least `at_least` tokens, which is not less than the limit it was checked against."""

    def __init__(self, at_least: int, limit: int):
        super().__init__(f"the text has at least {at_least} tokens (limit {limit})")
        self.at_least, self.limit = at_least, limit


def normalizer_shrink(normalizer: dict | None) -> float | None:
    """By how much a normalizer (its JSON) can shrink UTF-8 text at most; None: not known (no bytes bound)."""
    if normalizer is None:
        return 1.0
    if normalizer.get("type") == "NFC":
        return NFC_SHRINK
    if normalizer.get("type") == "Sequence":
        total = 1.0
        for n in normalizer.get("normalizers", []):
            s = normalizer_shrink(n)
            if s is None:
                return None
            total *= s
        return total
    return None


def _regexes(node) -> Iterable[str]:
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "Regex" and isinstance(v, str):
                yield v
            else:
                yield from _regexes(v)
    elif isinstance(node, list):
        for v in node:
            yield from _regexes(v)


def splitting_is_local(*parts: dict | None) -> bool:
    """Whether a normalizer and pre-tokenizer (their JSON) decide every split from nearby characters only: no
    regex lookaround but `(?!\\S)`. Anything else (a custom lookahead) could make a prefix split differently."""
    return not any(_LOOKAROUND.search(r.replace(_ALLOWED_LOOKAROUND, "")) for p in parts for r in _regexes(p))


def bytes_bound(text: str, max_token_bytes: int, shrink: float | None) -> int:
    """At least this many tokens (0 when the vocabulary gives no bytes bound)."""
    if shrink is None:
        return 0
    return int(len(text.encode("utf-8", "surrogatepass")) // (max(1, max_token_bytes) * shrink))


def complete_word_tokens(word_ids: Sequence[int | None], margin: int = WORD_MARGIN) -> int:
    """The tokens of a prefix's encoding that belong to words before its last `margin` ones."""
    last = max((w for w in word_ids if w is not None), default=-1)
    keep = last - margin
    return sum(1 for w in word_ids if w is not None and w <= keep)


def safe_cut(text: str, at: int, added: Iterable[str]) -> int:
    """A cut of text near `at` (at most `at`): after a non-space followed by a space when one is within
    CUT_BACKOFF characters, and never inside an occurrence of an added token."""
    i = at
    lo = max(1, at - CUT_BACKOFF)
    while i > lo and not (text[i].isspace() and not text[i - 1].isspace()):
        i -= 1
    if i <= lo:
        i = at
    added = [a for a in added if len(a) > 1]
    moved = True
    while moved:
        moved = False
        for a in added:
            j = text.find(a, max(0, i - len(a) + 1), i + len(a) - 1)
            if 0 <= j < i:  # the occurrence starts before the cut and ends after it
                i, moved = j, True
    return i


class BoundedEncoder:
    """`encode_within` for one `tokenizers.Tokenizer` (its normalizer and pre-tokenizer read once)."""

    def __init__(self, tk, max_token_bytes: int, byte_level: bool):
        self._tk = tk
        self.max_token_bytes = max_token_bytes
        norm = json.loads(tk.normalizer.__getstate__()) if tk.normalizer is not None else None
        pre = json.loads(tk.pre_tokenizer.__getstate__()) if tk.pre_tokenizer is not None else None
        self.shrink = normalizer_shrink(norm) if byte_level else None
        self.prefix_bound = splitting_is_local(norm, pre)
        self._added = [t.content for t in tk.get_added_tokens_decoder().values()]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tk.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids

    def at_least(self, text: str, limit: int) -> int:
        """A proven lower bound on text's tokens, worked out until it reaches `limit` (or the text is used up)."""
        n = bytes_bound(text, self.max_token_bytes, self.shrink)
        size = PREFIX_CHARS_PER_TOKEN * max(1, limit)
        while n < limit and self.prefix_bound and size < len(text):
            cut = safe_cut(text, size, self._added)
            enc = self._tk.encode_batch([text[:cut]], add_special_tokens=False)[0]
            n = max(n, complete_word_tokens(enc.word_ids))
            size *= 4
        return n

    def encode_within(self, text: str, limit: int) -> list[int]:
        """text's token ids; TooManyTokens as soon as a bound proves it has `limit` tokens or more."""
        n = self.at_least(text, limit)
        if n >= limit:
            raise TooManyTokens(n, limit)
        return self.encode(text)
