"""The GGUF container (llama.cpp's file format) read over one read-only memory mapping: header, metadata, tensors.

Policies:
- Same view of the file as the `gguf` package's GGUFReader (`fields[key].contents()`, `tensors` with name,
  tensor_type, shape in GGUF order, data as a zero-copy view of the mapping shaped like GGUFReader's), read in
  one pass with `struct` instead of one numpy view per value: GGUFReader took ~1 s (idle) for SmolLM2's 49k
  tokens and 48k merges, most of the model's start; this takes tens of milliseconds.
- The `gguf` package is imported only for a tensor type the kernels do not know (its name and block size,
  so the error names it); the files we serve never import it.
- A file is validated before it is trusted (files come from strangers; llama.cpp's parser had a run of heap
  overflows from crafted headers). Every count and length is bounded by the bytes left in the file before
  anything is allocated for it (key and tensor counts, string lengths, array lengths, also capped at
  MAX_KEYS / MAX_TENSORS / MAX_ARRAY), arrays nest at most MAX_NESTING deep, keys and tensor names are UTF-8
  and unique; a tensor has 1..4 dimensions, each > 0, an element count that fits int64, a type GGUF defines,
  a row length of whole blocks, an offset that is a multiple of general.alignment (a power of two, uint32 as
  llama.cpp requires) and of its type's natural alignment, bytes inside the data section, and no two
  tensors' bytes overlap. This module checks the container; what a model needs of it (the tensor set, the
  shapes against the hyper-parameters) is checked by the format loader (gguf_check.py), also before any byte
  is wrapped into a weight.
- What is not a GGUF we can read is a ValueError naming the key or tensor and the problem: bad magic,
  versions other than 2 and 3, big-endian files (the kernels read little-endian blocks), truncation,
  unknown value types, duplicate keys, and the checks above.
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
UINT32 = 4
# tensor types GGUFReader gives as elements rather than bytes (the rest: uint8 rows of blocks)
ELEMENT_DTYPES = {QType.F32: np.float32, QType.F16: np.float16}
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NAME = 255  # bytes of a tensor name
MAX_KEYS, MAX_TENSORS = 1 << 16, 1 << 16  # far above any published model (a 235B MoE has ~1,100 tensors)
MAX_ARRAY = 1 << 24  # items in one metadata array (the largest vocabularies and merge lists are ~300k)
MAX_NESTING = 2  # arrays of arrays: one level (GGUFReader reads them; llama.cpp's files have none)
MAX_ELEMENTS = (1 << 63) - 1
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
MIN_KV_BYTES, MIN_TENSOR_BYTES = 8 + 4, 8 + 4 + 8 + 4 + 8  # empty key + type; empty name, n_dims, one dim, type, offset


class Field(NamedTuple):
    """One metadata value, already decoded (GGUFReader's ReaderField.contents() gives the same)."""
    name: str
    value: Any
    vtype: int = -1  # the GGUF value type (ARRAY for arrays)

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
        self._bound_count(n_kv, MIN_KV_BYTES, MAX_KEYS, "metadata key count")
        self._bound_count(n_tensors, MIN_TENSOR_BYTES, MAX_TENSORS, "tensor count")
        self.fields: dict[str, Field] = {}
        for i in range(n_kv):
            key = self._string(f"metadata key #{i}")
            if key in self.fields:
                raise ValueError(f"duplicate metadata key {key}")
            vtype = self._u32()
            try:
                self.fields[key] = Field(key, self._value(vtype), vtype)
            except ValueError as e:
                raise ValueError(f"metadata key {key}: {e}") from None
        infos = [self._tensor_info(i) for i in range(n_tensors)]
        align = self.fields.get("general.alignment")
        if align is None:
            self.alignment = DEFAULT_ALIGNMENT
        elif align.vtype != UINT32 or align.value <= 0 or align.value & (align.value - 1):
            raise ValueError(f"invalid general.alignment {align.value!r}: must be a uint32 power of two")
        else:
            self.alignment = align.value
        self.data_offset = -(-self._off // self.alignment) * self.alignment
        self.tensors = [self._tensor(*info) for info in infos]
        self._check_overlaps()

    def _bound_count(self, n: int, min_bytes: int, cap: int, what: str) -> None:
        left = len(self._buf) - self._off
        if n > cap or n * min_bytes > left:
            raise ValueError(f"{what} {n} is impossible: the {left} bytes left hold at most {left // min_bytes}"
                             f" (truncated?); the limit is {cap}")

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

    def _string(self, what: str = "") -> str:
        n = self._u64()
        where = f"{what}: " if what else ""
        if n > len(self._buf) - self._off:
            raise ValueError(f"{where}string length {n} runs past the end of the file")
        try:
            return str(self._take(n), "utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{where}not valid UTF-8") from None

    def _value(self, vtype: int, depth: int = 0) -> Any:
        if vtype == STRING:
            return self._string()
        if vtype == ARRAY:
            if depth >= MAX_NESTING:
                raise ValueError(f"arrays nested more than {MAX_NESTING} deep")
            itype, n = self._u32(), self._u64()
            size = struct.calcsize(SCALARS[itype]) if itype in SCALARS else 8 if itype in (STRING, ARRAY) else None
            if size is None:
                raise ValueError(f"unknown GGUF array item type {itype}")
            if n > MAX_ARRAY or n * size > len(self._buf) - self._off:
                raise ValueError(f"array of {n} items runs past the end of the file (or exceeds {MAX_ARRAY})")
            if itype == STRING:
                return self._strings(n)
            if itype in SCALARS:
                return list(struct.unpack(f"<{n}{SCALARS[itype]}", self._take(n * size)))
            return [self._value(itype, depth + 1) for _ in range(n)]  # arrays of arrays
        if vtype in SCALARS:
            fmt = SCALARS[vtype]
            return struct.unpack("<" + fmt, self._take(struct.calcsize(fmt)))[0]
        raise ValueError(f"unknown GGUF value type {vtype}")

    def _strings(self, n: int) -> list[str]:
        """n length-prefixed strings (a vocabulary: the loop that matters, so it is kept tight)."""
        buf, off = self._buf, self._off
        out: list[str] = []
        unpack, append, size = _U64.unpack_from, out.append, len(buf)
        try:
            for i in range(n):
                if off + 8 > size:
                    raise ValueError("GGUF file is truncated")
                length = unpack(buf, off)[0]
                off += 8
                if length > size - off:
                    raise ValueError(f"string #{i}: length {length} runs past the end of the file")
                append(str(buf[off:off + length], "utf-8"))
                off += length
        except UnicodeDecodeError:
            raise ValueError(f"string #{len(out)}: not valid UTF-8") from None
        self._off = off
        return out

    def _tensor_info(self, i: int) -> tuple[str, list[int], int, int]:
        name = self._string(f"tensor #{i}'s name")
        if not name or len(name.encode()) > MAX_NAME:
            raise ValueError(f"tensor #{i}: name of {len(name.encode())} bytes (1..{MAX_NAME})")
        n_dims = self._u32()
        if not 1 <= n_dims <= MAX_DIMS:
            raise ValueError(f"tensor {name}: {n_dims} dimensions (1..{MAX_DIMS})")
        dims = [self._u64() for _ in range(n_dims)]
        return name, dims, self._u32(), self._u64()

    # ---- tensors --------------------------------------------------------------------------------------------

    def _tensor(self, name: str, dims: list[int], type_id: int, offset: int) -> Tensor:
        n_elements = 1
        for d in dims:
            if d <= 0:
                raise ValueError(f"tensor {name}: dimension of {d} elements (each must be > 0)")
            n_elements *= d  # Python ints: no wraparound; bounded next
            if n_elements > MAX_ELEMENTS:
                raise ValueError(f"tensor {name}: shape {dims} has more than 2^63 elements")
        ne0 = dims[0]
        try:
            qtype = QType(type_id)
            block, type_bytes = BLOCK[qtype]
        except (ValueError, KeyError):  # a type the kernels do not serve: gguf's name, so the error can say it
            import gguf
            try:
                gg_type = gguf.GGMLQuantizationType(type_id)
                block, type_bytes = gguf.GGML_QUANT_SIZES[gg_type]
                qtype = gg_type  # type: ignore[assignment]  # the Tensor carries gguf's type, named in the error
            except (ValueError, KeyError):
                raise ValueError(f"tensor {name}: unknown tensor type id {type_id}") from None
        if ne0 % block:
            raise ValueError(f"tensor {name}: row length {ne0} is not a multiple of the block size {block}")
        n_bytes = n_elements // block * type_bytes
        if offset % self.alignment:
            raise ValueError(f"tensor {name}: offset {offset} is not a multiple of the alignment {self.alignment}")
        start = self.data_offset + offset
        natural = 4 if qtype == QType.F32 else 2  # float32 elements; 16-bit scales of every block type
        if start % natural:
            raise ValueError(f"tensor {name}: data at byte {start} is not {natural}-byte aligned")
        if offset > len(self.data) or n_bytes > len(self.data) - start:
            raise ValueError(f"tensor {name} lies past the end of the file (truncated?)")
        raw = self.data[start:start + n_bytes]
        outer = tuple(reversed(dims[1:]))
        dtype = ELEMENT_DTYPES.get(qtype)
        if dtype is not None:
            data = raw.view(dtype).reshape(*outer, ne0)
        else:
            data = raw.reshape(*outer, ne0 // block * type_bytes)
        return Tensor(name, qtype, np.asarray(dims, dtype=np.uint64), n_elements, n_bytes, start, data)

    def _check_overlaps(self) -> None:
        """Duplicate names, and tensors sharing bytes (one tensor's rows would serve as another's)."""
        if len({t.name for t in self.tensors}) != len(self.tensors):
            seen: set[str] = set()
            dup = next(t.name for t in self.tensors if t.name in seen or seen.add(t.name))  # type: ignore[func-returns-value]
            raise ValueError(f"duplicate tensor name {dup}")
        spans = sorted((t.data_offset, t.data_offset + t.n_bytes, t.name) for t in self.tensors)
        for (_, end, a), (start, _, b) in zip(spans, spans[1:], strict=False):
            if start < end:
                raise ValueError(f"tensors {a} and {b} overlap in the file")
