"""KVCache: preallocated keys and values for every layer of one sequence.

Policy: one cache per generation slot, sized to the context limit at creation; `reset()` frees the slot for
the next request without reallocating. The model writes through `update` and never owns the cache.
"""
from __future__ import annotations

import numpy as np


class ContextLengthError(ValueError):
    """The sequence would not fit in the context window."""


class KVCache:
    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, max_len: int, dtype=np.float32):
        self.max_len = max_len
        self.k = [np.zeros((n_kv_heads, max_len, head_dim), dtype) for _ in range(n_layers)]  # (n_kv, S, hd)
        self.v = [np.zeros((n_kv_heads, max_len, head_dim), dtype) for _ in range(n_layers)]
        self.length = 0  # tokens committed

    def update(self, layer: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Store k, v (n_kv, T, hd) after the committed tokens; return all keys and values so far."""
        start, end = self.length, self.length + k.shape[1]
        if end > self.max_len:
            raise ContextLengthError(f"context length {self.max_len} exceeded")
        self.k[layer][:, start:end] = k
        self.v[layer][:, start:end] = v
        return self.k[layer][:, :end], self.v[layer][:, :end]  # (n_kv, S, hd)

    def commit(self, n: int) -> None:
        self.length += n

    def reset(self) -> None:
        self.length = 0
