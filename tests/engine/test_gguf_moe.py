"""Qwen3-MoE through GGUF: our `convert` writes llama.cpp's `qwen3moe` layout (stacked experts, F32 router);
our loader slices the experts in place; llama.cpp runs the same file to the same greedy tokens."""
import numpy as np
import pytest

from appliance import convert
from appliance.engine.load import load_model
from appliance.engine.qwen3_moe import SparseMoE
from appliance.engine.safetensors import SafeTensors

PROMPT = [151644, 872, 198, 9707, 11, 1246, 525, 498, 30, 151645, 198, 151644, 77091, 198]


@pytest.fixture(scope="module")
def moe_files(tmp_path_factory, tiny_qwen3_moe):
    out = tmp_path_factory.mktemp("moe-gguf")
    paths = {}
    for kind in ("f32", "f16", "q8_0"):
        paths[kind] = str(out / f"moe-{kind}.gguf")
        assert convert.main([tiny_qwen3_moe, paths[kind], "--type", kind]) == 0
    return paths


def rel_err(a, b):
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def test_file_has_llama_cpp_layout(moe_files, tiny_qwen3_moe):
    from gguf import GGUFReader

    r = GGUFReader(moe_files["q8_0"])
    t = {x.name: x for x in r.tensors}
    assert r.fields["general.architecture"].contents() == "qwen3moe"
    assert r.fields["qwen3moe.expert_count"].contents() == 16
    assert r.fields["qwen3moe.expert_used_count"].contents() == 4
    assert r.fields["qwen3moe.expert_feed_forward_length"].contents() == 32
    assert t["blk.0.ffn_gate_inp.weight"].tensor_type.name == "F32"
    assert t["blk.0.ffn_gate_exps.weight"].tensor_type.name == "Q8_0"
    assert [int(n) for n in t["blk.0.ffn_gate_exps.weight"].shape] == [64, 32, 16]  # ne: in, out, experts
    assert [int(n) for n in t["blk.0.ffn_down_exps.weight"].shape] == [32, 64, 16]


def test_f32_gguf_equals_safetensors(moe_files, tiny_qwen3_moe):
    ours_st = load_model(tiny_qwen3_moe).model
    ours_gg = load_model(moe_files["f32"]).model
    assert all(isinstance(layer.mlp, SparseMoE) for layer in ours_gg.layers)
    want = ours_st.forward(np.array(PROMPT), ours_st.new_cache(64), "all")
    got = ours_gg.forward(np.array(PROMPT), ours_gg.new_cache(64), "all")
    assert rel_err(got, want) <= 1e-5


def test_quantized_experts_are_read_in_place(moe_files):
    m = load_model(moe_files["q8_0"]).model
    expert = m.layers[0].mlp.experts[5].gate
    assert expert.shape == (32, 64) and expert.raw.base is not None  # a view of the file mapping, not a copy
    cache = m.new_cache(64)
    m.forward(np.array(PROMPT), cache, "none")
    m.expert_stats.reset()
    m.forward(np.array([9707]), cache, "last")
    assert m.expert_stats.expert_calls == 4 * len(m.layers)


def test_fused_experts_load_and_convert_like_per_expert_ones(tiny_qwen3_moe, moe_files, tmp_path):
    """transformers-5's fused expert tensors (gate_up_proj, down_proj): the loader serves the same model and
    convert writes the same GGUF tensors as from the published per-expert tensors."""
    from gguf import GGUFReader

    from tests.support.tiny_models import fuse_experts

    fused = fuse_experts(tiny_qwen3_moe, str(tmp_path / "fused"))
    assert not any(".experts.0." in k for k in SafeTensors(fused).keys())
    a, b = load_model(tiny_qwen3_moe).model, load_model(fused).model
    assert np.array_equal(a.forward(np.array(PROMPT), a.new_cache(64), "all"),
                          b.forward(np.array(PROMPT), b.new_cache(64), "all"))
    path = str(tmp_path / "fused-q8_0.gguf")
    assert convert.main([fused, path, "--type", "q8_0"]) == 0
    want = {t.name: t for t in GGUFReader(moe_files["q8_0"]).tensors}
    got = {t.name: t for t in GGUFReader(path).tensors}
    assert list(got) == list(want) and "blk.0.ffn_gate_exps.weight" in got
    for name, t in want.items():
        assert got[name].tensor_type == t.tensor_type and np.array_equal(got[name].data, t.data), name


