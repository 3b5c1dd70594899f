"""The loader against hostile model files: >= 20,000 mutated copies of small valid GGUF (qwen3, qwen3moe, llama),
mmproj-shaped GGUF (the shared container reader) and safetensors files, each loaded in a worker process
(tests/support/file_fuzz.py, load_worker.py). The outcome must always be a clean refusal (a ModelFileError, one
line naming the file, CLI exit status 2) or a correct load (the weights wrapped, one forward through the layers
the load chose) — never a signal, a hang past HANG_S, a traceback, or a peak resident-set growth beyond the
file's size plus SLACK plus HEADER_FACTOR times the header's bytes (what the header really holds becomes Python
objects: a safetensors header of 10^6 metadata entries, 13 MB of JSON, takes ~130 MB to parse; no count a header
claims is ever allocated for before it is checked against the bytes that are there). The growth is a case's own:
each worker loads the valid qwen3 file and HF directory once after it starts (file_fuzz.Worker's warm-up), so a
process's first-load costs (lazy imports, the libraries' first use: 15 MB plain, 78 MB under ASan, whose
quarantine keeps what start-up freed) are charged to no case; under ASan the same limit holds.

The deterministic classes (file_fuzz.gguf_mutations / safetensors_mutations: truncation at every field boundary,
every numeric field at 0, -1, 2^31, 2^63, string lengths past the end, every type id, overlapping / misaligned /
out-of-range offsets, NaN/inf floats, a 10^6-entry array) run whole; hypothesis draws bit flips and stacked field
mutations on top. KESTREL_LOAD_FUZZ_SCALE scales the counts (the sanitizer tier runs a fraction under ASan).
Runtime: a few minutes on a loaded 2-core machine (most mutated files are refused within a millisecond).
"""
from __future__ import annotations

import itertools
import os
import shutil
import struct

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from tests.support import file_fuzz as ff, tiny_files

SCALE = float(os.environ.get("KESTREL_LOAD_FUZZ_SCALE", "1"))
SLACK = 48 << 20  # bytes of peak RSS growth allowed beyond the file size (Python objects of a load, measured ~23 MB)
HEADER_FACTOR = 12  # Python objects per byte of header: json's dicts of short strings ~10x, struct's lists ~8x
CHUNK = 400  # mutated files on disk at once
COUNTS: dict[str, int] = {}


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("fuzz-bases")
    out = {arch: tiny_files.write_gguf(str(d / f"{arch}.gguf"), arch) for arch in ("qwen3", "qwen3moe", "llama")}
    out["mmproj"] = tiny_files.write_mmproj(str(d / "mmproj.gguf"))
    out["hf"] = tiny_files.write_hf_dir(str(d / "hf"))
    return out


@pytest.fixture(scope="module")
def workers(tmp_path_factory, bases):
    logs = str(tmp_path_factory.mktemp("fuzz-logs"))
    warm = ((bases["qwen3"], "model"), (bases["hf"], "model"))  # a start's imports are not a case's growth
    ws = [ff.Worker(log_dir=logs, warm=warm) for _ in range(2)]
    yield ws
    for w in ws:
        w.close()
    print(f"\nmutated files loaded: {COUNTS} = {sum(COUNTS.values())}; worker restarts: "
          f"{sum(w.restarts for w in ws)}")


def write_case(base: str, kind: str, data: bytes, dst: str) -> str:
    """The mutated bytes as a model path: a .gguf file, or an HF directory (the other files linked) for safetensors."""
    if kind != "hf":
        with open(dst + ".gguf", "wb") as f:
            f.write(data)
        return dst + ".gguf"
    os.makedirs(dst)
    for name in os.listdir(base):
        if name != "model.safetensors":
            os.symlink(os.path.join(base, name), os.path.join(dst, name))
    with open(os.path.join(dst, "model.safetensors"), "wb") as f:
        f.write(data)
    return dst


