"""convert (Hugging Face dir -> GGUF) and the GGUF loader, against the safetensors loader of the same checkpoint.

f32 files must reproduce the safetensors model's logits (the bf16 checkpoint widens exactly); f16 within
half-precision rounding; q8_0/q4_0 hold exactly what gguf's reference quantizer makes of each tensor.
The llama architecture goes through llama.cpp's q/k permutation on the way in and our un-permutation on
the way out. llama.cpp itself loading these files is in test_gguf_llama_cpp.py.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from appliance import convert
from appliance.engine.load import ModelLoadError, load_model
from appliance.engine.load.gguf import open_gguf
from tests.support.gguf_files import build_tiny

TEXT = "Hello, world! 12345 <think>x</think>\n\n  ünïcode 日本"


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    return build_tiny(str(tmp_path_factory.mktemp("tiny-llama")), "llama")


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory) -> str:
    return build_tiny(str(tmp_path_factory.mktemp("tiny-qwen2")), "qwen2")


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf")


def converted(src: str, out_dir, kind: str, capsys=None) -> str:
    out = os.path.join(str(out_dir), f"{os.path.basename(src)}-{kind}.gguf")
    if not os.path.exists(out):
        assert convert.main([src, out, "--type", kind]) == 0
    return out


def all_logits(lm, ids) -> np.ndarray:
    cache = lm.model.new_cache(len(ids))
    return lm.model.forward(np.array(ids), cache, logits="all")  # (T, vocab)


@pytest.mark.parametrize("fixture", ["tiny_qwen3_tied", "tiny_qwen3_untied", "tiny_llama", "tiny_qwen2"])
def test_f32_gguf_matches_safetensors_logits(request, fixture, gguf_dir):
    src = request.getfixturevalue(fixture)
    ref = load_model(src)
    ids = ref.tokenizer.encode(TEXT)
    g = load_model(converted(src, gguf_dir, "f32"))
    assert g.config == ref.config
    assert g.tokenizer.encode(TEXT) == ids
    assert g.eos_ids == ref.eos_ids
    np.testing.assert_allclose(all_logits(g, ids), all_logits(ref, ids), rtol=0, atol=1e-4)


@pytest.mark.parametrize("fixture", ["tiny_qwen3_untied", "tiny_llama", "tiny_qwen2"])
def test_f16_gguf_close_to_safetensors(request, fixture, gguf_dir):
    src = request.getfixturevalue(fixture)
    ref, g = load_model(src), load_model(converted(src, gguf_dir, "f16"))
    ids = ref.tokenizer.encode(TEXT)
    a, b = all_logits(g, ids), all_logits(ref, ids)
    assert np.abs(a - b).max() < 2e-2 * np.abs(b).max()
    assert (a.argmax(-1) == b.argmax(-1)).all()


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_quantized_tensors_are_the_reference_quantizer_output(tiny_qwen3_untied, gguf_dir, kind):
    import gguf

    from appliance.engine.safetensors import SafeTensors, to_float32

    path = converted(tiny_qwen3_untied, gguf_dir, kind)
    r = open_gguf(path)
    st = SafeTensors(tiny_qwen3_untied)
    tensors = {t.name: t for t in r.tensors}
    qtype = getattr(gguf.GGMLQuantizationType, kind.upper())
    for gg, hf in (("blk.1.ffn_down.weight", "model.layers.1.mlp.down_proj.weight"),
                   ("output.weight", "lm_head.weight"), ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight")):
        t = tensors[gg]
        assert t.tensor_type == qtype
        expect = gguf.quants.quantize(to_float32(*st.raw(hf)), qtype)
        assert np.array_equal(np.asarray(t.data), expect)
    assert tensors["blk.0.attn_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    assert r.fields["general.file_type"].contents() == int(getattr(gguf.LlamaFileType, f"MOSTLY_{kind.upper()}"))


def test_metadata_llama_cpp_needs(tiny_qwen3_untied, gguf_dir, qwen3_chat_template):
    import gguf

    r = open_gguf(converted(tiny_qwen3_untied, gguf_dir, "q8_0"))
    meta = {k: f.contents() for k, f in r.fields.items()}
    assert meta["general.architecture"] == "qwen3"
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == "qwen2"
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    assert len(tokens) == len(types) == 151936  # padded to the embedding rows
    assert tokens[151645] == "<|im_end|>" and types[151645] == gguf.TokenType.CONTROL
    assert tokens[151667] == "<think>" and types[151667] == gguf.TokenType.USER_DEFINED
    assert tokens[-1] == "[PAD151935]" and types[-1] == gguf.TokenType.UNUSED
    assert meta["tokenizer.ggml.merges"][0] == "Ġ Ġ"
    assert meta["tokenizer.ggml.eos_token_id"] == 151645 and meta["tokenizer.ggml.padding_token_id"] == 151643
    assert meta["tokenizer.ggml.add_bos_token"] is False
    assert meta["tokenizer.chat_template"] == qwen3_chat_template
    assert meta["qwen3.attention.key_length"] == 32 and meta["qwen3.block_count"] == 3


def test_llama_qk_rows_are_permuted_in_the_file(tiny_llama, gguf_dir):
    """The file holds llama.cpp's layout (adjacent rotary pairs), not Hugging Face's halves."""
    from appliance.engine.safetensors import SafeTensors, to_float32

    r = open_gguf(converted(tiny_llama, gguf_dir, "f32"))
    k = np.asarray(next(t for t in r.tensors if t.name == "blk.0.attn_k.weight").data)  # (2*16, 64)
    hf = to_float32(*SafeTensors(tiny_llama).raw("model.layers.0.self_attn.k_proj.weight"))
    assert not np.array_equal(k, hf)
    assert np.array_equal(k[1], hf[8]) and np.array_equal(k[2], hf[1]) and np.array_equal(k[17], hf[24])


def test_progress_bar_on_stderr(tiny_qwen3_tied, tmp_path, capsys):
    out = str(tmp_path / "m.gguf")
    assert convert.main([tiny_qwen3_tied, out, "--type", "q4_0"]) == 0
    cap = capsys.readouterr()
    assert cap.out.strip() == out
    assert "100.0%" in cap.err and "[" + "#" * 30 + "]" in cap.err
    assert not os.path.exists(out + ".tmp")


@pytest.mark.parametrize("args, message", [
    (["/nonexistent-dir", "X/out.gguf"], "no config.json"),
    (["{src}", "/nonexistent-dir/out.gguf"], "output directory does not exist"),
    (["{src}", "{tmp}/out.gguf", "--type", "q5_k"], None),  # argparse refuses the choice
])
def test_bad_input_is_one_line_error(tiny_qwen3_tied, tmp_path, capsys, args, message):
    args = [a.format(src=tiny_qwen3_tied, tmp=tmp_path) for a in args]
    if message is None:
        with pytest.raises(SystemExit) as e:
            convert.main(args)
        assert e.value.code == 2
        return
    assert convert.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kestrel-appliance convert: error:") and message in err and "\n" not in err


def test_unsupported_architecture_refused(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"model_type": "gemma3"}')
    assert convert.main([str(tmp_path), str(tmp_path / "o.gguf")]) == 2
    assert "unsupported model type 'gemma3'" in capsys.readouterr().err


def test_loader_refuses_broken_files(tmp_path, tiny_qwen3_tied, gguf_dir):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 10)
    with pytest.raises(ModelLoadError, match="cannot read GGUF file"):
        load_model(str(bad))
    good = converted(tiny_qwen3_tied, gguf_dir, "q8_0")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(open(good, "rb").read()[: os.path.getsize(good) // 2])
    with pytest.raises(ModelLoadError):
        load_model(str(cut))


def test_convert_is_a_subcommand_of_the_cli(tiny_qwen3_tied, tmp_path):
    import subprocess
    import sys

    out = tmp_path / "via-cli.gguf"
    p = subprocess.run([sys.executable, "-m", "appliance", "convert", tiny_qwen3_tied, str(out), "--type", "q8_0"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert load_model(str(out)).config.num_hidden_layers == 2
    bad = subprocess.run([sys.executable, "-m", "appliance", "convert", str(tmp_path / "nope"), str(out)],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "Traceback" not in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
