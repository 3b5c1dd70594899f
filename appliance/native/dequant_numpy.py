"""Numpy twins of the C dequantizers: GGML block data (R, row_bytes) uint8 -> (R, n) float32.

Policy: each function mirrors the C reference arithmetic (float32, same operation order), so the C
dequantizer equals its twin exactly; both are checked against `gguf.quants.dequantize`, which nobody here
wrote. Block layouts are those of ggml-common.h.
"""
from __future__ import annotations

import numpy as np

from .qtypes import BLOCK, QK, QK_K, QType, row_bytes


def _f16(b: np.ndarray) -> np.ndarray:
    """Two uint8 columns (..., 2) holding a little-endian float16 -> float32 (...)."""
    return np.ascontiguousarray(b).view("<f2")[..., 0].astype(np.float32)


def _blocks(w: np.ndarray, qtype: QType) -> np.ndarray:
    bs, nbytes = BLOCK[qtype]
    w = np.ascontiguousarray(w).view(np.uint8)
    return w.reshape(w.shape[0], -1, nbytes)  # (R, nb, block bytes)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(..., 16) packed bytes -> (..., 32): low nibbles are elements 0..15, high nibbles 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)  # IQ4_NL, IQ4_XS


def q5_values(b: np.ndarray, qh_at: int) -> np.ndarray:
    """Q5_0 / Q5_1 blocks (..., block bytes), qh at byte qh_at, the nibbles after it -> values 0..31 (..., 32)
    uint8: nibbles as Q4_0's, the fifth bit of element j is bit j of the little-endian uint32 qh."""
    qh = np.ascontiguousarray(b[..., qh_at:qh_at + 4]).view("<u4")[..., 0]  # (...)
    bits = ((qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
    return _nibbles(b[..., qh_at + 4:qh_at + 20]) | (bits << 4)


def q4k_scales_mins(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 packed bytes of a Q4_K super-block (..., 12) -> 6-bit scales and mins (..., 8) as int32."""
    sc = sc.astype(np.int32)
    lo, hi = sc[..., 0:4], sc[..., 4:8]
    mix = sc[..., 8:12]
    scales = np.concatenate([lo & 63, (mix & 0x0F) | ((lo >> 6) << 4)], axis=-1)
    mins = np.concatenate([hi & 63, (mix >> 4) | ((hi >> 6) << 4)], axis=-1)
    return scales, mins


def k_values(qtype: QType, b: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K super-blocks (..., bytes) -> their unsigned values (..., 8 sub-blocks, 32) as uint8: the quants
    come in four 64-element chunks, low nibbles (sub-block 2j) then high nibbles (2j + 1); Q5_K's fifth bit of
    element l of sub-block k is bit k of qh[l]."""
    qs = b[..., -128:].reshape(*b.shape[:-1], 4, 32)
    q = np.stack([qs & 0x0F, qs >> 4], axis=-2).reshape(*b.shape[:-1], 8, 32)
    if qtype == QType.Q5_K:
        qh = b[..., 16:48]  # (..., 32)
        q = q | (((qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1) << 4)
    return q


def q6k_values(ql: np.ndarray, qh: np.ndarray) -> np.ndarray:
    """Q6_K packed low bits (..., 128) and high bits (..., 64) -> 6-bit unsigned values (..., 256) int32."""
    ql = ql.astype(np.int32).reshape(*ql.shape[:-1], 2, 64)  # two halves of 128 elements
    qh = qh.astype(np.int32).reshape(*qh.shape[:-1], 2, 32)
    lo = np.concatenate([ql[..., 0:32] & 0x0F, ql[..., 32:64] & 0x0F, ql[..., 0:32] >> 4, ql[..., 32:64] >> 4],
                        axis=-1)  # (..., 2, 128)
    hi = np.concatenate([qh & 3, (qh >> 2) & 3, (qh >> 4) & 3, (qh >> 6) & 3], axis=-1)  # (..., 2, 128)
    return (lo | (hi << 4)).reshape(*lo.shape[:-2], QK_K)


def crumbs(qs: np.ndarray) -> np.ndarray:
    """Q2_K / Q3_K low bits (..., 64) -> 2-bit values (..., 256) uint8: element 128 h + 32 j + l is bits 2j, 2j + 1
    of qs[32 h + l]."""
    qs = qs.reshape(*qs.shape[:-1], 2, 1, 32)
    return ((qs >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3).reshape(*qs.shape[:-3], QK_K)


def q3k_values(b: np.ndarray) -> np.ndarray:
    """Q3_K super-blocks (..., 110) -> values -4..3 (..., 256) int8: the 2-bit value, plus 4 when bit
    4 h + j of hmask[l] is set, minus 4 (element 128 h + 32 j + l)."""
    hbit = (b[..., None, 0:32] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # (..., 8, 32): bit k for 32 k + l
    return (crumbs(b[..., 32:96]) | (hbit.reshape(*b.shape[:-1], QK_K) << 2)).astype(np.int8) - 4


def q3k_scales(sc: np.ndarray) -> np.ndarray:
    """The 12 packed bytes of a Q3_K super-block (..., 12) -> its 16 signed 6-bit scales (..., 16) int32: low
    nibbles of bytes 0..7 then their high nibbles, and 2 high bits each from bytes 8..11."""
    sc = sc.astype(np.int32)
    lo = np.concatenate([sc[..., 0:8] & 0x0F, sc[..., 0:8] >> 4], axis=-1)
    hi = np.concatenate([(sc[..., 8:12] >> (2 * k)) & 3 for k in range(4)], axis=-1)
    return (lo | (hi << 4)) - 32


def iq4xs_scales(b: np.ndarray) -> np.ndarray:
    """IQ4_XS super-blocks (..., 136) -> the 8 signed 6-bit scales (..., 8) int32: nibble j of scales_l (low
    first) and bits 2j, 2j + 1 of the little-endian uint16 scales_h."""
    sh = np.ascontiguousarray(b[..., 2:4]).view("<u2").astype(np.int32)  # (..., 1)
    sl = b[..., 4:8].astype(np.int32)
    lo = np.stack([sl & 0x0F, sl >> 4], axis=-1).reshape(*sl.shape[:-1], 8)
    return (lo | (((sh >> (2 * np.arange(8))) & 3) << 4)) - 32


def iq4xs_values(b: np.ndarray) -> np.ndarray:
    """IQ4_XS super-blocks (..., 136) -> grid values (..., 8, 32) int8: sub-block j as IQ4_NL's block j."""
    return IQ4_VALUES[_nibbles(b[..., 8:].reshape(*b.shape[:-1], 8, 16))]


def dequantize(qtype, w: np.ndarray) -> np.ndarray:
    """Dequantize whole rows: w (R, row_bytes) uint8 (or a float array for F32/F16) -> (R, n) float32."""
    qtype = QType(int(qtype))
    w = np.asarray(w)
    if w.ndim == 1:
        w = w[None, :]
    R = w.shape[0]
    if qtype == QType.F32:
        return np.ascontiguousarray(w).view("<f4").reshape(R, -1).astype(np.float32, copy=False)
    if qtype == QType.F16:
        return np.ascontiguousarray(w).view("<f2").reshape(R, -1).astype(np.float32)
    if qtype == QType.BF16:
        bits = np.ascontiguousarray(w).view("<u2").reshape(R, -1).astype(np.uint32) << 16
        return bits.view(np.float32)
    b = _blocks(w, qtype)  # (R, nb, bytes)
    nb = b.shape[1]
    if qtype == QType.Q8_0:
        d = _f16(b[..., 0:2])[..., None]  # (R, nb, 1)
        q = b[..., 2:].view(np.int8).astype(np.float32)  # (R, nb, 32)
        y = d * q
    elif qtype == QType.Q4_0:
        d = _f16(b[..., 0:2])[..., None]
        q = (_nibbles(b[..., 2:]).astype(np.int8) - 8).astype(np.float32)
        y = d * q
    elif qtype == QType.Q4_1:
        d = _f16(b[..., 0:2])[..., None]
        m = _f16(b[..., 2:4])[..., None]
        y = d * _nibbles(b[..., 4:]).astype(np.float32) + m
    elif qtype == QType.Q5_0:
        d = _f16(b[..., 0:2])[..., None]
        y = d * (q5_values(b, 2).astype(np.float32) - np.float32(16))
    elif qtype == QType.Q5_1:
        d = _f16(b[..., 0:2])[..., None]
        m = _f16(b[..., 2:4])[..., None]
        y = d * q5_values(b, 4).astype(np.float32) + m
    elif qtype == QType.IQ4_NL:
        d = _f16(b[..., 0:2])[..., None]
        y = d * IQ4_VALUES[_nibbles(b[..., 2:])].astype(np.float32)
    elif qtype in (QType.Q4_K, QType.Q5_K):
        d = _f16(b[..., 0:2])[..., None]  # (R, nb, 1)
        dmin = _f16(b[..., 2:4])[..., None]
        sc, mn = q4k_scales_mins(b[..., 4:16])  # (R, nb, 8)
        d1 = (d * sc.astype(np.float32))[..., None]  # (R, nb, 8, 1)
        m1 = (dmin * mn.astype(np.float32))[..., None]
        y = d1 * k_values(qtype, b).astype(np.float32) - m1
    elif qtype == QType.Q2_K:
        sc = b[..., 0:16]
        d, dmin = _f16(b[..., 80:82])[..., None], _f16(b[..., 82:84])[..., None]
        dl = (d * (sc & 0x0F).astype(np.float32))[..., None]  # (R, nb, 16, 1)
        ml = (dmin * (sc >> 4).astype(np.float32))[..., None]
        y = dl * crumbs(b[..., 16:80]).reshape(R, nb, 16, 16).astype(np.float32) - ml
    elif qtype == QType.Q3_K:
        d = _f16(b[..., 108:110])[..., None]
        dl = (d * q3k_scales(b[..., 96:108]).astype(np.float32))[..., None]  # (R, nb, 16, 1)
        y = dl * q3k_values(b).reshape(R, nb, 16, 16).astype(np.float32)
    elif qtype == QType.IQ4_XS:
        d = _f16(b[..., 0:2])[..., None]
        dl = (d * iq4xs_scales(b).astype(np.float32))[..., None]  # (R, nb, 8, 1)
        y = dl * iq4xs_values(b).astype(np.float32)
    elif qtype == QType.Q6_K:
        ql, qh = b[..., 0:128], b[..., 128:192]
        sc = b[..., 192:208].view(np.int8).astype(np.float32)  # (R, nb, 16)
        d = _f16(b[..., 208:210])[..., None]
        q = (q6k_values(ql, qh) - 32).astype(np.float32).reshape(R, nb, 16, 16)
        y = (d * sc)[..., None] * q
    else:  # pragma: no cover - QType is closed
        raise ValueError(qtype)
    return y.reshape(R, nb * BLOCK[qtype][0]).astype(np.float32, copy=False)


def get_rows(qtype, w: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Dequantize only rows `ids` of w: (T,) -> (T, n) float32 (embedding lookup)."""
    return dequantize(qtype, np.asarray(w)[np.asarray(ids, dtype=np.int64)])


__all__ = ["IQ4_VALUES", "crumbs", "iq4xs_scales", "iq4xs_values", "q3k_scales", "q3k_values", "q5_values", "dequantize", "get_rows", "k_values", "q4k_scales_mins", "q6k_values", "row_bytes", "QK", "QK_K"]
