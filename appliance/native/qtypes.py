"""GGML tensor types served by the native kernels: numeric ids (the GGUF on-disk values, so a
`gguf.GGMLQuantizationType` converts with int()), block sizes and bytes per block.

Policy: this module knows block geometry only; the arithmetic lives in the numpy twins and the C sources.
"""
from __future__ import annotations

from enum import IntEnum


class QType(IntEnum):
    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    IQ4_NL = 20
    IQ4_XS = 23
    BF16 = 30


QK = 32     # elements per block of the 32-element formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL)
QK_K = 256  # elements per super-block of the K formats

# qtype -> (elements per block, bytes per block)
BLOCK = {
    QType.F32: (1, 4),
    QType.F16: (1, 2),
    QType.BF16: (1, 2),
    QType.Q8_0: (QK, 2 + QK),
    QType.Q4_0: (QK, 2 + QK // 2),
    QType.Q4_1: (QK, 4 + QK // 2),
    QType.Q5_0: (QK, 2 + 4 + QK // 2),
    QType.Q5_1: (QK, 4 + 4 + QK // 2),
    QType.IQ4_NL: (QK, 2 + QK // 2),
    QType.Q2_K: (QK_K, QK_K // 16 + QK_K // 4 + 4),
    QType.Q3_K: (QK_K, QK_K // 8 + QK_K // 4 + 12 + 2),
    QType.Q4_K: (QK_K, 4 + 12 + QK_K // 2),
    QType.Q5_K: (QK_K, 4 + 12 + QK_K // 8 + QK_K // 2),
    QType.Q6_K: (QK_K, QK_K // 2 + QK_K // 4 + QK_K // 16 + 2),
    QType.IQ4_XS: (QK_K, 2 + 2 + QK_K // 64 + QK_K // 2),
}


def qtype_of(q) -> QType:
    """Accept a QType, a gguf.GGMLQuantizationType or a plain int; reject types we do not serve."""
    try:
        return QType(int(q))
    except ValueError:
        name = getattr(q, "name", str(q))
        raise ValueError(f"tensor type {name} is not supported (supported: "
                         f"{', '.join(t.name for t in QType)})") from None


def row_bytes(qtype: QType, n: int) -> int:
    """Bytes one row of n elements occupies; n must be a whole number of blocks."""
    bs, nb = BLOCK[qtype]
    if n % bs:
        raise ValueError(f"{qtype.name}: row length {n} is not a multiple of the block size {bs}")
    return n // bs * nb
