"""The routed experts in one native call (src/moe.c kq_moe_ffn) equal their numpy twin (ops_numpy.moe_ffn) for
the stored expert types, stacked or separate, at decode and prefill sizes and thread counts; a decode token
reads exactly top_k experts (counts)."""
import numpy as np
import pytest

from appliance.native import kernels, ops_numpy
from appliance.native.qtypes import QType
from tests.support.ggml_blocks import random_weight

pytestmark = pytest.mark.usefixtures("native_lib")


def experts(qtype, E, rows, n, rng, stacked=True):
    """(qtype, per-expert matrices): slices of one stacked (E, rows, row_bytes) tensor, or separate arrays."""
    if stacked:
        w = np.stack([random_weight(qtype, rows, n, rng) for _ in range(E)])  # (E, rows, row_bytes)
        return qtype, [w[e] for e in range(E)]
    return qtype, [random_weight(qtype, rows, n, rng) for _ in range(E)]


CASES = [  # gate/up type, down type, hidden, inter
    (QType.Q8_0, QType.Q8_0, 64, 96), (QType.Q4_0, QType.Q4_0, 64, 96), (QType.Q4_K, QType.Q6_K, 256, 256),
    (QType.BF16, QType.BF16, 48, 40), (QType.F32, QType.F32, 33, 17), (QType.Q4_1, QType.Q8_0, 64, 32)]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("gq,dq,D,I", CASES, ids=lambda v: getattr(v, "name", str(v)))
def test_moe_ffn_equals_twin(gq, dq, D, I, threads):
    kernels.set_threads(threads)
    rng = np.random.default_rng(int(gq) * 7 + int(dq) + D)
    E, k = 8, 3
    gate, up = experts(gq, E, I, D, rng), experts(gq, E, I, D, rng, stacked=False)
    down = experts(dq, E, D, I, rng)
    router = rng.standard_normal((E, D)).astype(np.float32)
    scale = 0.05 if gq in (QType.F32, QType.BF16) else 1.0  # keep float experts' outputs of order 1
    for T in (1, 5, 37):
        x = (rng.standard_normal((T, D)) * scale).astype(np.float32)
        for norm in (True, False):
            ffn = kernels.MoEFFN(router, k, norm, gate, up, down)
            got, want = ffn(x), ops_numpy.moe_ffn(x, router, k, norm, gate, up, down)
            assert np.abs(got - want).max() <= 1e-5 * max(1.0, np.abs(want).max()), (T, norm)
            assert ffn.counts.sum() == T * k
            if T == 1:
                assert np.count_nonzero(ffn.counts) == k  # a decode token reads exactly top_k experts
            top, _ = ops_numpy.route(x, router, k, norm)
            np.testing.assert_array_equal(ffn.counts, np.bincount(top.ravel(), minlength=E))


def test_moe_ffn_rejects_mismatched_experts():
    rng = np.random.default_rng(0)
    gate = experts(QType.Q8_0, 4, 32, 64, rng)
    down = experts(QType.Q8_0, 4, 64, 32, rng)
    router = np.zeros((4, 64), np.float32)
    with pytest.raises(ValueError):
        kernels.MoEFFN(router, 2, True, gate, gate, (QType.Q8_0, down[1][:3]))
    with pytest.raises(ValueError):
        kernels.MoEFFN(router, 5, True, gate, gate, down)
    with pytest.raises(ValueError):
        kernels.MoEFFN(router, 2, True, gate, gate, gate)


@pytest.mark.parametrize("kind", ["tiny_qwen3_moe", "tiny_qwen3_moe_mlp_only"])
def test_native_moe_decoder_equals_numpy_layers(kind, request):
    """A whole Qwen3-MoE model through the native decoder (attention, norms, RoPE and routed experts in C, one
    call per forward) equals the numpy layers (numpy attention, numpy expert loop) over the same weights."""
    import json

    from appliance.engine import qwen3
    from appliance.engine.layer_runner import choose_runner
    from appliance.engine.load.hf import build_qwen3_moe
    from appliance.engine.qwen3_moe import SparseMoE
    from appliance.engine.safetensors import SafeTensors

    path = request.getfixturevalue(kind)
    with open(f"{path}/config.json") as f:
        m = build_qwen3_moe(SafeTensors(path), json.load(f))[1]
    choose_runner(m)
    assert m.runner is not None  # MoE models no longer fall back as a whole
    prompt, nxt = np.array([151644, 872, 198, 9707, 11, 1246, 525, 498, 30]), np.array([151645])
    cache = m.new_cache(32)
    m.forward(prompt, cache, "none")
    m.expert_stats.reset()
    got = m.forward(nxt, cache, "last")
    sparse = [layer.mlp for layer in m.layers if isinstance(layer.mlp, SparseMoE)]
    assert m.expert_stats.expert_calls == m.moe_config.num_experts_per_tok * len(sparse)
    for block in sparse:
        block.native = None  # the numpy loop
    ref_cache = m.new_cache(32)
    for toks in (prompt, nxt):
        cos, sin = qwen3.rope_cos_sin(ref_cache.length + np.arange(len(toks)), m.config.head_dim,
                                      m.config.rope_theta)
        h = qwen3.numpy_layers(m, m.embed.rows(toks), ref_cache, cos, sin)
    want = m.lm_head(h[-1:])[0]
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
