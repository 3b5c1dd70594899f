"""Numpy twins of the C activation quantizers and matrix products (same names and argument order as the
ctypes wrappers in kernels.py). They define the arithmetic: activations rounded per block of 32 (act32) or
256 (act256) to int8 with a float32 scale (round half to even), exact integer block sums, and per output
one sequential float32 sum over blocks, so the C kernels must equal these bit for bit.

Policy: written for clarity and tests, not speed (QuantWeight's numpy path dequantizes and uses BLAS).
"""
from __future__ import annotations

import numpy as np

from .dequant_numpy import (
    IQ4_VALUES,
    _blocks,
    _f16,
    _nibbles,
    crumbs,
    dequantize,
    iq4xs_scales,
    iq4xs_values,
    k_values,
    q3k_scales,
    q3k_values,
    q4k_scales_mins,
    q5_values,
    q6k_values,
)
from .qtypes import QType

ACT32 = np.dtype([("d", "<f4"), ("sum", "<i4"), ("q", "i1", (32,))])  # C kq_act32, 40 bytes
ACT256 = np.dtype([("d", "<f4"), ("bsums", "<i2", (16,)), ("q", "i1", (256,))])  # C kq_act256, 292 bytes


def _round_blocks(x: np.ndarray, bs: int) -> tuple[np.ndarray, np.ndarray]:
    """x (T, n) -> scales (T, nb) float32 and int8 values (T, nb, bs)."""
    T, n = x.shape
    v = np.ascontiguousarray(x, dtype=np.float32).reshape(T, n // bs, bs)
    d = np.abs(v).max(axis=-1) / np.float32(127)  # (T, nb)
    inv = np.zeros_like(d)
    np.divide(np.float32(1), d, out=inv, where=d != 0)
    q = np.rint(v * inv[..., None]).astype(np.int8)  # (T, nb, bs)
    return d, q


def quantize_q8_32(x: np.ndarray) -> np.ndarray:
    """x (T, n) float32 -> (T, n/32) ACT32 blocks."""
    d, q = _round_blocks(x, 32)
    out = np.empty(d.shape, ACT32)
    out["d"], out["q"], out["sum"] = d, q, q.sum(axis=-1, dtype=np.int32)
    return out


def quantize_q8_K(x: np.ndarray) -> np.ndarray:
    """x (T, n) float32 -> (T, n/256) ACT256 blocks (bsums: sums of each 16 values)."""
    d, q = _round_blocks(x, 256)
    out = np.empty(d.shape, ACT256)
    out["d"], out["q"] = d, q
    out["bsums"] = q.reshape(*q.shape[:2], 16, 16).sum(axis=-1, dtype=np.int32).astype(np.int16)
    return out


def _sequential_sum(terms: np.ndarray) -> np.ndarray:
    """One float32 sum per output, adding terms (..., k) left to right (like the C accumulator)."""
    return np.add.accumulate(terms.astype(np.float32), axis=-1, dtype=np.float32)[..., -1]


def _idot(wq: np.ndarray, aq: np.ndarray) -> np.ndarray:
    """Integer block dots: weights (R, nb, k) x activations (T, nb, k) -> (T, R, nb) int64 (exact)."""
    return np.einsum("rbk,tbk->trb", wq.astype(np.int64), aq.astype(np.int64))


B32_TYPES = (QType.Q8_0, QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.IQ4_NL)  # act32 activations


def matmul(qtype, w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """out (T, rows) = x (T, n) @ W.T with W stored as qtype rows w (rows, row_bytes)."""
    qtype = QType(int(qtype))
    x = np.ascontiguousarray(x, dtype=np.float32)
    if qtype in (QType.F32, QType.F16, QType.BF16):
        return x @ dequantize(qtype, w).T
    b = _blocks(w, qtype)  # (R, nb, block bytes)
    if qtype in B32_TYPES:
        a = quantize_q8_32(x)  # (T, nb)
        ad = a["d"][:, None, :]  # (T, 1, nb)
        dd = _f16(b[..., 0:2])[None] * ad  # (T, R, nb)
        if qtype == QType.Q8_0:
            s = _idot(b[..., 2:].view(np.int8), a["q"])
        elif qtype == QType.Q4_0:
            s = _idot(_nibbles(b[..., 2:]), a["q"]) - 8 * a["sum"][:, None, :]
        elif qtype == QType.Q5_0:
            s = _idot(q5_values(b, 2), a["q"]) - 16 * a["sum"][:, None, :]
        elif qtype == QType.IQ4_NL:
            s = _idot(IQ4_VALUES[_nibbles(b[..., 2:])], a["q"])
        else:  # Q4_1, Q5_1: d * q + m
            s = _idot(_nibbles(b[..., 4:]) if qtype == QType.Q4_1 else q5_values(b, 4), a["q"])
            ms = _f16(b[..., 2:4])[None] * (ad * a["sum"][:, None, :].astype(np.float32))  # (T, R, nb)
            return _sequential_sum(np.stack([dd * s.astype(np.float32), ms], axis=-1).reshape(*dd.shape[:2], -1))
        return _sequential_sum(dd * s.astype(np.float32))
    a = quantize_q8_K(x)  # (T, nb)
    ad = a["d"][:, None, :]
    aq = a["q"].reshape(*a.shape, 8, 32)  # (T, nb, 8 sub-blocks, 32)
    if qtype in (QType.Q4_K, QType.Q5_K):
        sc, mn = q4k_scales_mins(b[..., 4:16])  # (R, nb, 8)
        u = k_values(qtype, b)  # (R, nb, 8, 32) unsigned
        sub = np.einsum("rbjk,tbjk->trbj", u.astype(np.int64), aq.astype(np.int64))  # (T, R, nb, 8)
        isum = (sub * sc[None]).sum(axis=-1)  # (T, R, nb)
        pair = a["bsums"].astype(np.int64).reshape(*a.shape, 8, 2).sum(axis=-1)  # (T, nb, 8)
        msum = np.einsum("rbj,tbj->trb", mn.astype(np.int64), pair)
        dd = _f16(b[..., 0:2])[None] * ad
        dm = _f16(b[..., 2:4])[None] * ad
        terms = np.stack([dd * isum.astype(np.float32), -(dm * msum.astype(np.float32))], axis=-1)
        return _sequential_sum(terms.reshape(*dd.shape[:2], -1))
    if qtype in (QType.Q6_K, QType.Q3_K, QType.Q2_K):  # 16 groups of 16 values, a signed scale each (Q2_K: + a min)
        if qtype == QType.Q6_K:
            v, sc, d = q6k_values(b[..., 0:128], b[..., 128:192]) - 32, b[..., 192:208].view(np.int8), b[..., 208:210]
        elif qtype == QType.Q3_K:
            v, sc, d = q3k_values(b), q3k_scales(b[..., 96:108]), b[..., 108:110]
        else:
            v, sc, d = crumbs(b[..., 16:80]), b[..., 0:16] & 0x0F, b[..., 80:82]
        grp = np.einsum("rbgk,tbgk->trbg", v.reshape(*b.shape[:2], 16, 16).astype(np.int64),
                        a["q"].reshape(*a.shape, 16, 16).astype(np.int64))  # (T, R, nb, 16)
        isum = (grp * sc.astype(np.int64)[None]).sum(axis=-1)
        dd = _f16(d)[None] * ad
        if qtype != QType.Q2_K:
            return _sequential_sum(dd * isum.astype(np.float32))
        msum = np.einsum("rbg,tbg->trb", (b[..., 0:16] >> 4).astype(np.int64), a["bsums"].astype(np.int64))
        dm = _f16(b[..., 82:84])[None] * ad
        terms = np.stack([dd * isum.astype(np.float32), -(dm * msum.astype(np.float32))], axis=-1)
        return _sequential_sum(terms.reshape(*dd.shape[:2], -1))
    if qtype == QType.IQ4_XS:  # 8 sub-blocks of 32 grid values, a signed scale each
        sub = np.einsum("rbjk,tbjk->trbj", iq4xs_values(b).astype(np.int64), aq.astype(np.int64))  # (T, R, nb, 8)
        isum = (sub * iq4xs_scales(b).astype(np.int64)[None]).sum(axis=-1)
        dd = _f16(b[..., 0:2])[None] * ad
        return _sequential_sum(dd * isum.astype(np.float32))
    raise ValueError(qtype)  # pragma: no cover


X8_TYPES = (QType.Q8_0, QType.Q4_0, QType.Q4_1, QType.Q4_K, QType.Q5_K, QType.Q6_K, QType.IQ4_XS)
Q4K_X8_BYTES = 1184  # one Q4_K super-block of 8 rows in the x8 layout
Q5K_X8_BYTES = 1440  # one Q5_K super-block of 8 rows: Q4_K's group, then qh in 4-byte row slices (256)
IQ4XS_X8_BYTES = 1104  # one IQ4_XS super-block of 8 rows: d[8], int8 scales [sub-block][row], quants in slices


def repack_x8(qtype, w: np.ndarray) -> np.ndarray:
    """Rows (R, row_bytes) of a 32-element format -> the x8 layout (ceil(R/8), row_bytes*8) (see src/repack.c):
    per group of 8 rows and per block, the 8 scales (then the 8 mins for Q4_1), then the quants in 4-byte
    slices, slice k holding bytes 4k..4k+3 of rows 0..7. Missing rows of the last group are zero blocks."""
    qtype = QType(int(qtype))
    b = _blocks(w, qtype)  # (R, nb, block bytes)
    R, nb, bpb = b.shape
    G = -(-R // 8)
    b = np.concatenate([b, np.zeros((G * 8 - R, nb, bpb), np.uint8)]).reshape(G, 8, nb, bpb).transpose(0, 2, 1, 3)
    if qtype == QType.Q6_K:  # d[8], int8 scales [group][row], then ql and qh in 4-byte row slices
        parts = [b[..., 208:210].reshape(G, nb, 16), b[..., 192:208].transpose(0, 1, 3, 2).reshape(G, nb, 128),
                 b[..., 0:128].reshape(G, nb, 8, 32, 4).transpose(0, 1, 3, 2, 4).reshape(G, nb, 1024),
                 b[..., 128:192].reshape(G, nb, 8, 16, 4).transpose(0, 1, 3, 2, 4).reshape(G, nb, 512)]
        return np.ascontiguousarray(np.concatenate(parts, axis=-1).reshape(G, -1))
    if qtype == QType.IQ4_XS:  # d[8], the signed scales as int8 [sub-block][row], quants in 4-byte row slices
        real = (np.arange(G * 8) < R).reshape(G, 1, 8, 1)  # the padding rows' scales stay 0, as their blocks' bytes
        sc = (iq4xs_scales(b) * real).astype(np.int8).view(np.uint8)  # (G, nb, 8 rows, 8 sub-blocks)
        parts = [b[..., 0:2].reshape(G, nb, 16), sc.transpose(0, 1, 3, 2).reshape(G, nb, 64),
                 b[..., 8:136].reshape(G, nb, 8, 32, 4).transpose(0, 1, 3, 2, 4).reshape(G, nb, 1024)]
        return np.ascontiguousarray(np.concatenate(parts, axis=-1).reshape(G, -1))
    if qtype in (QType.Q4_K, QType.Q5_K):  # d[8], dmin[8], scales, mins as bytes [sub-block][row], 4-byte slices
        sc, mn = q4k_scales_mins(b[..., 4:16])  # (G, nb, 8 rows, 8 sub-blocks)
        q0 = 48 if qtype == QType.Q5_K else 16
        qs = b[..., q0:q0 + 128].reshape(G, nb, 8, 4, 8, 4).transpose(0, 1, 3, 4, 2, 5).reshape(G, nb, 1024)
        parts = [b[..., 0:2].reshape(G, nb, 16), b[..., 2:4].reshape(G, nb, 16),
                 sc.transpose(0, 1, 3, 2).reshape(G, nb, 64).astype(np.uint8),
                 mn.transpose(0, 1, 3, 2).reshape(G, nb, 64).astype(np.uint8), qs]
        if qtype == QType.Q5_K:  # qh: slice k holds qh[4k..4k+3] of rows 0..7
            parts.append(b[..., 16:48].reshape(G, nb, 8, 8, 4).transpose(0, 1, 3, 2, 4).reshape(G, nb, 256))
        return np.ascontiguousarray(np.concatenate(parts, axis=-1).reshape(G, -1))
    head = 4 if qtype == QType.Q4_1 else 2
    parts = [b[..., 0:2].reshape(G, nb, 16)]  # (G, nb, 8 scales)
    if head == 4:
        parts.append(b[..., 2:4].reshape(G, nb, 16))
    qs = b[..., head:]  # (G, nb, 8, qbytes)
    q = qs.shape[-1]
    parts.append(qs.reshape(G, nb, 8, q // 4, 4).transpose(0, 1, 3, 2, 4).reshape(G, nb, 8 * q))
    return np.ascontiguousarray(np.concatenate(parts, axis=-1).reshape(G, -1))


def unpack_x8(qtype, w8: np.ndarray, rows: int) -> np.ndarray:
    """Inverse of repack_x8: back to (rows, row_bytes)."""
    qtype = QType(int(qtype))
    G = w8.shape[0]
    if qtype == QType.Q6_K:
        o = w8.reshape(G, -1, 1680)  # (G, nb, bytes)
        nb = o.shape[1]
        blocks = np.concatenate([
            o[..., 144:1168].reshape(G, nb, 32, 8, 4).transpose(0, 1, 3, 2, 4).reshape(G, nb, 8, 128),
            o[..., 1168:1680].reshape(G, nb, 16, 8, 4).transpose(0, 1, 3, 2, 4).reshape(G, nb, 8, 64),
            o[..., 16:144].reshape(G, nb, 16, 8).transpose(0, 1, 3, 2),
            o[..., 0:16].reshape(G, nb, 8, 2)], axis=-1)  # (G, nb, row, 210)
        return blocks.transpose(0, 2, 1, 3).reshape(G * 8, -1)[:rows]
    if qtype == QType.IQ4_XS:
        o = w8.reshape(G, -1, IQ4XS_X8_BYTES)  # (G, nb, bytes)
        nb = o.shape[1]
        ls = (o[..., 16:80].view(np.int8).astype(np.int32) + 32).reshape(G, nb, 8, 8).transpose(0, 1, 3, 2)  # (.., row, j)
        sh = (ls >> 4 << (2 * np.arange(8))).sum(axis=-1).astype("<u2")  # (G, nb, row)
        sl = ((ls[..., 0::2] & 0x0F) | ((ls[..., 1::2] & 0x0F) << 4)).astype(np.uint8)  # (G, nb, row, 4)
        qs = o[..., 80:].reshape(G, nb, 32, 8, 4).transpose(0, 1, 3, 2, 4).reshape(G, nb, 8, 128)
        blocks = np.concatenate([o[..., 0:16].reshape(G, nb, 8, 2), sh[..., None].view(np.uint8), sl, qs],
                                axis=-1)  # (G, nb, row, 136)
        return blocks.transpose(0, 2, 1, 3).reshape(G * 8, -1)[:rows]
    if qtype in (QType.Q4_K, QType.Q5_K):
        o = w8.reshape(G, -1, Q5K_X8_BYTES if qtype == QType.Q5_K else Q4K_X8_BYTES)  # (G, nb, bytes)
        nb = o.shape[1]
        sc = o[..., 32:96].reshape(G, nb, 8, 8).transpose(0, 1, 3, 2).astype(np.uint8)  # (G, nb, row, sub)
        mn = o[..., 96:160].reshape(G, nb, 8, 8).transpose(0, 1, 3, 2).astype(np.uint8)
        packed = np.empty((G, nb, 8, 12), np.uint8)
        packed[..., 0:4] = sc[..., 0:4] | ((sc[..., 4:8] >> 4) << 6)
        packed[..., 4:8] = mn[..., 0:4] | ((mn[..., 4:8] >> 4) << 6)
        packed[..., 8:12] = (sc[..., 4:8] & 0x0F) | ((mn[..., 4:8] & 0x0F) << 4)
        qs = o[..., 160:1184].reshape(G, nb, 4, 8, 8, 4).transpose(0, 1, 4, 2, 3, 5).reshape(G, nb, 8, 128)
        qh = o[..., 1184:].reshape(G, nb, -1, 8, 4).transpose(0, 1, 3, 2, 4).reshape(G, nb, 8, -1)  # Q5_K: 32 bytes
        blocks = np.concatenate([o[..., 0:16].reshape(G, nb, 8, 2), o[..., 16:32].reshape(G, nb, 8, 2), packed, qh,
                                 qs], axis=-1)  # (G, nb, row, 144 or 176)
        return blocks.transpose(0, 2, 1, 3).reshape(G * 8, -1)[:rows]
    head = 4 if qtype == QType.Q4_1 else 2
    q = 32 if qtype == QType.Q8_0 else 16
    o = w8.reshape(G, -1, 8 * (head + q))  # (G, nb, 8 blocks' bytes)
    nb = o.shape[1]
    d = o[..., 0:16].reshape(G, nb, 8, 2)
    parts = [d]
    if head == 4:
        parts.append(o[..., 16:32].reshape(G, nb, 8, 2))
    qs = o[..., 8 * head:].reshape(G, nb, q // 4, 8, 4).transpose(0, 1, 3, 2, 4).reshape(G, nb, 8, q)
    parts.append(qs)
    blocks = np.concatenate(parts, axis=-1).transpose(0, 2, 1, 3).reshape(G * 8, -1)  # (G*8, row_bytes)
    return blocks[:rows]


def matmul_x8(qtype, w8: np.ndarray, rows: int, x: np.ndarray) -> np.ndarray:
    """out (T, rows) = x @ W.T with W in the x8 layout: the same arithmetic as matmul on the row layout."""
    return matmul(qtype, unpack_x8(qtype, w8, rows), x)
