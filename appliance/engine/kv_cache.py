"""KVCache: preallocated keys and values for every layer of one sequence.

Policy: one cache per generation slot, sized to the context limit at creation (np.zeros: pages are committed
only as positions are written). `truncate(n)` keeps the first n positions for the next request (prefix
reuse), `reset()` keeps none, `rollback(n)` drops a verified draft's rejected tail; none reallocates. The
model writes through `update` and never owns the cache. Keys and values are stored as `dtype` (float16 halves
the memory of float32); attention reads them as they are stored and computes in float32. `copy_prefix` / `load_prefix` move only the used positions.
"""
from __future__ import annotations

import numpy as np

KV_TYPES = {"f16": np.float16, "f32": np.float32}


class ContextLengthError(ValueError):
    """The sequence would not fit in the context window."""


class KVCache:
    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, max_len: int, dtype=np.float32):
        self.max_len = max_len
        self.dtype = np.dtype(dtype)
        self.k = [np.zeros((n_kv_heads, max_len, head_dim), self.dtype) for _ in range(n_layers)]  # (n_kv, S, hd)
        self.v = [np.zeros((n_kv_heads, max_len, head_dim), self.dtype) for _ in range(n_layers)]
        self.length = 0  # tokens committed

    @property
    def bytes_per_token(self) -> int:
        """Keys and values of one position over all layers."""
        n_kv, _, hd = self.k[0].shape
        return 2 * len(self.k) * n_kv * hd * self.dtype.itemsize

    def check_room(self, T: int) -> None:
        """Raise ContextLengthError unless T more tokens fit after the committed ones (the one check every layer
        runner makes before writing keys and values)."""
        if self.length + T > self.max_len:
            raise ContextLengthError(f"context length {self.max_len} exceeded")

    def update(self, layer: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Store k, v (n_kv, T, hd) after the committed tokens; return all keys and values so far."""
        self.check_room(k.shape[1])
        start, end = self.length, self.length + k.shape[1]
        self.k[layer][:, start:end] = k
        self.v[layer][:, start:end] = v
        return self.k[layer][:, :end], self.v[layer][:, :end]  # (n_kv, S, hd)

    def commit(self, n: int) -> None:
        self.length += n

    def truncate(self, n: int) -> None:
        """Keep the first n committed positions (per-request state of subclasses is dropped)."""
        self.length = max(0, min(self.length, n))

    def reset(self) -> None:
        self.truncate(0)

    def rollback(self, n: int) -> None:
        """Keep the first n committed positions within the same request (a verified draft's rejected tail):
        unlike truncate, per-request state of subclasses stays."""
        self.length = max(0, min(self.length, n))

    def copy_prefix(self, n: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Copies of the first n positions: per layer (n_kv, n, hd) keys and values."""
        n = min(n, self.length)
        return [a[:, :n].copy() for a in self.k], [a[:, :n].copy() for a in self.v]

    def load_prefix(self, k: list[np.ndarray], v: list[np.ndarray], n: int) -> None:
        """Make the first n positions of copy_prefix's arrays this cache's sequence."""
        if n > self.max_len or any(a.shape[1] < n for a in k):
            raise ValueError("the copied prefix does not fit this cache")
        for dst, src in zip(self.k, k):
            dst[:, :n] = src[:, :n]
        for dst, src in zip(self.v, v):
            dst[:, :n] = src[:, :n]
        self.truncate(0)
        self.length = n
