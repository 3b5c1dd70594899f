"""An mmproj file whose vision tower does not fit its own metadata (patch size, widths, heads, the merger's and the
DeepStack merger's dimensions, the position grid, a missing tensor) is refused at load: one line naming the file
and the tensor, a ModelFileError (CLI exit status 2), never a numpy error at the first image. The crafted pair
(tests/support/tiny_files.py: a qwen3vl text GGUF and write_vl_mmproj) loads and encodes an image when unchanged;
the Hugging Face side runs the same check (vision_check.hf_vision_shapes) on every VL checkpoint the engine tests load."""
from __future__ import annotations

import subprocess
import sys

import pytest

from appliance.engine.generate import FinishEvent, GenerationRequest
from appliance.engine.image_processing import decode_image
from appliance.engine.load import LoadOptions, ModelFileError, load_model
from appliance.engine.qwen3_vl import expand_image_pads
from appliance.engine.sampling import SamplingParams
from tests.support import tiny_files
from tests.support.tiny_vl import image_bytes


@pytest.fixture(scope="module")
def pair_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("vl-pair")
    tiny_files.write_gguf(str(d / "text.gguf"), "qwen3vl")
    tiny_files.write_vl_mmproj(str(d / "mmproj-good.gguf"))
    return d


def test_the_crafted_pair_loads_and_encodes_an_image(pair_dir):
    loaded = load_model(str(pair_dir / "text.gguf"), LoadOptions(mmproj=str(pair_dir / "mmproj-good.gguf")))
    tok = loaded.tokenizer
    patches = loaded.model.image_processor.preprocess(decode_image(image_bytes(40, 24, "PNG", seed=1)))
    start, end, pad = (tok.id_of(t) for t in tiny_files.VL_SPECIALS)
    ids = expand_image_pads([start, pad, end, 100, 101], pad, [patches.num_tokens])
    fin = list(loaded.engine.generate(GenerationRequest(ids, SamplingParams(temperature=0.0), max_tokens=2,
                                                        ignore_eos=True, images=(patches,))))[-1]
    assert isinstance(fin, FinishEvent) and fin.timings.image_tokens == patches.num_tokens > 0


MISMATCHES = {  # what is crafted -> (write_vl_mmproj arguments, what the message names)
    "patch size": (dict(keys={"patch_size": 8}), "tensor v.patch_embd.weight has shape [32, 3, 4, 4]"),
    "hidden size": (dict(keys={"embedding_length": 48}), "tensor v.patch_embd.weight has shape"),
    "second frame": (dict(shapes={"v.patch_embd.weight.1": (32, 3, 4, 5)}), "tensor v.patch_embd.weight.1"),
    "fused qkv": (dict(shapes={"v.blk.1.attn_qkv.weight": (64, 32)}), "tensor v.blk.1.attn_qkv.weight"),
    "mlp width": (dict(keys={"feed_forward_length": 96}), "tensor v.blk.0.ffn_up.weight"),
    "merger fc1": (dict(shapes={"mm.0.weight": (128, 64)}), "tensor mm.0.weight has shape [128, 64]"),
    "merger bias": (dict(shapes={"mm.2.bias": (31,)}), "tensor mm.2.bias"),
    "spatial merge": (dict(keys={"spatial_merge_size": 3}), "tensor mm.0.weight"),
    "deepstack fc2": (dict(shapes={"v.deepstack.0.fc2.weight": (32, 64)}), "tensor v.deepstack.0.fc2.weight"),
    "deepstack norm": (dict(shapes={"v.deepstack.0.norm.weight": (32,)}), "tensor v.deepstack.0.norm.weight"),
    "position grid": (dict(shapes={"v.position_embd.weight": (15, 32)}), "15 positions, not a square grid"),
    "heads": (dict(keys={"attention.head_count": 3}), "does not split into 3 heads"),
    "missing tensor": (dict(shapes={"v.blk.1.ln2.bias": None}), "tensor v.blk.1.ln2.bias is missing"),
}


@pytest.mark.parametrize("crafted", sorted(MISMATCHES))
def test_a_tower_that_does_not_fit_its_metadata_is_refused_at_load(pair_dir, crafted):
    kwargs, named = MISMATCHES[crafted]
    bad = tiny_files.write_vl_mmproj(str(pair_dir / f"mmproj-{crafted.replace(' ', '-')}.gguf"), **kwargs)
    with pytest.raises(ModelFileError) as e:
        load_model(str(pair_dir / "text.gguf"), LoadOptions(mmproj=bad))
    message = str(e.value)
    assert named in message and bad in message and "\n" not in message, message


def test_the_cli_refuses_it_with_one_line_and_status_2(pair_dir):
    bad = tiny_files.write_vl_mmproj(str(pair_dir / "mmproj-cli.gguf"), shapes={"mm.0.weight": (128, 64)})
    p = subprocess.run([sys.executable, "-m", "appliance", "--model", str(pair_dir / "text.gguf"), "--mmproj", bad,
                        "--prompt", "Hi"], capture_output=True, text=True, timeout=120)
    lines = [line for line in p.stderr.splitlines() if "error" in line]
    assert p.returncode == 2 and len(lines) == 1 and "tensor mm.0.weight" in lines[0], p.stderr
    assert "Traceback" not in p.stderr


@pytest.mark.parametrize("key, value, named", [("intermediate_size", 48, "blocks.0.mlp.linear_fc1.weight"),
                                               ("patch_size", 8, "patch_embed.proj.weight"),
                                               ("num_heads", 3, "does not split into 3 heads")])
def test_a_hugging_face_tower_that_does_not_fit_its_config_is_refused_at_load(tmp_path_factory, key, value, named):
    import json
    import os

    from tests.support.tiny_vl import cached_qwen3_vl

    src = cached_qwen3_vl(tmp_path_factory)
    d = tmp_path_factory.mktemp(f"vl-hf-{key}")
    for f in os.listdir(src):
        if f != "config.json":
            os.symlink(os.path.join(src, f), d / f)
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    cfg["vision_config"][key] = value
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelFileError) as e:
        load_model(str(d))
    assert named in str(e.value) and "\n" not in str(e.value), str(e.value)