def header_bytes(data: bytes, kind: str) -> int:
    if kind == "hf":
        return min(len(data), 8 + int.from_bytes(data[:8].ljust(8, b"\0"), "little"))
    try:
        return ff.gguf_layout(data)[1]
    except (struct.error, IndexError, KeyError, ValueError, OverflowError, RecursionError):  # damaged: all of it
        return len(data)


def assert_clean(o: ff.Outcome, kind: str, header: int = 0) -> None:
    where = f"[{o.label}] {o.path}"
    assert o.outcome in ("loaded", "refused"), f"{where}: {o.outcome}: {o.message[-3000:]}"
    allowed = o.size + SLACK + HEADER_FACTOR * header
    assert o.growth <= allowed, f"{where}: peak RSS grew {o.growth} bytes for a {o.size}-byte file (allowed {allowed})"
    if o.outcome == "refused":
        assert "\n" not in o.message and o.message, f"{where}: not one line: {o.message!r}"
        assert o.status == 2, f"{where}: exit status {o.status} for {o.message}"
        if kind != "mmproj":
            assert o.path in o.message, f"{where}: the message does not name the file: {o.message}"


def run_cases(workers, base: str, kind: str, cases, tmp_path) -> list[ff.Outcome]:
    """Load the (label, bytes) cases CHUNK at a time (the generator is never held whole: ~6,000 copies)."""
    data_kind = "container" if kind == "mmproj" else "model"
    results: list[ff.Outcome] = []
    step = max(1, round(1 / SCALE)) if SCALE < 1 else 1
    cases = itertools.islice(cases, 0, None, step)
    for n in itertools.count():
        batch = list(itertools.islice(cases, CHUNK))
        if not batch:
            break
        chunk = tmp_path / f"chunk{n}"
        chunk.mkdir()
        items = [(write_case(base, kind, data, str(chunk / f"m{i}")), data_kind, label)
                 for i, (label, data) in enumerate(batch)]
        out = ff.load_all(workers, items)
        for o, (_, data) in zip(out, batch, strict=True):
            assert_clean(o, kind, header_bytes(data, kind))
        results += out
        shutil.rmtree(chunk)
    COUNTS[kind] = COUNTS.get(kind, 0) + len(results)
    return results


@pytest.mark.parametrize("kind", ["qwen3", "qwen3moe", "llama", "mmproj"])
def test_gguf_mutation_classes(kind, bases, workers, tmp_path):
    with open(bases[kind], "rb") as f:
        data = f.read()
    results = run_cases(workers, bases[kind], kind, itertools.chain([("unmutated", data)], ff.gguf_mutations(data)),
                        tmp_path)
    by_label = {o.label: o for o in results}
    if SCALE >= 1:
        assert by_label["unmutated"].outcome == "loaded", by_label["unmutated"].message
        for label, o in by_label.items():  # what must be refused is refused; the valid splices load
            if "overlap" in label or label.startswith("truncated") or "past the end" in label \
                    or "claiming" in label or label.endswith(("[n_dims] = 0", "[n_dims] = 5", "[n_dims] = 99")):
                assert o.outcome == "refused", f"[{label}] loaded"
            if label.startswith("10^6-entry") and "claiming" not in label:
                assert o.outcome == "loaded", f"[{label}] {o.message}"
        assert len(results) >= 1000


def test_safetensors_mutation_classes(bases, workers, tmp_path):
    with open(os.path.join(bases["hf"], "model.safetensors"), "rb") as f:
        data = f.read()
    cases = itertools.chain([("unmutated", data)], ff.safetensors_mutations(data))
    results = run_cases(workers, bases["hf"], "hf", cases, tmp_path)
    by_label = {o.label: o for o in results}
    if SCALE >= 1:
        assert by_label["unmutated"].outcome == "loaded", by_label["unmutated"].message
        for label, o in by_label.items():
            if any(w in label for w in ("same bytes", "truncated", "+ 1", "[b, a]", "not UTF-8", "nested", "1e400",
                                        "dtype X", "dtype None", "= -1", "unaligned")):
                assert o.outcome == "refused", f"[{label}] loaded"


