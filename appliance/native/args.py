"""Argument checks shared by the ctypes wrappers (kernels.py): every array C reads is converted to the dtype and
layout C expects and its shape checked against the sizes passed with it, so a wrong shape, rank or dtype is a
ValueError or TypeError in Python, never a read or write past an array in C (tests/native/test_native_fuzz_invalid.py).
"""
from __future__ import annotations

import numpy as np

from .qtypes import BLOCK, QType, row_bytes


def real_array(x: np.ndarray, ndim: int = 2, dtype=np.float32) -> np.ndarray:
    """x as a contiguous float32 (or dtype) array of ndim dimensions, converted from any real dtype."""
    x = np.asarray(x)
    if x.dtype.kind not in "fiub":
        raise TypeError(f"expected a real-valued array, got {x.dtype}")
    x = np.ascontiguousarray(x, dtype=dtype)
    if x.ndim != max(ndim, 1):  # (ascontiguousarray makes a 0-d array 1-d)
        raise ValueError(f"expected a {ndim}-D array, got shape {x.shape}")
    return x


def whole_blocks(x: np.ndarray, bs: int) -> np.ndarray:
    """x (T, n) whose rows are whole blocks of bs values (the activation quantizers)."""
    if x.shape[1] % bs:
        raise ValueError(f"row length {x.shape[1]} is not a multiple of the block size {bs}")
    return x


def weight_rows(qtype: QType, w: np.ndarray) -> tuple[np.ndarray, int]:
    """w as (rows, row_bytes) uint8 and the logical row length n."""
    w = np.ascontiguousarray(w)
    if w.ndim < 2:
        raise ValueError(f"{qtype.name} weights must be rows (rows, row_bytes), got shape {w.shape}")
    w = w.reshape(w.shape[0], int(np.prod(w.shape[1:]))).view(np.uint8)  # (rows, row_bytes), also of no rows
    bs, nbytes = BLOCK[qtype]
    n = w.shape[1] // nbytes * bs
    if row_bytes(qtype, n) != w.shape[1]:
        raise ValueError(f"{qtype.name}: {w.shape[1]} bytes per row is not a whole number of blocks")
    return w, n


def product_out(T: int, rows: int, n: int) -> np.ndarray:
    """The (T, rows) result of a product over n: zeros when n = 0 (an empty sum; no C call is made)."""
    return np.empty((T, rows), np.float32) if n else np.zeros((T, rows), np.float32)
