"""Weights served in their stored form: GGUF block-quantized tensors (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, Q2_K,
Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS) and 16/32-bit float tensors (F16, BF16, F32), with the same protocol as
weights.DenseWeight: `shape` (out, in), `__call__(x (T, in)) -> (T, out)` float32 and `rows(ids) -> (T, in)` float32.

Policy: the block data stays the memory-mapped bytes of the file; it is never expanded to float as a whole.
With the native library, products run in C (activations rounded to 8-bit blocks for the quantized types,
as llama.cpp does); without it, the numpy path dequantizes a bounded slab of rows at a time and multiplies
in float32, so memory stays bounded and results stay close to the float reference.
Matrices of the X8_TYPES (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, IQ4_XS) are rearranged once, at their first product, into the
row-interleaved x8 layout (same size, still quantized; ~1.5x faster decode, 2x prefill); embedding tables that are
only looked up are never rearranged, and the other quantized types (Q5_0, Q5_1, IQ4_NL, Q2_K, Q3_K)
are always read in the file's layout. KESTREL_REPACK=0 keeps every product on the file's own layout. A rearranged
matrix's file pages are released afterwards (page_release), so it is resident once, not twice. Mixture-of-experts
experts are built with repack=False: they stay read in place from the mapping, so resident memory follows the
experts actually used (and their pages can be released after use) instead of growing to the whole file.
"""
from __future__ import annotations

import os
from typing import Callable

import numpy as np

from appliance.engine.page_release import release_pages
from appliance.native import kernels
from appliance.native.dequant_numpy import dequantize, get_rows
from appliance.native.qtypes import QType, qtype_of, row_bytes
from appliance.native.twins import X8_TYPES

_SLAB_ELEMS = 1 << 22  # numpy path: dequantize at most this many weights (16 MB of float32) at a time


class QuantWeight:
    """A linear weight / embedding table over raw GGML data of type `qtype`, logical shape (out, in)."""

    def __init__(self, qtype, shape, raw: np.ndarray, native: bool | None = None, repack: bool = True):
        self.qtype = qtype_of(qtype)
        out, n = (int(s) for s in shape)
        self.shape = (out, n)
        rb = row_bytes(self.qtype, n)
        raw = np.asarray(raw)
        if raw.nbytes != out * rb:
            raise ValueError(f"{self.qtype.name} tensor of shape {self.shape} needs {out * rb} bytes, "
                             f"got {raw.nbytes}")
        if not raw.flags.c_contiguous:
            raise ValueError("tensor data must be contiguous")
        self.raw = raw.reshape(-1).view(np.uint8).reshape(out, rb)  # (out, row_bytes), zero-copy
        self.nbytes = self.raw.nbytes
        self.native = kernels.available() if native is None else (native and kernels.available())
        self._native_matmul: Callable[[np.ndarray], np.ndarray] | None = None
        self._x8: np.ndarray | None = None
        self.repack = repack

    def __repr__(self) -> str:
        return f"QuantWeight({self.qtype.name}, {self.shape}, native={self.native})"

    def __call__(self, x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)  # (T, in)
        if x.ndim != 2 or x.shape[1] != self.shape[1]:
            raise ValueError(f"input of shape {x.shape} does not fit a weight of shape {self.shape}")
        if self.native:
            if self._native_matmul is None:
                self._native_matmul = kernels.bound_matmul(self.qtype, self.raw, self.x8())
            return self._native_matmul(x) if x.shape[0] else np.empty((0, self.shape[0]), np.float32)
        if self.qtype == QType.F32:
            return x @ self.raw.view(np.float32).T
        out = np.empty((x.shape[0], self.shape[0]), np.float32)  # (T, out)
        step = max(1, _SLAB_ELEMS // self.shape[1])
        for r in range(0, self.shape[0], step):
            out[:, r:r + step] = x @ dequantize(self.qtype, self.raw[r:r + step]).T
        return out

    def x8(self) -> np.ndarray | None:
        """The x8 layout of this matrix for the native kernels (made on first use), or None when its type
        has none, the library is missing or KESTREL_REPACK=0."""
        if (self._x8 is None and self.repack and self.native and self.qtype in X8_TYPES
                and os.environ.get("KESTREL_REPACK") != "0"):
            self._x8 = kernels.repack_x8(self.qtype, self.raw)
            release_pages(self.raw)  # the products read the copy now; rows() and raw still page back in
        return self._x8

    def native_spec(self) -> tuple[int, np.ndarray] | None:
        """(qtype, data) for the native decoder: the file's (rows, row_bytes) blocks or (rows, n) floats, or the
        x8 layout (qtype | kernels.X8, made here on first use); None without the library."""
        if not self.native:
            return None
        x8 = self.x8()
        return (int(self.qtype) | kernels.X8, x8) if x8 is not None else (self.qtype, self.raw)

    def rows(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.shape[0]):
            raise IndexError(f"row id out of range 0..{self.shape[0] - 1}")
        if self.native:
            return kernels.get_rows(self.qtype, self.raw, ids)  # (T, in)
        return get_rows(self.qtype, self.raw, ids)

    def dequantize(self) -> np.ndarray:
        """The whole matrix in float32 (out, in): for references and tests, not for serving."""
        return dequantize(self.qtype, self.raw)


def half_weight(w: np.ndarray, dtype: str) -> QuantWeight:
    """Serve a safetensors F16/BF16/F32 tensor (out, in) in place: `dtype` is the safetensors dtype name
    ('F16', 'BF16' or 'F32'); BF16 arrives as its uint16 bits, as safetensors.py returns it."""
    qtype = {"F16": QType.F16, "BF16": QType.BF16, "F32": QType.F32}[dtype]
    return QuantWeight(qtype, w.shape, w)
