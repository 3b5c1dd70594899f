"""Random GGML block data for kernel tests: real quantizations (gguf's own quantizers) where gguf has one,
random-but-valid blocks (random bits, finite fp16 scales) for the K formats it can only dequantize."""
from __future__ import annotations

import gguf
import numpy as np

from appliance.native.qtypes import BLOCK, QType

# offsets of the fp16 scale fields inside a block, for the random-bits formats
_SCALE_FIELDS = {QType.Q4_K: (0, 2), QType.Q5_K: (0, 2), QType.Q6_K: (208,), QType.IQ4_NL: (0,),
                 QType.IQ4_XS: (0,), QType.Q3_K: (108,), QType.Q2_K: (80, 82)}


def random_weight(qtype: QType, rows: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """(rows, row_bytes) uint8 data of a random (rows, n) tensor stored as qtype."""
    x = rng.standard_normal((rows, n)).astype(np.float32)
    if qtype == QType.F32:
        return x.view(np.uint8).reshape(rows, -1)
    if qtype in _SCALE_FIELDS:
        bs, nbytes = BLOCK[qtype]
        b = rng.integers(0, 256, (rows, n // bs, nbytes), dtype=np.uint8)
        for off in _SCALE_FIELDS[qtype]:
            s = rng.uniform(0.0002, 0.002, b.shape[:2]).astype(np.float16)  # (rows, nb): values of order 1
            b[..., off:off + 2] = s.view(np.uint8).reshape(*b.shape[:2], 2)
        return b.reshape(rows, -1)
    q = gguf.quants.quantize(x, gguf.GGMLQuantizationType(int(qtype)))
    return np.ascontiguousarray(q).view(np.uint8).reshape(rows, -1)


def reference_dequantize(qtype: QType, raw: np.ndarray) -> np.ndarray:
    """gguf's dequantizer (the reference nobody here wrote) -> (rows, n) float32."""
    t = gguf.GGMLQuantizationType(int(qtype))
    if qtype == QType.F32:
        return raw.view(np.float32)
    if qtype == QType.F16:
        return raw.view(np.float16).astype(np.float32)
    return gguf.quants.dequantize(raw, t).astype(np.float32)
