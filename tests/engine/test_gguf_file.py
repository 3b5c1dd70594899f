"""GGUFFile (appliance/engine/load/gguf_file.py) reads what the `gguf` package's GGUFReader reads: every metadata
value with its Python type, every tensor's name, type, shape, offset and bytes; on the real SmolLM2 file and on a
file written here with every value type; and refuses damaged files with a ValueError that says why."""
from __future__ import annotations

import os

import gguf
import numpy as np
import pytest

from appliance.engine.load import ModelLoadError, load_model
from appliance.engine.load.gguf_file import GGUFFile
from tests.support.gguf_files import fetch_smollm2


def assert_same_as_gguf_reader(path: str) -> None:
    ours, ref = GGUFFile(path), gguf.GGUFReader(path)
    want = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    got = {k: f.contents() for k, f in ours.fields.items()}
    assert list(got) == list(want)
    for k in want:
        assert got[k] == want[k] and type(got[k]) is type(want[k]), k
        if isinstance(want[k], list) and want[k]:
            assert {type(v) for v in got[k]} == {type(v) for v in want[k]}, k
    assert ours.data_offset == ref.data_offset
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        assert a.tensor_type == b.tensor_type and a.tensor_type.name == b.tensor_type.name, a.name
        assert a.shape.tolist() == b.shape.tolist() and a.shape.dtype == b.shape.dtype, a.name
        assert (a.n_elements, a.n_bytes, a.data_offset) == (b.n_elements, b.n_bytes, b.data_offset), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data.view(np.uint8), np.asarray(b.data).view(np.uint8)), a.name


def test_smollm2_reads_as_gguf_reader_reads_it():
    assert_same_as_gguf_reader(fetch_smollm2())