# ---- hypothesis: bit flips and stacked field mutations ------------------------------------------------------

def _fields(data: bytes, kind: str) -> tuple[int, list[ff.Pos]]:
    if kind == "hf":
        return 8 + int.from_bytes(data[:8], "little"), [ff.Pos(0, 8, "int", "header length")]
    fields, end = ff.gguf_layout(data)
    return end, fields


mutation = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 2**31), st.integers(0, 7)),
    st.tuples(st.just("field"), st.integers(0, 2**31), st.sampled_from([0, -1, 1, 2, 2**31, 2**32 - 1, 2**63, 2**64 - 1,
                                                                         2**31 - 1, 255, 65536, 10**6])),
    st.tuples(st.just("byte"), st.integers(0, 2**31), st.integers(0, 255)),
    st.tuples(st.just("cut"), st.integers(0, 2**31), st.just(0)),
)


def apply(data: bytes, kind: str, muts) -> bytes:
    end, fields = _fields(data, kind)
    for op, where, value in muts:
        if op in ("flip", "byte") and where % end >= len(data):
            continue  # after a cut: nothing there to change
        if op == "flip":
            i = where % end
            data = data[:i] + bytes([data[i] ^ (1 << value)]) + data[i + 1:]
        elif op == "byte":
            i = where % end
            data = data[:i] + bytes([value]) + data[i + 1:]
        elif op == "field":
            p = fields[where % len(fields)]
            if p.off + p.size <= len(data):
                data = ff.put(data, p.off, p.size, value)
        else:
            data = data[:where % (len(data) + 1)]
    return data


def _hypothesis_case(kind, bases, workers, tmp_path, muts, seen=[0]):  # noqa: B006  (a counter across examples)
    base = bases[kind]
    with open(base if kind != "hf" else os.path.join(base, "model.safetensors"), "rb") as f:
        data = apply(f.read(), kind, muts)
    seen[0] += 1
    dst = str(tmp_path / f"h{seen[0]}")
    path = write_case(base, kind, data, dst)
    o = workers[0].load(path, "container" if kind == "mmproj" else "model", f"hypothesis {muts}")
    if kind == "hf":
        shutil.rmtree(dst)
    else:
        os.unlink(path)
    assert_clean(o, kind, header_bytes(data, kind))
    COUNTS[f"{kind} (hypothesis)"] = COUNTS.get(f"{kind} (hypothesis)", 0) + 1


@pytest.mark.parametrize("kind,examples", [("qwen3", 1500), ("qwen3moe", 800), ("mmproj", 800), ("hf", 1200)])
def test_hypothesis_mutations(kind, examples, bases, workers, tmp_path):
    @settings(max_examples=max(20, int(examples * SCALE)), deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.lists(mutation, min_size=1, max_size=4))
    def case(muts):
        _hypothesis_case(kind, bases, workers, tmp_path, muts)

    case()


def test_total_count():
    """The acceptance count: >= 20,000 mutated files in the normal run (this test runs last in the module)."""
    if SCALE < 1:
        pytest.skip(f"KESTREL_LOAD_FUZZ_SCALE={SCALE}: a fraction of the run")
    assert sum(COUNTS.values()) >= 20_000, COUNTS


def test_struct_sanity():
    """The walker reads the base file the way the product does (a wrong walker would aim mutations nowhere)."""
    import tempfile

    from appliance.engine.load.gguf_file import GGUFFile
    with tempfile.TemporaryDirectory() as d:
        path = tiny_files.write_gguf(os.path.join(d, "q.gguf"))
        data = open(path, "rb").read()
        fields, end = ff.gguf_layout(data)
        f = GGUFFile(path)
        assert -(-end // 32) * 32 == f.data_offset
        assert sum(p.role == "toffset" for p in fields) == len(f.tensors)
        assert struct.unpack_from("<Q", data, 8)[0] == len(f.tensors)
