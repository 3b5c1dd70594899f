"""The vision tower's C operations (native/src/vision.c) equal their numpy twins (engine/vision.py), and a
whole vision block run natively (BF16 weights read in place, C LayerNorm/GELU/attention) equals the numpy block
over the same weights widened to float32. Float tolerance: the C sums run in another order."""
import numpy as np
import pytest

from appliance.engine import vision
from appliance.engine.quant_weights import half_weight
from appliance.engine.weights import DenseWeight
from appliance.native import kernels

pytestmark = pytest.mark.usefixtures("native_lib")


def rope_for(n: int, hd: int):
    rows, cols = np.arange(n) // 7, np.arange(n) % 7
    return vision.vision_rope(rows, cols, hd, 10000.0)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_layer_norm_and_gelu_equal_twins(threads):
    kernels.set_threads(threads)
    rng = np.random.default_rng(threads)
    for T, n in [(1, 7), (37, 1000), (300, 1024)]:
        x = (rng.standard_normal((T, n)) * 3 + 2).astype(np.float32)
        w, b = rng.standard_normal((2, n)).astype(np.float32)
        np.testing.assert_allclose(kernels.layer_norm(x, w, b), vision.layer_norm(x, w, b), rtol=1e-5, atol=2e-5)
    for n in [1, 1023, 1025, 200_003]:
        x = (rng.standard_normal(n) * 5).astype(np.float32)
        x[:1] = 0.0
        np.testing.assert_allclose(kernels.gelu_tanh(x), vision.gelu_tanh(x), rtol=1e-5, atol=1e-6)
    x = (rng.standard_normal(70_000) * 5).astype(np.float32)  # threaded in 1024-element units, then a tail
    whole = kernels.gelu_tanh(x)
    np.testing.assert_array_equal(whole[-400:], kernels.gelu_tanh(x[-400:]))  # one formula wherever it falls
    big = np.array([-100.0, -20.0, 20.0, 100.0], np.float32)  # the tails saturate, no inf/nan
    np.testing.assert_allclose(kernels.gelu_tanh(big), [0.0, 0.0, 20.0, 100.0], atol=1e-6)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n,heads,hd", [(1, 2, 8), (47, 3, 12), (97, 2, 72), (300, 4, 64)])
def test_self_attention_equals_twin(n, heads, hd, threads):
    kernels.set_threads(threads)
    rng = np.random.default_rng(n + hd)
    qkv = (rng.standard_normal((n, 3 * heads * hd)) * 2).astype(np.float32)
    cos, sin = rope_for(n, hd)
    got, want = kernels.self_attention(qkv, heads, cos, sin), vision.self_attention(qkv, heads, cos, sin)
    assert got.shape == (n, heads * hd)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=3e-5)


def test_self_attention_rejects_bad_shapes():
    qkv = np.zeros((5, 3 * 2 * 8), np.float32)
    cos, sin = rope_for(5, 8)
    with pytest.raises(ValueError):
        kernels.self_attention(qkv, 2, cos[:4], sin[:4])
    with pytest.raises(ValueError):
        kernels.self_attention(qkv[:, :-1], 2, cos, sin)


def _bf16(rng, *shape):
    w = (rng.standard_normal(shape) * 0.05).astype(np.float32)
    return (w.view(np.uint32) >> 16).astype(np.uint16)  # (out, in) BF16 bits


def test_native_vision_block_equals_numpy_block():
    rng = np.random.default_rng(7)
    cfg = vision.VisionConfig(depth=1, hidden_size=256, intermediate_size=1024, num_heads=4, in_channels=3,
                              patch_size=16, temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=256,
                              num_position_embeddings=64, deepstack_visual_indexes=())
    raw = {k: _bf16(rng, *s) for k, s in dict(qkv=(768, 256), proj=(256, 256), fc1=(1024, 256), fc2=(256, 1024)).items()}
    bias = {k: (rng.standard_normal(v.shape[0]) * 0.1).astype(np.float32) for k, v in raw.items()}
    norms = [tuple(rng.standard_normal((2, 256)).astype(np.float32)) for _ in range(2)]

    def tower(native: bool):
        lin = {k: vision.Linear(half_weight(v, "BF16") if native else
                                DenseWeight((v.astype(np.uint32) << 16).view(np.float32)), bias[k])
               for k, v in raw.items()}
        blk = vision.VisionBlock(norms[0], lin["qkv"], lin["proj"], norms[1], lin["fc1"], lin["fc2"])
        return vision.VisionTower(cfg, None, None, [blk], None, [], vision.vision_ops(native)), blk

    x = rng.standard_normal((196, 256)).astype(np.float32)
    cos, sin = rope_for(196, 64)
    (nt, nb), (pt, pb) = tower(True), tower(False)
    assert nt.ops.self_attention is kernels.self_attention and pt.ops.self_attention is vision.self_attention
    got, want = nt.run_block(nb, x, cos, sin), pt.run_block(pb, x, cos, sin)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert np.abs(got - x).max() > 0.1  # the block did something


def test_numpy_attention_blocks_equal_one_block(monkeypatch):
    rng = np.random.default_rng(3)
    qkv = rng.standard_normal((120, 3 * 2 * 16)).astype(np.float32)
    cos, sin = rope_for(120, 16)
    whole = vision.self_attention(qkv, 2, cos, sin)
    monkeypatch.setattr(vision, "ATTN_BLOCK_ELEMS", 120 * 7)  # 7 queries per block
    np.testing.assert_allclose(vision.self_attention(qkv, 2, cos, sin), whole, rtol=1e-5, atol=1e-6)
