"""The GGUF container (llama.cpp's file format) read over one read-only memory mapping: header, metadata, tensors.

Policies:
- Same view of the file as the `gguf` package's GGUFReader (`fields[key].contents()`, `tensors` with name,
  tensor_type, shape in GGUF order, data as a zero-copy view of the mapping shaped like GGUFReader's), read in
  one pass with `struct` instead of one numpy view per value: GGUFReader took ~1 s (idle) for SmolLM2's 49k
  tokens and 48k merges, most of the model's start; this takes tens of milliseconds.
- The `gguf` package is imported only for a tensor type the kernels do not know (its name and block size,
  so the error names it); the files we serve never import it.
- What is not a GGUF we can read is a ValueError naming the problem: bad magic, versions other than 2 and 3,
  big-endian files (the kernels read little-endian blocks), truncation, unknown value types, duplicate keys.
"""
from __future__ import annotations

import mmap
import struct
from typing import Any, NamedTuple

import numpy as np

from appliance.native.qtypes import BLOCK, QType

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
STRING, ARRAY = 8, 9
# GGUF value type -> struct format of one little-endian item (STRING and ARRAY are read apart)
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
# tensor types GGUFReader gives as elements rather than bytes (the rest: uint8 rows of blocks)
ELEMENT_DTYPES = {QType.F32: np.float32, QType.F16: np.float16}
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


class Field(NamedTuple):
    """One metadata value, already decoded (GGUFReader's ReaderField.contents() gives the same)."""
    name: str
    value: Any

    def contents(self) -> Any:
        return self.value


class Tensor(NamedTuple):
    name: str
    tensor_type: Any  # QType (an IntEnum: equal to gguf.GGMLQuantizationType of the same id), else gguf's enum
    shape: np.ndarray  # GGUF order: ne0 (the row length) first
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray  # (…, rows, row length) elements for F32/F16, (…, rows, row bytes) uint8 for the others


class GGUFFile:
    """`GGUFFile(path)`: `fields` {key: Field} in file order, `tensors` [Tensor], `data` the mapping (uint8)."""

    def __init__(self, path: str):
        mapping = np.memmap(path, mode="r")
        self.data = mapping.view(np.ndarray)  # plain ndarray slices: numpy.memmap's per-slice bookkeeping is slow
        # the header is read from the mmap itself: its slices are bytes, the quickest to decode
        self._buf = mapping.base if isinstance(mapping.base, mmap.mmap) else self.data.data
        self._off = 0
        try:
            self._read_header()
        except struct.error:  # a length that runs past the end
            raise ValueError("GGUF file is truncated") from None
        del self._buf

    def _read_header(self) -> None:
        if bytes(self._take(4)) != MAGIC:
            raise ValueError("GGUF magic invalid")
        version = self._u32()
        if version not in VERSIONS:
            if version & 0xFFFF == 0:
                raise ValueError("big-endian GGUF files are not supported")
            raise ValueError(f"GGUF version {version} is not supported (supported: 2, 3)")
        n_tensors, n_kv = self._u64(), self._u64()
        self.fields: dict[str, Field] = {}
        for _ in range(n_kv):
            key = self._string()
            if key in self.fields:
                raise ValueError(f"duplicate metadata key {key}")
            self.fields[key] = Field(key, self._value(self._u32()))
        infos = [(self._string(), [self._u64() for _ in range(self._u32())], self._u32(), self._u64())
                 for _ in range(n_tensors)]
        align = self.fields["general.alignment"].value if "general.alignment" in self.fields else DEFAULT_ALIGNMENT
        if not isinstance(align, int) or align <= 0 or align & (align - 1):
            raise ValueError(f"invalid general.alignment {align!r}: must be a power of two")
        self.data_offset = -(-self._off // align) * align
        self.tensors = [self._tensor(*info) for info in infos]
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise ValueError("duplicate tensor names")

    # ---- the header, read sequentially --------------------------------------------------------------------

    def _take(self, n: int):
        end = self._off + n
        if end > len(self._buf):
            raise ValueError("GGUF file is truncated")
        chunk = self._buf[self._off:end]
        self._off = end
        return chunk

    def _u32(self) -> int:
        return _U32.unpack(self._take(4))[0]

    def _u64(self) -> int:
        return _U64.unpack(self._take(8))[0]

    def _string(self) -> str:
        return str(self._take(self._u64()), "utf-8")

    def _value(self, vtype: int) -> Any:
        if vtype == STRING:
            return self._string()
        if vtype == ARRAY:
            itype, n = self._u32(), self._u64()
            if itype == STRING:
                return self._strings(n)
            if itype in SCALARS:
                return list(struct.unpack(f"<{n}{SCALARS[itype]}", self._take(n * struct.calcsize(SCALARS[itype]))))
            return [self._value(itype) for _ in range(n)]  # arrays of arrays
        if vtype in SCALARS:
            fmt = SCALARS[vtype]
            return struct.unpack("<" + fmt, self._take(struct.calcsize(fmt)))[0]
        raise ValueError(f"unknown GGUF value type {vtype}")

    def _strings(self, n: int) -> list[str]:
        """n length-prefixed strings (a vocabulary: the loop that matters, so it is kept tight)."""
        buf, off = self._buf, self._off
        out: list[str] = []
        unpack, append, size = _U64.unpack_from, out.append, len(buf)
        for _ in range(n):
            length = unpack(buf, off)[0]
            off += 8
            if off + length > size:
                raise ValueError("GGUF file is truncated")
            append(str(buf[off:off + length], "utf-8"))
            off += length
        self._off = off
        return out

    # ---- tensors --------------------------------------------------------------------------------------------

    def _tensor(self, name: str, dims: list[int], type_id: int, offset: int) -> Tensor:
        n_elements = int(np.prod(dims, dtype=np.int64)) if dims else 1
        ne0 = dims[0] if dims else 1
        try:
            qtype = QType(type_id)
            block, type_bytes = BLOCK[qtype]
        except (ValueError, KeyError):  # a type the kernels do not serve: gguf's name, so the error can say it
            import gguf
            gg_type = gguf.GGMLQuantizationType(type_id)  # ValueError for ids no GGUF defines
            block, type_bytes = gguf.GGML_QUANT_SIZES[gg_type]
            qtype = gg_type  # type: ignore[assignment]  # the Tensor carries gguf's type, named in the error
        if ne0 % block:
            raise ValueError(f"tensor {name}: row length {ne0} is not a multiple of the block size {block}")
        n_bytes = n_elements // block * type_bytes
        start = self.data_offset + offset
        if start + n_bytes > len(self.data):
            raise ValueError(f"tensor {name} lies past the end of the file (truncated?)")
        raw = self.data[start:start + n_bytes]
        outer = tuple(reversed(dims[1:]))
        dtype = ELEMENT_DTYPES.get(qtype)
        if dtype is not None:
            data = raw.view(dtype).reshape(*outer, ne0)
        else:
            data = raw.reshape(*outer, ne0 // block * type_bytes)
        return Tensor(name, qtype, np.asarray(dims, dtype=np.uint64), n_elements, n_bytes, start, data)