def test_convert_refuses_what_llama_cpp_would_compute_differently(tiny_qwen3_moe_unnormed, tmp_path, capsys):
    assert convert.main([tiny_qwen3_moe_unnormed, str(tmp_path / "x.gguf"), "--type", "f16"]) != 0
    err = capsys.readouterr().err
    assert "norm_topk_prob" in err and "Traceback" not in err


def test_same_greedy_tokens_as_llama_cpp_in_f16(peer, moe_files):
    loaded = load_model(moe_files["f16"])
    from appliance.engine.generate import GenerationRequest
    from appliance.engine.sampling import SamplingParams

    events = list(loaded.engine.generate(GenerationRequest(PROMPT, SamplingParams(temperature=0.0), max_tokens=8,
                                                           ignore_eos=True)))
    ours = [e.token_id for e in events[:-1]]
    with peer.LlamaCppPeer(moe_files["f16"], n_threads=2) as p:
        theirs = p.greedy(PROMPT, 8)
    assert ours == theirs


def test_q8_0_runs_in_llama_cpp_and_agrees(peer, moe_files):
    loaded = load_model(moe_files["q8_0"])
    with peer.LlamaCppPeer(moe_files["q8_0"], n_threads=2) as p:
        theirs = np.array(p.logits(PROMPT), dtype=np.float32)  # (T, V)
    ours = loaded.model.forward(np.array(PROMPT), loaded.model.new_cache(64), "all")
    assert theirs.shape == ours.shape
    # both round activations to 8 bits in their own kernels (and routing sees those rounded values), so logits
    # differ by a few hundredths: the top choice must agree wherever llama.cpp's own top-1 margin is clearly
    # above that noise; measured near-ties (margins < 0.03) may go either way
    assert rel_err(ours, theirs) <= 0.05
    top2 = np.sort(theirs, axis=-1)[:, -2:]
    decisive = (top2[:, 1] - top2[:, 0]) > 0.1
    assert decisive.sum() >= len(PROMPT) // 2
    assert np.array_equal(ours.argmax(-1)[decisive], theirs.argmax(-1)[decisive])


def test_experts_stay_mapped_and_pages_can_be_released(tmp_path):
    from appliance.engine.page_release import mapping_rss
    from appliance.engine.qwen3_moe import set_release_pages
    from tests.support.tiny_models import build_qwen3_moe

    # experts of 512 x 256 (139 kB each in Q8_0) so each spans whole pages
    src = build_qwen3_moe(str(tmp_path / "m"), hidden=256, moe_intermediate=512, layers=1, seed=7)
    path = str(tmp_path / "m.gguf")
    assert convert.main([src, path, "--type", "q8_0"]) == 0
    m = load_model(path).model
    m.forward(np.array(PROMPT), m.new_cache(64), "none")
    experts = m.layers[0].mlp.experts
    assert all(e.gate.x8() is None for e in experts)  # products read the file's bytes, no private copy
    used = {e for (_, e) in m.expert_stats.touched}
    before = mapping_rss(experts[0].gate.raw)
    assert before >= len(used) * 3 * experts[0].gate.nbytes
    set_release_pages(m, True)
    m.forward(np.array(PROMPT), m.new_cache(64), "none")
    assert mapping_rss(experts[0].gate.raw) <= before - 0.9 * len(used) * 3 * experts[0].gate.nbytes