def write_every_type(path: str, extra=None) -> None:
    w = gguf.GGUFWriter(path, "llama")
    w.add_uint8("t.u8", 250)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 1e-6)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 0.1)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "ünïcode 日本 <|im_end|>")
    w.add_string("t.empty", "")
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, 1.25])
    w.add_array("t.strs", ["a", "", "Ġthe", "日本"])
    w.add_array("t.bools", [True, False])
    w.add_array("t.nothing", [])
    w.add_custom_alignment(64)  # the key and the padding the writer uses (a file whose offsets break its own
    # alignment is refused, as llama.cpp refuses it)
    rng = np.random.default_rng(0)
    w.add_tensor("f32.matrix", rng.standard_normal((3, 8)).astype(np.float32))
    w.add_tensor("f32.vector", rng.standard_normal(5).astype(np.float32))
    w.add_tensor("f16.matrix", rng.standard_normal((2, 4)).astype(np.float16))
    q8 = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("q8.matrix", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("stack.3d", rng.standard_normal((2, 3, 32)).astype(np.float32))
    for name, array, raw in extra or ():
        w.add_tensor(name, array, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_every_value_type_and_tensor_layout(tmp_path):
    path = str(tmp_path / "types.gguf")
    write_every_type(path)
    assert_same_as_gguf_reader(path)
    f = GGUFFile(path)
    assert f.fields["t.u64"].contents() == 2**63 + 5 and f.fields["t.strs"].contents() == ["a", "", "Ġthe", "日本"]
    assert f.data_offset % 64 == 0
    q8 = next(t for t in f.tensors if t.name == "q8.matrix")
    assert q8.data.shape == (4, 2 * 34) and q8.data.dtype == np.uint8  # rows of blocks, as GGUFReader gives them


def test_damaged_files_are_refused_with_a_reason(tmp_path):
    path = str(tmp_path / "ok.gguf")
    write_every_type(path)
    raw = open(path, "rb").read()

    def refused(data: bytes, why: str) -> None:
        p = str(tmp_path / "bad.gguf")
        with open(p, "wb") as out:
            out.write(data)
        with pytest.raises(ValueError, match=why):
            GGUFFile(p)

    refused(b"GGML" + raw[4:], "magic")
    refused(raw[:4] + (7).to_bytes(4, "little") + raw[8:], "version 7")
    refused(raw[:4] + (3).to_bytes(4, "big") + raw[8:], "big-endian")
    refused(raw[:200], "truncated")  # inside the metadata
    refused(raw[:-10], "past the end")  # the last tensor's bytes


def test_a_tensor_type_the_kernels_do_not_serve_is_named(tmp_path):
    path = str(tmp_path / "iq.gguf")
    iq = gguf.GGMLQuantizationType.IQ2_XXS
    block, size = gguf.GGML_QUANT_SIZES[iq]
    write_every_type(path, extra=[("iq.matrix", np.zeros((2, 256 // block * size), np.uint8), iq)])
    f = GGUFFile(path)
    t = next(t for t in f.tensors if t.name == "iq.matrix")
    assert t.tensor_type.name == "IQ2_XXS" and t.data.shape == (2, size * 256 // block)
    assert_same_as_gguf_reader(path)


def test_load_model_says_what_is_wrong_with_a_truncated_model(tmp_path):
    src = fetch_smollm2()
    path = str(tmp_path / "cut.gguf")
    with open(src, "rb") as f, open(path, "wb") as out:
        out.write(f.read(os.path.getsize(src) // 2))
    with pytest.raises(ModelLoadError, match="cannot read GGUF file .*past the end"):
        load_model(path)


# ---- validation before trust (issue 30): each class the fuzz tier found or the issue lists ----------------------

def _tiny(tmp_path, arch="qwen3") -> tuple[str, bytes]:
    from tests.support.tiny_files import write_gguf
    path = write_gguf(str(tmp_path / f"{arch}.gguf"), arch)
    return path, open(path, "rb").read()


def _field(data: bytes, label: str):
    from tests.support.file_fuzz import gguf_layout
    return next(p for p in gguf_layout(data)[0] if p.label == label)


def _write(tmp_path, data: bytes, name="bad.gguf") -> str:
    p = str(tmp_path / name)
    with open(p, "wb") as f:
        f.write(data)
    return p


@pytest.mark.parametrize("label,value,why", [
    ("blk.0.attn_k.weight[offset]", None, "overlap"),  # points at blk.0.attn_q.weight's bytes
    ("blk.0.attn_k.weight[offset]", 1, "not a multiple of the alignment"),
    ("blk.0.attn_k.weight[n_dims]", 5, "5 dimensions"),
    ("blk.0.attn_k.weight[ne1]", 0, "dimension of 0 elements"),
    ("blk.0.attn_k.weight[ne1]", 2**63, "more than 2\\^63 elements"),
    ("blk.0.attn_k.weight[type]", 99, "unknown tensor type id 99"),
    ("tensor count", 2**60, "tensor count .* is impossible"),
    ("key count", 2**62, "metadata key count .* is impossible"),
    ("tokenizer.ggml.tokens[len]", 2**62, "tokenizer.ggml.tokens: array of .* runs past the end"),
    ("general.architecture", 2**62, "general.architecture: string length .* runs past the end"),
])
def test_crafted_headers_are_refused_naming_the_field(tmp_path, label, value, why):
    from tests.support.file_fuzz import put
    _, data = _tiny(tmp_path)
    p = _field(data, label)
    if value is None:
        value = int.from_bytes(data[_field(data, "blk.0.attn_q.weight[offset]").off:][:8], "little")
    with pytest.raises(ValueError, match=why):
        GGUFFile(_write(tmp_path, put(data, p.off, p.size, value)))


def test_overlapping_tensors_no_longer_load(tmp_path):
    """The issue's known bug: a file whose tensors share bytes loaded and served garbage; now it is refused."""
    from tests.support.file_fuzz import put
    _, data = _tiny(tmp_path)
    q = int.from_bytes(data[_field(data, "blk.1.ffn_up.weight[offset]").off:][:8], "little")
    p = _field(data, "blk.1.ffn_gate.weight[offset]")
    with pytest.raises(ModelLoadError, match="bad.gguf: tensors blk.1.ffn_(up|gate).weight and blk.1.ffn_(gate|up).weight overlap"):
        load_model(_write(tmp_path, put(data, p.off, 8, q)))


@pytest.mark.parametrize("label,value,why", [
    ("qwen3.attention.head_count", 0, "head_count: 0 is out of range"),
    ("qwen3.attention.head_count_kv", 3, "head_count_kv: 3 is out of range"),
    ("qwen3.embedding_length", 48, "token_embd.weight has shape \\[32, 300\\]; .* give \\[48, 300\\]"),
    ("qwen3.block_count", 3, "tensor blk.2.attn_norm.weight is missing"),
    ("qwen3.block_count", 1, "tensor blk.1.attn_k.weight is not used by this model's layers"),
    ("qwen3.feed_forward_length", 2**31 - 1, "out of range"),
    ("tokenizer.ggml.eos_token_id[vtype]", 6, "eos_token_id must be an integer"),
])
def test_metadata_is_typed_and_consistent_with_the_tensors(tmp_path, label, value, why):
    from tests.support.file_fuzz import put
    _, data = _tiny(tmp_path)
    p = _field(data, label)
    with pytest.raises(ModelLoadError, match=why):
        load_model(_write(tmp_path, put(data, p.off, p.size, value)))


def test_nan_metadata_is_refused(tmp_path):
    import struct
    _, data = _tiny(tmp_path)
    p = _field(data, "qwen3.attention.layer_norm_rms_epsilon")
    bad = data[:p.off] + struct.pack("<f", float("nan")) + data[p.off + 4:]
    with pytest.raises(ModelLoadError, match="layer_norm_rms_epsilon: nan is out of range"):
        load_model(_write(tmp_path, bad))


def test_a_merge_of_unknown_tokens_is_a_clean_refusal(tmp_path):
    """tokenizers raises a bare Exception for a merge of tokens outside the vocabulary (a traceback before)."""
    _, data = _tiny(tmp_path)
    bad = data.replace(b"\x03\x00\x00\x00\x00\x00\x00\x00h e", b"\x03\x00\x00\x00\x00\x00\x00\x00h \x01")
    assert bad != data
    with pytest.raises(ModelLoadError, match="tokenizer.ggml.merges: .*out of vocabulary"):
        load_model(_write(tmp_path, bad))
