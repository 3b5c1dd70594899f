"""Weight objects the decoder calls. Any object with `shape` (out, in) and `__call__(x) -> x @ W.T` is a
linear weight; any object with `rows(ids)` is an embedding table. Quantized formats (GGUF) provide their own
classes with the same two methods, so the forward pass never knows how a weight is stored.

Policy: the numpy path keeps float32 tensors as zero-copy mmap views; BF16/F16 tensors are widened to
float32 once at load (numpy has no fast half-precision matmul). The native library reads them in place
(quant_weights.half_weight: a QuantWeight over the stored bits, which is also how mixture-of-experts experts
stay in the mapping, widened per use, without the library).
"""
from __future__ import annotations

from typing import Protocol

import numpy as np

from appliance.native.qtypes import QType


class Embedding(Protocol):
    """An embedding table: DenseWeight, QuantWeight (and resident.py's streamed wrapper)."""

    def rows(self, ids: np.ndarray) -> np.ndarray: ...  # (T,) -> (T, in)


class DenseWeight:
    """A float32 (out, in) matrix."""

    def __init__(self, w: np.ndarray):
        self.w = w  # (out, in)
        self.shape = w.shape

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return x @ self.w.T  # (T, in) -> (T, out)

    def rows(self, ids: np.ndarray) -> np.ndarray:
        return np.asarray(self.w[ids], dtype=np.float32)  # (T, in)

    def native_spec(self) -> tuple[int, np.ndarray] | None:
        """(qtype, data) the C kernels read in place, or None (see QuantWeight.native_spec)."""
        w = self.w
        if isinstance(w, np.ndarray) and w.dtype == np.float32 and w.ndim == 2 and w.flags.c_contiguous:
            return QType.F32, w
        return None

