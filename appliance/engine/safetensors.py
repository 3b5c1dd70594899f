"""Memory-mapped safetensors reader (single file or a sharded `model.safetensors.index.json`).

Policies:
- Tensors are numpy views into a read-only mmap of the file — nothing is copied at open. BF16 has no
  numpy dtype, so BF16 tensors come back as their raw uint16 bits; `to_float32` widens any of our dtypes.
- A file is validated whole when it is opened, before any tensor is handed out (files come from strangers):
  the 8-byte header length inside the file and at most MAX_HEADER, the header a JSON object of tensor entries
  (plus an optional `__metadata__` of strings), each with a dtype we read, a shape of at most MAX_DIMS
  non-negative integers, and data_offsets [begin, end] inside the data section whose length is exactly the
  shape's bytes, aligned to the element size; no two tensors share bytes. A sharded index is a weight_map of
  tensor names to shard files in the same directory, each tensor present in its shard. Any failure is a
  SafetensorsError naming the file, the tensor and the problem.
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
MAX_HEADER = 100 * 2**20
MAX_DIMS = 8  # a vision tower's patch embedding is 5-D


class SafetensorsError(ValueError):
    pass


def _int(v) -> bool:
    return type(v) is int and v >= 0


class _File:
    def __init__(self, path: str):
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise SafetensorsError(f"{path}: not a safetensors file")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or n > size - 8:
                raise SafetensorsError(f"{path}: header length {n} exceeds the file ({size} bytes) or {MAX_HEADER}")
            try:
                header = json.loads(f.read(n))
            except (ValueError, RecursionError) as e:
                raise SafetensorsError(f"{path}: bad header: {e}") from None
        if not isinstance(header, dict):
            raise SafetensorsError(f"{path}: the header is not a JSON object")
        meta = header.pop("__metadata__", None)
        if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
            raise SafetensorsError(f"{path}: __metadata__ must map names to strings")
        self.data_start = 8 + n
        self.header = header
        self._check(path, size - self.data_start)
        self.mm = np.memmap(path, dtype=np.uint8, mode="r") if size > self.data_start else np.zeros(0, np.uint8)

    def _check(self, path: str, data_size: int) -> None:
        spans = []
        for name, info in self.header.items():
            if not isinstance(info, dict):
                raise SafetensorsError(f"{path}: tensor {name}: entry is not an object")
            dt, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
            if dt not in _DTYPES:
                raise SafetensorsError(f"{path}: tensor {name}: dtype {dt} is not supported")
            if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(_int(d) for d in shape):
                raise SafetensorsError(f"{path}: tensor {name}: shape {shape!r} is not up to {MAX_DIMS} sizes >= 0")
            if not (isinstance(offsets, list) and len(offsets) == 2 and all(_int(o) for o in offsets)):
                raise SafetensorsError(f"{path}: tensor {name}: data_offsets {offsets!r} is not [begin, end]")
            a, b = offsets
            itemsize = np.dtype(_DTYPES[dt]).itemsize
            if not a <= b <= data_size:
                raise SafetensorsError(f"{path}: tensor {name}: data_offsets [{a}, {b}] lie outside the "
                                       f"{data_size}-byte data section")
            if b - a != int(np.prod(shape, dtype=object)) * itemsize:  # (object: Python ints, no overflow)
                raise SafetensorsError(f"{path}: tensor {name}: {b - a} bytes for shape {shape} of {dt}")
            if (self.data_start + a) % itemsize:
                raise SafetensorsError(f"{path}: tensor {name}: data at byte {self.data_start + a} is not "
                                       f"{itemsize}-byte aligned")
            if b > a:
                spans.append((a, b, name))
        spans.sort()
        for (_, end, x), (start, _, y) in zip(spans, spans[1:], strict=False):
            if start < end:
                raise SafetensorsError(f"{path}: tensors {x} and {y} overlap")

    def get(self, name: str) -> tuple[np.ndarray, str]:
        info = self.header[name]
        dt = info["dtype"]
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
            try:
                with open(index, encoding="utf-8") as f:
                    weight_map = json.load(f)["weight_map"]
            except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
                raise SafetensorsError(f"{index}: bad index: {e}") from None
            if not isinstance(weight_map, dict):
                raise SafetensorsError(f"{index}: weight_map is not an object")
            for name, fname in weight_map.items():
                if not isinstance(fname, str) or os.path.basename(fname) != fname or fname in ("", ".", ".."):
                    raise SafetensorsError(f"{index}: tensor {name}: shard {fname!r} is not a file in {model_dir}")
                self._where[name] = os.path.join(model_dir, fname)
            for fpath in sorted(set(self._where.values())):  # every shard validated whole before any tensor is used
                missing = [n for n, p in self._where.items() if p == fpath and n not in self._file(fpath).header]
                if missing:
                    raise SafetensorsError(f"{fpath}: tensor {missing[0]} of the index is not in this shard")
        elif os.path.exists(single):
            for name in self._file(single).header:
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

    def info(self, name: str) -> tuple[list[int], str]:
        """A tensor's shape and dtype name, from the (validated) header: nothing is mapped."""
        if name not in self._where:
            raise SafetensorsError(f"missing tensor {name}")
        entry = self._file(self._where[name]).header[name]
        return entry["shape"], entry["dtype"]

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
