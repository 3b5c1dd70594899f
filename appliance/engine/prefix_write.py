"""PrefixWrite: what the disk prompt cache's writer thread (prompt_disk.py) writes, read straight from the cache
and copied only when the engine is about to overwrite it.

Policy: one chunk (one layer's keys or values of one KV head, or one recurrent state array) is written under the
lock detach() takes, so the engine never overwrites a chunk mid-write and never copies a written one.
"""
from __future__ import annotations

import threading

import numpy as np


class PrefixWrite:
    """The first n positions of a cache's per-layer arrays (keys of every layer, then values), written chunk by
    chunk (one layer's keys or values of one KV head: contiguous in the cache) straight from the cache, then
    the `tail` arrays (a hybrid model's recurrent states at n: copies the engine never writes). The
    engine calls detach() before it overwrites any of them: the chunks not written yet come from its prefix
    store's copy of the sequence, or are copied then. A request that only extends the prefix (the usual next
    one) costs no copy at all."""

    def __init__(self, arrays: list[np.ndarray], n: int, tail: list[np.ndarray] | None = None):
        self.n = n
        views = self._views(arrays)
        self.tail = list(tail or [])
        self.n_views = len(views)
        self.chunks: list[np.ndarray | None] = [*views, *self.tail]  # None once written (a copy is freed then)
        self.nbytes = sum(c.nbytes for c in self.chunks if c is not None)
        self.detached = False
        self._done = 0
        self._lock = threading.RLock()  # held while a chunk is written and by detach(); reentrant so a
        # detach from inside a chunk's write (as a test makes one) cannot deadlock

    def _views(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        return [a[h, :self.n] for a in arrays for h in range(a.shape[0])]

    def detach(self, copy: list[np.ndarray] | None = None) -> None:
        """Stop reading the cache: go on from `copy` (arrays holding the same first n positions) or from a
        copy of the chunks not written yet."""
        with self._lock:
            if not self.detached:
                rest = [*self._views(copy), *self.tail][self._done:] if copy is not None else \
                    [c.copy() if i < self.n_views else c for i, c in enumerate(self.chunks)
                     if i >= self._done and c is not None]
                self.chunks[self._done:] = rest
                self.detached = True

    def finish(self) -> None:
        """Written (or failed): nothing of the cache is needed any more."""
        with self._lock:
            self.chunks = []
            self.detached = True

    def write_to(self, f, digest) -> None:
        for i in range(len(self.chunks)):
            with self._lock:
                chunk = np.ascontiguousarray(self.chunks[i]).reshape(-1).view(np.uint8).data  # (a zero-size state too)
                digest.update(chunk)
                f.write(chunk)
                self.chunks[i] = None  # a copy is freed as soon as it is written
                self._done = i + 1
