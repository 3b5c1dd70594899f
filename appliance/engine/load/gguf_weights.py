"""The tensors of a GGUF file as the decoder's weight objects (gguf.py and gguf_qwen35.py build on these).

Policy: weights stay in their stored form over the file's mapping: quantized (and F16/BF16) matrices are
QuantWeight over the mapped bytes, F32 matrices zero-copy DenseWeight views, stacked experts zero-copy slices per
expert; only the small 1-D tensors (norms, biases) are read as float32 arrays. A type no kernel serves is an
UnsupportedTensorType naming the tensor, raised when the weight is wrapped.
"""
from __future__ import annotations

import numpy as np

from appliance.native.qtypes import QType

from ..quant_weights import QuantWeight
from ..weights import DenseWeight
from . import UnsupportedTensorType


class GGUFModelFile:
    """The tensors of one GGUF file by name, wrapped as the decoder's weight objects."""

    def __init__(self, reader):
        self.tensors = {t.name: t for t in reader.tensors}

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def vector(self, name: str) -> np.ndarray:
        t = self.tensors[name]
        if t.tensor_type.name not in ("F32", "F16"):
            raise ValueError(f"tensor {name} has type {t.tensor_type.name}; a 1-D tensor must be F32 or F16")
        return np.asarray(t.data, dtype=np.float32).reshape(-1)  # (n,)

    def matrix(self, name: str, row_order: np.ndarray | None = None):
        """A linear/embedding weight of numpy shape (out, in); row_order reorders rows (at load, quantized)."""
        t = self.tensors[name]
        served_type(t)
        shape = tuple(int(n) for n in reversed(t.shape))  # GGUF lists ne0 (the row length) first
        if len(shape) != 2:
            raise ValueError(f"tensor {name} has {len(shape)} dimensions; expected a matrix")
        data = t.data
        if t.tensor_type.name == "F32":
            w = np.asarray(data, dtype=np.float32).reshape(shape)  # (out, in): zero-copy mmap view
            return DenseWeight(w if row_order is None else np.ascontiguousarray(w[row_order]))
        raw = data.view(np.uint8).reshape(shape[0], -1)  # (out, bytes_per_row)
        if row_order is not None:
            raw = np.ascontiguousarray(raw[row_order])
        return QuantWeight(t.tensor_type, shape, raw)


def served_type(tensor) -> QType:
    """The weight's QType; UnsupportedTensorType (naming the tensor and its type) when no kernel serves it."""
    try:
        return QType(int(tensor.tensor_type))
    except ValueError:
        raise UnsupportedTensorType(
            f"tensor {tensor.name} has type {tensor.tensor_type.name}, which is not served (served types: "
            f"{', '.join(t.name for t in QType)})") from None


def expert_slices(tensor) -> list:
    """One (out, in) weight per expert of a stacked GGUF tensor, sharing the mapped bytes."""
    served_type(tensor)
    n_in, n_out, n_exp = (int(n) for n in tensor.shape)  # GGUF order: ne0 (row length) first
    data = tensor.data  # (E, out, in) float32 or (E, out, row_bytes) uint8
    if tensor.tensor_type.name == "F32":
        return [DenseWeight(np.asarray(data[e], dtype=np.float32).reshape(n_out, n_in)) for e in range(n_exp)]
    raw = data.view(np.uint8).reshape(n_exp, n_out, -1)
    return [QuantWeight(tensor.tensor_type, (n_out, n_in), raw[e], repack=False) for e in range(n_exp)]
