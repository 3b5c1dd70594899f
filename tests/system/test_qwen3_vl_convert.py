"""`kestrel-appliance convert` on Qwen3-VL and Qwen3-VL-MoE checkpoints: the text GGUF + mmproj-OUT.gguf pair.

Tiny random checkpoints (tests/support/tiny_vl.py: transformers, the real tokenizer) are converted by our CLI
(`python -m appliance convert`, F16 and Q8_0 text sides, F16 / Q8_0 projectors) and by llama.cpp's own converter
(the peer's vendored convert_hf_to_gguf.py, with --mmproj for the projector). The two pairs must hold the same
tensors: names, shapes, types and bytes; and every metadata key llama.cpp writes (but the name, its sampling
defaults and size label) with the same value. Round trip: our pair loads in llama.cpp's mtmd (bench/peer_mtmd.py)
and in our server started by the real CLI; for one message with two non-square images both give the same prompt
ids, and the same greedy tokens or tokens identical up to a near-tie (test_qwen3_vl_gguf_pairs' rule: the top
two logits within TIE_MARGIN nats in both engines at the first divergence). The mmproj beside OUT.gguf is the
one the server picks up. Bad input is one line and exit status 2.
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from tests.support.llama_convert import convert_hf
from tests.support.tiny_vl import cached_qwen3_vl, cached_qwen3_vl_moe, published_layout, reference_processor
from tests.system.test_qwen3_vl_gguf_pairs import (
    MAX_PIXELS,
    MTMD_MESSAGES,
    TIE_MARGIN,
    assert_same_or_near_tie,
    mtmd_greedy,
    served_tokens,
)

CLI = [sys.executable, "-m", "appliance"]
IMAGE_PAD = 151655
# keys llama.cpp's converter writes that describe the download, not the model
UNCOMPARED_KEYS = ("general.name", "general.size_label", "general.sampling.")


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return cached_qwen3_vl(tmp_path_factory)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    """The tiny Qwen3-VL-MoE with its experts as published (the layout llama.cpp's converter reads)."""
    return published_layout(cached_qwen3_vl_moe(tmp_path_factory), str(tmp_path_factory.mktemp("moe") / "m"))


def our_pair(src: str, out_dir, text_type: str, mmproj_type: str, stem: str) -> tuple[str, str]:
    out = os.path.join(str(out_dir), f"{stem}-{text_type}-{mmproj_type}.gguf")
    if not os.path.exists(out):
        p = subprocess.run(CLI + ["convert", src, out, "--type", text_type, "--mmproj-type", mmproj_type],
                           capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr
        mmproj = os.path.join(str(out_dir), "mmproj-" + os.path.basename(out))
        assert p.stdout.split() == [out, mmproj]
    return out, os.path.join(str(out_dir), "mmproj-" + os.path.basename(out))


def llama_pair(src: str, out_dir, kind: str, stem: str) -> tuple[str, str]:
    return (convert_hf(src, os.path.join(str(out_dir), f"{stem}-{kind}.gguf"), kind),
            convert_hf(src, os.path.join(str(out_dir), f"mmproj-{stem}-{kind}.gguf"), kind, mmproj=True))


def contents(path: str) -> tuple[dict, dict]:
    """({tensor name: (shape, type name, bytes)}, {metadata key: value}) of a GGUF file."""
    import gguf

    r = gguf.GGUFReader(path)
    tensors = {t.name: (tuple(int(n) for n in t.shape), t.tensor_type.name, np.asarray(t.data).tobytes())
               for t in r.tensors}
    meta = {}
    for key, field in r.fields.items():
        if not key.startswith("GGUF.") and not key.startswith(UNCOMPARED_KEYS):
            meta[key] = field.contents()
    return tensors, meta


@pytest.mark.parametrize("model", ["vl", "moe"])
@pytest.mark.parametrize("kind", ["f16", "q8_0"])
def test_pair_equals_llama_cpp_converters_tensor_by_tensor(model, kind, vl_dir, moe_dir, tmp_path_factory):
    src = vl_dir if model == "vl" else moe_dir
    ours = our_pair(src, tmp_path_factory.mktemp(f"ours-{model}-{kind}"), kind, kind, model)
    theirs = llama_pair(src, tmp_path_factory.mktemp(f"llama-{model}-{kind}"), kind, model)
    for mine, ref in zip(ours, theirs):
        (t_ours, m_ours), (t_ref, m_ref) = contents(mine), contents(ref)
        assert sorted(t_ours) == sorted(t_ref)
        for name, (shape, qtype, data) in t_ref.items():
            assert t_ours[name][:2] == (shape, qtype), name
            assert t_ours[name][2] == data, name  # the same quantizer on the same values: the same bytes
        missing = sorted(set(m_ref) - set(m_ours))
        assert not missing
        for key, value in m_ref.items():
            assert m_ours[key] == value, key
    assert contents(ours[0])[1]["general.architecture"] == ("qwen3vl" if model == "vl" else "qwen3vlmoe")
    assert contents(ours[1])[1]["clip.projector_type"] == "qwen3vl_merger"


def test_both_fused_expert_layouts_convert_to_the_same_file(moe_dir, tmp_path_factory):
    """transformers-5's own fused experts (E, 2I, H) and the published transposed ones (E, H, 2I) are one model."""
    a = our_pair(cached_qwen3_vl_moe(tmp_path_factory), tmp_path_factory.mktemp("t5"), "q8_0", "f16", "moe")
    b = our_pair(moe_dir, tmp_path_factory.mktemp("pub"), "q8_0", "f16", "moe")
    assert contents(a[0])[0] == contents(b[0])[0]


@pytest.mark.parametrize("model,text_type,mmproj_type", [("vl", "f16", "f16"), ("vl", "q8_0", "q8_0"),
                                                          ("moe", "q8_0", "f16")])
def test_our_pair_gives_the_same_tokens_in_mtmd_and_in_our_server(model, text_type, mmproj_type, vl_dir, moe_dir,
                                                                  tmp_path_factory, cli_server):
    src = vl_dir if model == "vl" else moe_dir
    pair = our_pair(src, tmp_path_factory.mktemp(f"rt-{model}"), text_type, mmproj_type, model)
    proc, port = cli_server(pair[0], "--ctx", "512", "--image-max-pixels", str(MAX_PIXELS),
                            "--prefill-chunk", "64")  # the mmproj beside it, as the start-up log says
    prompt, ours, _, our_top2 = served_tokens(port, MTMD_MESSAGES)
    rendered = reference_processor(src).apply_chat_template(MTMD_MESSAGES, add_generation_prompt=True,
                                                            tokenize=False)
    theirs = mtmd_greedy(pair, rendered)
    assert theirs["prompt"] == prompt  # llama.cpp's tokenization and image token counts (54 + 32) are ours
    assert prompt.count(IMAGE_PAD) == 54 + 32
    assert_same_or_near_tie(ours, our_top2, theirs["tokens"], theirs["top2"], TIE_MARGIN[text_type])


def test_bad_input_is_one_line_and_status_2(vl_dir, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    for name in os.listdir(vl_dir):
        if name != "preprocessor_config.json":
            os.symlink(os.path.join(vl_dir, name), bad / name)
    out = tmp_path / "x.gguf"
    p = subprocess.run(CLI + ["convert", str(bad), str(out), "--type", "q8_0"], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines() == [f"kestrel-appliance convert: error: no preprocessor_config.json in {bad} "
                                            "(the image mean/std come from it)"]
    assert not os.path.exists(out) and not os.path.exists(str(out) + ".tmp")
    assert not (tmp_path / "mmproj-x.gguf.tmp").exists()
