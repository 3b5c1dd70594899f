"""Qwen3-MoE against transformers on tiny random checkpoints; only the routed experts are read."""
import json

import numpy as np
import pytest
import torch

from appliance.engine.generate import GenerationRequest
from appliance.engine.layer_runner import choose_runner
from appliance.engine.load import load_model
from appliance.engine.load.hf import build_qwen3_moe
from appliance.engine.qwen3_moe import SparseMoE
from appliance.engine.safetensors import SafeTensors
from appliance.engine.sampling import SamplingParams

PROMPT = [151644, 872, 198, 9707, 11, 1246, 525, 498, 30, 151645, 198, 151644, 77091, 198]


@pytest.fixture(params=["tiny_qwen3_moe", "tiny_qwen3_moe_unnormed", "tiny_qwen3_moe_mlp_only"])
def checkpoint(request):
    return request.getfixturevalue(request.param)


def ours(path):
    with open(f"{path}/config.json") as f:
        m = build_qwen3_moe(SafeTensors(path), json.load(f))[1]
    choose_runner(m)  # as load_model does
    return m


def reference(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def rel_err(a, b):
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def test_logits_match_transformers(checkpoint):
    m, ref = ours(checkpoint), reference(checkpoint)
    with torch.no_grad():
        want = ref(torch.tensor([PROMPT])).logits[0].numpy()
    got = m.forward(np.array(PROMPT), m.new_cache(64), "all")
    assert rel_err(got, want) <= 1e-4


def test_cached_decode_matches_full_forward(checkpoint):
    m = ours(checkpoint)
    extra = np.random.default_rng(1).integers(0, 151000, size=12).tolist()
    cache = m.new_cache(64)
    m.forward(np.array(PROMPT), cache, "none")
    for tok in extra:
        step = m.forward(np.array([tok]), cache, "last")
    full = m.forward(np.array(PROMPT + extra), m.new_cache(64), "last")
    assert rel_err(step, full) <= 1e-5


def test_greedy_tokens_match_generate(checkpoint):
    ref = reference(checkpoint)
    with torch.no_grad():
        out = ref.generate(torch.tensor([PROMPT]), max_new_tokens=32, min_new_tokens=32, do_sample=False)
    loaded = load_model(checkpoint)
    events = list(loaded.engine.generate(GenerationRequest(PROMPT, SamplingParams(temperature=0.0), max_tokens=32,
                                                           ignore_eos=True)))
    assert [e.token_id for e in events[:-1]] == out[0, len(PROMPT):].tolist()


def test_layer_kinds_follow_config(tiny_qwen3_moe_mlp_only):
    m = ours(tiny_qwen3_moe_mlp_only)
    assert [isinstance(layer.mlp, SparseMoE) for layer in m.layers] == [True, False, True]


def test_decode_reads_only_routed_experts(tiny_qwen3_moe):
    m = ours(tiny_qwen3_moe)
    cfg = m.moe_config
    cache = m.new_cache(64)
    m.forward(np.array(PROMPT), cache, "none")
    m.expert_stats.reset()
    m.forward(np.array([9707]), cache, "last")
    # one token: exactly top-k expert evaluations in each sparse layer, never more
    assert m.expert_stats.expert_calls == cfg.num_experts_per_tok * len(m.layers)
    assert m.expert_stats.distinct_experts == cfg.num_experts_per_tok * len(m.layers)


def test_prefill_reads_each_expert_once_per_chunk(tiny_qwen3_moe):
    m = ours(tiny_qwen3_moe)
    m.expert_stats.reset()
    m.forward(np.array(PROMPT), m.new_cache(64), "none")
    # each expert used by any token of the chunk is evaluated once for all its tokens
    assert m.expert_stats.expert_calls == m.expert_stats.distinct_experts
    assert m.expert_stats.expert_calls <= m.moe_config.num_experts * len(m.layers)
    assert m.expert_stats.routed_tokens == len(PROMPT) * len(m.layers)


def test_release_pages_drops_expert_pages_from_memory(tmp_path):
    from appliance.engine.page_release import mapping_rss, release_pages
    from appliance.engine.qwen3_moe import set_release_pages
    from tests.support.tiny_models import build_qwen3_moe

    # experts big enough to span many pages: 16 x 3 x (512 x 256) bf16 = 12 MiB of experts in the layer
    path = build_qwen3_moe(str(tmp_path / "m"), hidden=256, moe_intermediate=512, layers=1, seed=7)
    m = ours(path)
    block = m.layers[0].mlp
    experts_raw = [w.raw for ex in block.experts for w in (ex.gate, ex.up, ex.down)]
    for raw in experts_raw:
        np.asarray(raw).sum()  # touch every expert page
    touched = mapping_rss(experts_raw[0])
    assert touched >= sum(r.nbytes for r in experts_raw)
    released = sum(release_pages(r) for r in experts_raw)
    assert released >= 0.95 * sum(r.nbytes for r in experts_raw)
    assert mapping_rss(experts_raw[0]) <= touched - 0.9 * released
    # with release on, a forward gives the same output and leaves the experts' pages released
    x = np.random.default_rng(0).standard_normal((3, 256)).astype(np.float32)
    set_release_pages(m, False)
    want = block(x)
    with_pages = mapping_rss(experts_raw[0])
    set_release_pages(m, True)
    got = block(x)
    np.testing.assert_array_equal(got, want)
    used = len({e for (_, e) in m.expert_stats.touched})
    assert 0 < used < 16
    expert_bytes = 3 * 512 * 256 * 2
    assert mapping_rss(experts_raw[0]) <= with_pages - 0.9 * used * expert_bytes


def test_cli_release_pages_flag_keeps_the_answer(tiny_qwen3_moe):
    import subprocess
    import sys

    args = [sys.executable, "-m", "appliance", "--model", tiny_qwen3_moe, "--prompt", "Hello there",
            "--temperature", "0", "--max-tokens", "12", "--no-think"]
    plain = subprocess.run(args, capture_output=True, text=True, timeout=120)
    released = subprocess.run(args + ["--moe-release-pages"], capture_output=True, text=True, timeout=120)
    assert plain.returncode == 0 and released.returncode == 0, released.stderr
    assert len(plain.stdout) > 1 and released.stdout == plain.stdout
