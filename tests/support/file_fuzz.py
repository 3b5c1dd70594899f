"""Mutations of valid model files and the worker processes that load them (the loader's fuzz tier:
tests/system/test_load_fuzz.py, and under AddressSanitizer in tests/system/test_native_sanitizers.py).

- `gguf_layout(data)`: every field of a GGUF header with its offset, size and role, read by a walker written here
  (not the product's parser), so mutations can aim at counts, lengths, types, dimensions and offsets.
- `gguf_mutations(data)` / `safetensors_mutations(data)`: the deterministic classes (truncation at every field
  boundary, each numeric field set to 0, -1, 2^31, 2^63, string lengths past the end, every type id, tensor
  offsets overlapping / misaligned / past the end, NaN/inf floats, a 10^6-entry array spliced in); hypothesis
  strategies in the test file draw bit flips and stacked mutations on top.
- `Workers`: N long-lived `python -m tests.support.load_worker` processes, each loading many files and
  answering one JSON line per file (outcome, message, peak RSS growth, seconds); a worker that dies (a signal)
  or stays silent past HANG_S is recorded against that file, killed and restarted. Each (re)started worker first
  loads the valid files it is given to warm up with (`warm`), outside any case: a process's first load also
  pays for its lazy imports and the libraries' first use (15 MB plain, 78 MB under AddressSanitizer, whose
  quarantine holds what start-up freed: 17 MB with quarantine_size_mb=0), which is no property of a case's file.
"""
from __future__ import annotations

import json
import os
import select
import struct
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Iterator, NamedTuple

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HANG_S = float(os.environ.get("KESTREL_FUZZ_HANG_S", "20"))  # a loaded machine's tail, far above a load (~15 ms)
SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
SPECIAL_INTS = {4: (0, 0xFFFFFFFF, 1 << 31, 1), 8: (0, (1 << 64) - 1, 1 << 31, 1 << 63)}  # 0, -1, 2^31, 2^63 (1)


class Pos(NamedTuple):
    off: int
    size: int
    role: str  # n_tensors n_kv strlen vtype itype alen int float n_dims dim ttype toffset
    label: str


def gguf_layout(data: bytes) -> tuple[list[Pos], int]:
    """The header's fields in file order, and the offset where the header ends."""
    out: list[Pos] = []
    off = 8
    u32 = lambda o: struct.unpack_from("<I", data, o)[0]  # noqa: E731
    u64 = lambda o: struct.unpack_from("<Q", data, o)[0]  # noqa: E731

    def string(label: str) -> str:
        nonlocal off
        n = u64(off)
        out.append(Pos(off, 8, "strlen", label))
        s = data[off + 8:off + 8 + n].decode("utf-8", "replace")
        off += 8 + n
        return s

    out += [Pos(8, 8, "n_tensors", "tensor count"), Pos(16, 8, "n_kv", "key count")]
    n_tensors, n_kv = u64(8), u64(16)
    off = 24

    def value(vtype: int, label: str) -> None:
        nonlocal off
        if vtype == 8:
            string(label)
        elif vtype == 9:
            itype = u32(off)
            out.append(Pos(off, 4, "itype", label + "[type]"))
            out.append(Pos(off + 4, 8, "alen", label + "[len]"))
            n = u64(off + 4)
            off += 12
            if itype in SCALAR_SIZES:
                off += n * SCALAR_SIZES[itype]  # array items: covered by bit flips, not one by one
                if off > len(data):
                    raise IndexError("array past the end")
                return
            for j in range(n):
                value(itype, f"{label}[{j}]")
        else:
            size = SCALAR_SIZES[vtype]
            out.append(Pos(off, size, "float" if vtype in (6, 12) else "int", label))
            off += size

    for _ in range(n_kv):
        key = string("key")
        vtype = u32(off)
        out.append(Pos(off, 4, "vtype", key + "[vtype]"))
        off += 4
        value(vtype, key)
    for _ in range(n_tensors):
        name = string("tensor name")
        out.append(Pos(off, 4, "n_dims", name + "[n_dims]"))
        nd = u32(off)
        off += 4
        if off + 8 * nd > len(data):  # a mutated count: no walk of billions of dimensions
            raise IndexError("dimensions past the end")
        for j in range(nd):
            out.append(Pos(off, 8, "dim", f"{name}[ne{j}]"))
            off += 8
        out += [Pos(off, 4, "ttype", name + "[type]"), Pos(off + 4, 8, "toffset", name + "[offset]")]
        off += 12
    return out, off


