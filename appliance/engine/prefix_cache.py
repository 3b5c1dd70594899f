"""Prefix reuse: which cached keys/values a new prompt can keep, and the LRU of earlier sequences.

Policies:
- A sequence is identified by its token ids plus, for each image-pad run, a digest of the image's pixels
  (and grid): equal ids and equal images give equal keys/values, M-RoPE positions included. Two sequences
  share the longest common prefix of ids, cut at the start of the first image run that differs.
- The engine's active cache is one sequence; `PrefixStore` keeps copies of earlier ones (only their used
  positions) under a byte budget, least recently used first out. A sequence that is a prefix of another
  adds nothing and is not kept twice; one that another extends after dropping at most `slack` tokens of its
  own (a conversation's turn-1 copy, whose answer tokens turn 2 re-tokenized) is superseded by it.
- An entry with recurrent `states` (a hybrid model's copy, recurrent_cache.py) is usable only at the positions
  it holds states for (its end, and the snapshots its cache had: prompt ends, prefill chunk boundaries): a
  prompt resumes from the longest of those it extends; it is never superseded by another sequence, and covers
  only itself.
"""
from __future__ import annotations

import collections
import hashlib
from dataclasses import dataclass, field

import numpy as np

ImageKey = tuple[int, int, bytes]  # (start, end, digest) of one image-pad run


def image_digest(pixel_values: np.ndarray, grid_thw) -> bytes:
    """Identity of a preprocessed image: its patches and grid (the grid fixes the M-RoPE positions)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(np.asarray(grid_thw, dtype=np.int64).tobytes())
    h.update(np.ascontiguousarray(pixel_values).view(np.uint8).reshape(-1).data)
    return h.digest()


def image_keys(runs: list[tuple[int, int]], images) -> tuple[ImageKey, ...]:
    """One ImageKey per image-pad run (runs and images in prompt order)."""
    return tuple((int(s), int(e), image_digest(img.pixel_values, img.grid_thw)) for (s, e), img in zip(runs, images))


def common_prefix(tokens_a, images_a: tuple[ImageKey, ...], tokens_b, images_b: tuple[ImageKey, ...]) -> int:
    """Positions that sequences a and b share: equal ids, and the same image wherever an image run starts."""
    n = min(len(tokens_a), len(tokens_b))
    if n == 0:
        return 0
    a = np.asarray(tokens_a[:n], dtype=np.int64)
    b = np.asarray(tokens_b[:n], dtype=np.int64)
    diff = np.nonzero(a != b)[0]
    if len(diff):
        n = int(diff[0])
    by_start = {k[0]: k for k in images_a}
    for key in images_b:
        if key[0] < n and by_start.get(key[0]) != key:
            n = key[0]
    starts_b = {k[0] for k in images_b}
    for key in images_a:  # an image of a where b has none at that start
        if key[0] < n and key[0] not in starts_b:
            n = key[0]
    return n


@dataclass
class CachedSequence:
    """A copy of the first len(tokens) positions of a cache."""
    tokens: list[int]
    images: tuple[ImageKey, ...]
    k: list[np.ndarray]  # per layer (n_kv, len(tokens), hd)
    v: list[np.ndarray]
    states: dict | None = None  # position -> recurrent states of every linear layer there (exact entries)
    nbytes: int = field(init=False)

    def __post_init__(self):
        self.nbytes = sum(a.nbytes for a in self.k) + sum(a.nbytes for a in self.v) \
            + sum(s.nbytes for states in (self.states or {}).values() for s in states)

    def usable(self, n: int, limit: int) -> int:
        """Positions of this entry a prompt sharing n of them can keep when at most `limit` may be kept."""
        if self.states is None:
            return min(n, limit)
        return max((p for p in self.states if p <= min(n, limit)), default=0)

    def images_within(self, n: int) -> tuple[ImageKey, ...]:
        return tuple(k for k in self.images if k[1] <= n)


class PrefixStore:
    """Copies of earlier sequences under `budget` bytes, most recently used last."""

    def __init__(self, budget: int, slack: int = 64):
        self.budget = max(0, int(budget))
        self.slack = slack
        self._entries: collections.OrderedDict[int, CachedSequence] = collections.OrderedDict()
        self._next = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self):
        return iter(list(self._entries.values()))

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    def best(self, tokens, images: tuple[ImageKey, ...], limit: int | None = None) -> tuple[CachedSequence | None, int]:
        """The entry sharing the longest usable prefix with (tokens, images), at most `limit` positions, and that
        length (0: none)."""
        best, n_best = None, 0
        limit = len(tokens) if limit is None else limit
        for e in self._entries.values():
            n = e.usable(common_prefix(e.tokens, e.images, tokens, images), limit)
            if n > n_best:
                best, n_best = e, n
        return best, n_best

    def touch(self, entry: CachedSequence) -> None:
        for key, e in self._entries.items():
            if e is entry:
                self._entries.move_to_end(key)
                return

    def covers(self, tokens, images: tuple[ImageKey, ...]) -> bool:
        """Whether some entry already holds this whole sequence (as itself or as its prefix)."""
        return any(len(e.tokens) >= len(tokens) and common_prefix(e.tokens, e.images, tokens, images) == len(tokens)
                   and (e.states is None or len(e.tokens) == len(tokens)) for e in self._entries.values())

    def add(self, entry: CachedSequence, reserve: int = 0) -> bool:
        """Keep `entry` (dropping entries it extends, then the least recently used until it fits with
        `reserve` bytes to spare); False if it cannot fit at all."""
        if entry.nbytes + reserve > self.budget:
            return False
        for key, e in list(self._entries.items()):
            if self.supersedes(entry, e):
                del self._entries[key]
        while self._entries and self.nbytes + entry.nbytes + reserve > self.budget:
            self._entries.popitem(last=False)
        self._entries[self._next] = entry
        self._next += 1
        return True

    def clear(self) -> None:
        self._entries.clear()

    def supersedes(self, new: CachedSequence, old: CachedSequence) -> bool:
        """Whether keeping `new` makes `old` not worth its memory (it adds at most `slack` tokens of its own)."""
        if old.states is not None:
            return len(new.tokens) == len(old.tokens) and common_prefix(
                old.tokens, old.images, new.tokens, new.images) == len(old.tokens)
        return common_prefix(old.tokens, old.images, new.tokens, new.images) >= len(old.tokens) - self.slack

    def discard(self, entry: CachedSequence) -> None:
        for key, e in list(self._entries.items()):
            if e is entry:
                del self._entries[key]

    def shrink(self, reserve: int) -> None:
        """Drop the least recently used entries until `reserve` more bytes fit in the budget."""
        while self._entries and self.nbytes + reserve > self.budget:
            self._entries.popitem(last=False)
