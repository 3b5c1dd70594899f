"""Memory-mapped safetensors reader (single file or a sharded `model.safetensors.index.json`).

Policy: tensors are numpy views into a read-only mmap of the file — nothing is copied at open. BF16 has no
numpy dtype, so BF16 tensors come back as their raw uint16 bits; `to_float32` widens any of our dtypes.
"""
from __future__ import annotations

import json
import os
import struct

import numpy as np

from appliance.native.dequant_numpy import dequantize
from appliance.native.qtypes import QType

_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64,
           "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


class SafetensorsError(ValueError):
    pass


class _File:
    def __init__(self, path: str):
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise SafetensorsError(f"{path}: not a safetensors file")
            (n,) = struct.unpack("<Q", head)
            if n > 100 * 2**20:
                raise SafetensorsError(f"{path}: header too large")
            try:
                self.header = json.loads(f.read(n))
            except ValueError as e:
                raise SafetensorsError(f"{path}: bad header: {e}") from None
        self.header.pop("__metadata__", None)
        self.data_start = 8 + n
        size = os.path.getsize(path)
        self.mm = np.memmap(path, dtype=np.uint8, mode="r") if size > self.data_start else np.zeros(0, np.uint8)

    def get(self, name: str) -> tuple[np.ndarray, str]:
        info = self.header[name]
        dt = info["dtype"]
        if dt not in _DTYPES:
            raise SafetensorsError(f"tensor {name}: dtype {dt} is not supported")
        a, b = info["data_offsets"]
        raw = self.mm[self.data_start + a:self.data_start + b]
        return raw.view(_DTYPES[dt]).reshape(info["shape"]), dt


class SafeTensors:
    """All tensors of a checkpoint directory, by name."""

    def __init__(self, model_dir: str):
        self.model_dir = model_dir  # side files (preprocessor_config.json) are read from here
        index = os.path.join(model_dir, "model.safetensors.index.json")
        single = os.path.join(model_dir, "model.safetensors")
        self._files: dict[str, _File] = {}
        self._where: dict[str, str] = {}
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            for name, fname in weight_map.items():
                self._where[name] = os.path.join(model_dir, fname)
        elif os.path.exists(single):
            for name in _File(single).header:
                self._where[name] = single
        else:
            raise SafetensorsError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")

    def _file(self, path: str) -> _File:
        if path not in self._files:
            self._files[path] = _File(path)
        return self._files[path]

    def keys(self):
        return self._where.keys()

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def raw(self, name: str) -> tuple[np.ndarray, str]:
        """The tensor as stored (a view into the mmap) and its safetensors dtype name."""
        if name not in self._where:
            raise SafetensorsError(f"missing tensor {name}")
        return self._file(self._where[name]).get(name)

    def float32(self, name: str) -> np.ndarray:
        return to_float32(*self.raw(name))


def to_float32(a: np.ndarray, dtype: str) -> np.ndarray:
    """Widen a stored tensor to float32 (F32 stays a zero-copy view; BF16 bits through the dequantizer's BF16
    case, the one widening of them)."""
    if dtype == "BF16":
        return dequantize(QType.BF16, a.reshape(1, -1)).reshape(a.shape)
    return a if a.dtype == np.float32 else a.astype(np.float32)