def put(data: bytes, off: int, size: int, value: int) -> bytes:
    return data[:off] + (value % (1 << (8 * size))).to_bytes(size, "little") + data[off + size:]


def gguf_mutations(data: bytes) -> Iterator[tuple[str, bytes]]:
    """(label, mutated file) for every deterministic mutation class of a valid GGUF `data`."""
    fields, end = gguf_layout(data)
    for i in (0, 4, 8, 16, 24, 25):
        yield f"truncated at {i}", data[:i]
    for p in fields:  # at every field boundary, and inside the field
        yield f"truncated at {p.label}", data[:p.off]
        yield f"truncated inside {p.label}", data[:p.off + p.size // 2]
    yield "truncated at the header's end", data[:end]
    yield "truncated in the data section", data[:end + (len(data) - end) // 2]
    yield "truncated by one byte", data[:-1]
    for p in fields:
        sizes = SPECIAL_INTS.get(p.size, (0, (1 << (8 * p.size)) - 1, 1 << (8 * p.size - 1)))
        for v in sizes:
            yield f"{p.label} = {v}", put(data, p.off, p.size, v)
        if p.role == "strlen":
            left = len(data) - p.off - 8
            yield f"{p.label} past the end", put(data, p.off, 8, left + 1)
            yield f"{p.label} to the end", put(data, p.off, 8, left)
        elif p.role in ("vtype", "itype"):
            for v in range(14):
                yield f"{p.label} = {v}", put(data, p.off, 4, v)
        elif p.role == "ttype":
            for v in range(42):
                yield f"{p.label} = {v}", put(data, p.off, 4, v)
        elif p.role == "n_dims":
            for v in (0, 2, 3, 4, 5, 99):
                yield f"{p.label} = {v}", put(data, p.off, 4, v)
        elif p.role == "dim":
            old = int.from_bytes(data[p.off:p.off + 8], "little")
            for v in (old * 2, old // 2, old + 1, old - 1, (1 << 62) + old, 1 << 32):
                yield f"{p.label} = {v}", put(data, p.off, 8, v)
        elif p.role == "float":
            fmt = "<f" if p.size == 4 else "<d"
            for v in (float("nan"), float("inf"), float("-inf"), 0.0, -1.0, 3.0e38):
                yield f"{p.label} = {v}", data[:p.off] + struct.pack(fmt, v) + data[p.off + p.size:]
    offsets = [p for p in fields if p.role == "toffset"]
    values = [int.from_bytes(data[p.off:p.off + 8], "little") for p in offsets]
    for i, p in enumerate(offsets):
        for j in (i - 1, i + 1, 0):
            if 0 <= j < len(offsets) and j != i:
                yield f"{p.label} = {offsets[j].label} (overlap)", put(data, p.off, 8, values[j])
        for delta in (1, 2, 4, 16, 32, -32):
            yield f"{p.label} + {delta}", put(data, p.off, 8, values[i] + delta)
        yield f"{p.label} past the end", put(data, p.off, 8, len(data))
    yield from spliced_arrays(data, fields, end)


def spliced_arrays(data: bytes, fields: list[Pos], end: int) -> Iterator[tuple[str, bytes]]:
    """A new key holding a 10^6-entry array, spliced in after the last key (its size padded to the alignment, so
    the tensors' offsets stay right: a valid file that must load), and the same array claiming one more item."""
    first_tensor = next(p for p in fields if p.role == "strlen" and p.label == "tensor name")
    n_kv = int.from_bytes(data[16:24], "little")
    for itype, size, label in ((0, 1, "uint8"), (4, 4, "uint32"), (8, 8, "string")):
        n = 10**6
        key = f"fuzz.big_{label}".encode()
        head = struct.pack("<Q", len(key)) + key + struct.pack("<IIQ", 9, itype, n)
        body = b"\0" * (n * size)  # strings: 10^6 empty strings (8 zero bytes each)
        pad = (-(len(head) + len(body))) % 32
        key = f"fuzz.big_{label}".encode() + b"_" * pad
        head = struct.pack("<Q", len(key)) + key + struct.pack("<IIQ", 9, itype, n)
        blob = head + body
        at = first_tensor.off
        ok = put(data[:at] + blob + data[at:], 16, 8, n_kv + 1)
        yield f"10^6-entry {label} array", ok
        yield f"10^6-entry {label} array claiming 10^6 + 1", put(ok, at + len(head) - 8, 8, n + 1)


# ---- safetensors ---------------------------------------------------------------------------------------------

def st_split(data: bytes) -> tuple[dict, bytes]:
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + n]), data[8 + n:]


def st_join(header, body: bytes, pad_to: int = 8) -> bytes:
    text = header if isinstance(header, bytes) else json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((-(8 + len(text))) % pad_to)
    return struct.pack("<Q", len(text)) + text + body


def safetensors_mutations(data: bytes) -> Iterator[tuple[str, bytes]]:
    header, body = st_split(data)
    n = int.from_bytes(data[:8], "little")
    names = [k for k in header if k != "__metadata__"]
    for i in list(range(0, 8 + n, 7)) + [8 + n, 8 + n + 1, len(data) - 1]:
        yield f"truncated at {i}", data[:i]
    for v in (0, (1 << 64) - 1, 1 << 31, 1 << 63, n - 1, n + 1, len(data), len(data) - 7):
        yield f"header length = {v}", put(data, 0, 8, v)
    for name in names:
        e = header[name]
        a, b = e["data_offsets"]

        def variant(label, name=name, **change):
            h = json.loads(json.dumps(header))
            h[name].update(change)
            return f"{name}: {label}", st_join(h, body)

        for dt in ("F32", "F16", "BF16", "I8", "U8", "F64", "BOOL", "I64", "F8_E4M3", "X", 7, None):
            yield variant(f"dtype {dt}", dtype=dt)
        shape = e["shape"]
        for k in range(len(shape)):
            for v in (0, -1, 1 << 31, 1 << 63, shape[k] * 2, shape[k] + 1, 1.5, "4", None):
                s = list(shape)
                s[k] = v
                yield variant(f"shape[{k}] = {v!r}", shape=s)
        for s in ([], [1] * 9, shape + [1], shape[:-1], list(reversed(shape)), "x", None):
            yield variant(f"shape {s!r}", shape=s)
        for off in ([0, b - a], [a + 1, b + 1], [a + 2, b + 2], [a - 4, b - 4], [b, a], [a, len(body) + 1],
                    [len(body), len(body) + b - a], [-1, b], [a, 1 << 63], [a], [a, b, b], None, "0",
                    [(1 << 64) - 1, b], [a, b + 0.5]):
            yield variant(f"data_offsets {off!r}", data_offsets=off)
    if len(names) > 1:
        h = json.loads(json.dumps(header))
        h[names[1]]["data_offsets"] = header[names[0]]["data_offsets"]
        h[names[1]]["shape"], h[names[1]]["dtype"] = header[names[0]]["shape"], header[names[0]]["dtype"]
        yield "two tensors on the same bytes", st_join(h, body)
    h = json.loads(json.dumps(header))
    yield "__metadata__ not strings", st_join({**h, "__metadata__": {"a": 1}}, body)
    yield "__metadata__ a list", st_join({**h, "__metadata__": [1]}, body)
    yield "header a list", st_join(b"[1, 2, 3]", body)
    yield "header deeply nested", st_join(b"[" * 100000 + b"]" * 100000, body)
    yield "header not UTF-8", st_join(b'{"\xff\xfe": 1}', body)
    yield "header 1e400", st_join(json.dumps(header).replace(str(len(body)), "1e400").encode(), body)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((-(8 + len(text))) % 8 + 1)  # the data section starts at an odd byte
    yield "header unaligned (odd data start)", struct.pack("<Q", len(text)) + text + body
    yield "header entry a number", st_join({**h, names[0]: 5}, body)
    yield "10^6-entry metadata", st_join({**h, "__metadata__": {f"k{i}": "" for i in range(10**6)}}, body)


# ---- the workers ---------------------------------------------------------------------------------------------

@dataclass
class Outcome:
    path: str
    label: str
    outcome: str  # loaded | refused | error | crash | hang
    message: str = ""
    status: int = 0
    growth: int = 0  # peak RSS growth while loading, bytes
    seconds: float = 0.0
    size: int = 0


class Worker:
    """One `python -m tests.support.load_worker` process; `load(path, kind)` -> Outcome, restarting after a death."""

    def __init__(self, env: dict | None = None, log_dir: str | None = None, warm: tuple[tuple[str, str], ...] = ()):
        self.env = dict(os.environ if env is None else env, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
        self.log_dir = log_dir
        self.warm = warm  # (path, kind) of valid files loaded after each start, before any case
        self.warm_growth = 0  # the warm-up's peak RSS growth, bytes (the last start's)
        self.proc: subprocess.Popen | None = None
        self.restarts = 0

    def _start(self) -> None:
        err = open(os.path.join(self.log_dir, f"worker-{id(self)}-{self.restarts}.err"), "w") if self.log_dir \
            else subprocess.DEVNULL
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.support.load_worker"], cwd=ROOT, env=self.env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err)
        if self.log_dir:
            err.close()
        ready = self._read(120.0)
        if ready is None or json.loads(ready).get("ready") is not True:
            raise RuntimeError(f"load worker did not start: {ready!r}")
        self.warm_growth = 0
        for path, kind in self.warm:
            assert self.proc.stdin is not None
            self.proc.stdin.write((json.dumps({"path": path, "kind": kind}) + "\n").encode())
            self.proc.stdin.flush()
            line = self._read(120.0)
            got = json.loads(line) if line else {}
            if got.get("outcome") != "loaded":
                raise RuntimeError(f"load worker: the warm-up file {path} did not load: {got}")
            self.warm_growth = max(self.warm_growth, got["growth"])

    def _read(self, timeout: float) -> str | None:
        assert self.proc is not None and self.proc.stdout is not None
        r, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not r:
            return None
        line = self.proc.stdout.readline()
        return line.decode() if line else ""

    def load(self, path: str, kind: str, label: str = "") -> Outcome:
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        assert self.proc is not None and self.proc.stdin is not None
        size = os.path.getsize(path) if os.path.isfile(path) else os.path.getsize(os.path.join(path, "model.safetensors"))
        try:
            self.proc.stdin.write((json.dumps({"path": path, "kind": kind}) + "\n").encode())
            self.proc.stdin.flush()
            line = self._read(HANG_S)
        except BrokenPipeError:
            line = ""
        if not line:  # silent past HANG_S, or dead
            hung = line is None
            self.proc.kill()
            rc = self.proc.wait()
            self.proc = None
            self.restarts += 1
            return Outcome(path, label, "hang" if hung else "crash", f"exit status {rc}", size=size)
        r = json.loads(line)
        return Outcome(path, label, r["outcome"], r.get("message", ""), r.get("status", 0), r.get("growth", 0),
                       r.get("seconds", 0.0), size)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


def load_all(workers: list[Worker], items: list[tuple[str, str, str]]) -> list[Outcome]:
    """Load every (path, kind, label) across the workers (one thread each), in order of items."""
    out: list[Outcome | None] = [None] * len(items)
    lock, nxt = threading.Lock(), [0]

    def run(w: Worker) -> None:
        while True:
            with lock:
                i = nxt[0]
                nxt[0] += 1
            if i >= len(items):
                return
            path, kind, label = items[i]
            out[i] = w.load(path, kind, label)

    threads = [threading.Thread(target=run, args=(w,)) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [o for o in out if o is not None]
