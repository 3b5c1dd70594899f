"""The C decoder operations equal their numpy twins, and the native layers (one C call per forward) equal
qwen3.forward_hidden on random models of each flavour (qwen3: q/k norms; qwen2: q/k/v biases; llama:
neither) and each weight kind (quantized GGUF blocks, float32, BF16), prefill then decode."""
import ctypes
import os
import zlib

import numpy as np
import pytest

from appliance.engine import qwen3
from appliance.engine.config import Qwen3Config
from appliance.engine.layer_runner import NativeLayers, choose_runner, native_layers
from appliance.engine.quant_weights import QuantWeight
from appliance.engine.weights import DenseWeight
from appliance.native import kernels, ops_numpy
from appliance.native.dequant_numpy import dequantize
from appliance.native.qtypes import QType
from tests.support.ggml_blocks import random_weight

if os.environ.get("KESTREL_NATIVE") == "0":
    pytest.skip("native kernels disabled by KESTREL_NATIVE=0", allow_module_level=True)


@pytest.fixture(scope="module", autouse=True)
def lib():
    assert kernels.available(), f"native library not available: {kernels.load_error}"


def test_ops_equal_twins():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 37)).astype(np.float32)
    w = rng.standard_normal(37).astype(np.float32)
    np.testing.assert_allclose(kernels.rms_norm(x, w, 1e-6), ops_numpy.rms_norm(x, w, 1e-6), rtol=1e-5, atol=1e-6)
    q = rng.standard_normal((3, 5, 16)).astype(np.float32)
    ang = rng.uniform(-3, 3, (3, 8))
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    np.testing.assert_allclose(kernels.rope(q, cos, sin), ops_numpy.rope(q, cos, sin), rtol=1e-5, atol=1e-6)
    g, u = rng.standard_normal((2, 50)).astype(np.float32)
    np.testing.assert_allclose(kernels.swiglu(g, u), ops_numpy.swiglu(g, u), rtol=1e-5, atol=1e-6)
    for T, S in [(1, 1), (1, 9), (4, 4), (3, 11)]:
        H, KV, hd, L = 6, 2, 24, 16
        qq = rng.standard_normal((T, H, hd)).astype(np.float32)
        kc, vc = rng.standard_normal((2, KV, L, hd)).astype(np.float32)
        np.testing.assert_allclose(kernels.attention(qq, kc, vc, S), ops_numpy.attention(qq, kc, vc, S),
                                   rtol=1e-5, atol=1e-5)


class WidenedBF16:
    """A BF16 matrix whose products run in numpy over its exactly widened values (the reference side), while
    the native decoder reads the same bits in place through native_spec()."""

    def __init__(self, bits: np.ndarray):
        self.bits, self.shape = bits, bits.shape  # (out, in) uint16
        self.w = dequantize(QType.BF16, bits)  # (out, in) float32

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return x @ self.w.T

    def native_spec(self):
        return QType.BF16, self.bits


def _weight(kind, out, n, rng):
    if kind == "f32":
        return DenseWeight((rng.standard_normal((out, n)) * 0.1).astype(np.float32))
    if kind == "bf16":
        f = (rng.standard_normal((out, n)) * 0.1).astype(np.float32)
        return WidenedBF16((f.view(np.uint32) >> 16).astype(np.uint16))
    qtype = QType[kind]
    return QuantWeight(qtype, (out, n), random_weight(qtype, out, n, rng))


def _model(flavour, kinds, rng, D=256, H=4, KV=2, hd=64, I=512, L=2, V=97):
    cfg = Qwen3Config(flavour, V, D, I, L, H, KV, hd, 1e-6, 10000.0, 4096, False,
                      qk_norm=flavour == "qwen3", attention_bias=flavour == "qwen2")
    layers = []
    for i in range(L):
        k = kinds[i % len(kinds)]
        vec = lambda n: (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)
        bias = lambda n: (0.1 * rng.standard_normal(n)).astype(np.float32) if flavour == "qwen2" else None
        attn = qwen3.Attention(_weight(k, H * hd, D, rng), _weight(k, KV * hd, D, rng), _weight(k, KV * hd, D, rng),
                               _weight(k, D, H * hd, rng),
                               q_norm=vec(hd) if flavour == "qwen3" else None,
                               k_norm=vec(hd) if flavour == "qwen3" else None,
                               q_bias=bias(H * hd), k_bias=bias(KV * hd), v_bias=bias(KV * hd))
        mlp = qwen3.SwiGLU(_weight(k, I, D, rng), _weight(k, I, D, rng), _weight(k, D, I, rng))
        layers.append(qwen3.Layer(0.1 * vec(D), attn, 0.1 * vec(D), mlp))  # weights are of order 1: keep activations sane
    emb = DenseWeight(rng.standard_normal((V, D)).astype(np.float32))
    return qwen3.Qwen3Model(cfg, emb, layers, np.ones(D, np.float32), emb)


# Float weights: both sides differ by float rounding only. Quantized weights: both sides run the same C
# products, but a last-bit difference in a norm can move an activation across an 8-bit rounding step, so
# those compare by relative RMS error (a wrong layer, head or position would be off by ~100%).
@pytest.mark.parametrize("flavour,kinds,tol", [
    ("qwen3", ["Q8_0", "Q4_K"], 1e-2),
    ("qwen2", ["Q4_0", "Q6_K"], 1e-2),
    ("llama", ["Q4_1"], 1e-2),
    ("qwen3", ["f32", "bf16"], 1e-4),
])
def test_native_decoder_equals_numpy_forward(flavour, kinds, tol):
    rng = np.random.default_rng(zlib.crc32(" ".join((flavour, *kinds)).encode()))
    m = _model(flavour, kinds, rng)
    dec = native_layers(m)
    assert dec is not None
    ca, cb = m.new_cache(64), m.new_cache(64)
    cfg = m.config
    for tokens in ([3, 1, 4, 1, 5], [9], [2], [6]):  # prefill, then decode steps
        pos = ca.length + np.arange(len(tokens))
        cos, sin = qwen3.rope_cos_sin(pos, cfg.head_dim, cfg.rope_theta)
        h = m.embed.rows(np.array(tokens))
        want = qwen3.numpy_layers(m, h, ca, cos, sin)
        got = dec.forward_hidden(h, cb, cos, sin)
        assert ca.length == cb.length
        for a, b in [(got, want)] + [(cb.k[i][:, :cb.length], ca.k[i][:, :ca.length])
                                     for i in range(cfg.num_hidden_layers)]:
            if kinds[0] in ("f32", "bf16"):
                assert np.abs(a - b).max() <= tol * np.abs(b).max()
            else:
                assert np.sqrt(np.mean((a - b) ** 2)) <= tol * np.sqrt(np.mean(b ** 2))


def test_build_declines_what_it_cannot_serve():
    rng = np.random.default_rng(1)
    m = _model("qwen3", ["Q8_0"], rng)
    m.layers[1].mlp = lambda x: x  # e.g. a mixture-of-experts block
    assert native_layers(m) is None
    m = _model("qwen3", ["Q8_0"], rng)
    m.layers[0].attn.q = QuantWeight(m.layers[0].attn.q.qtype, m.layers[0].attn.q.shape, m.layers[0].attn.q.raw,
                                     native=False)
    assert native_layers(m) is None


def test_runner_is_chosen_once_at_load(tiny_qwen3_tied):
    from appliance.engine.load import load_model
    m = load_model(tiny_qwen3_tied).model
    assert isinstance(m.runner, NativeLayers)
    m = _model("qwen3", ["Q8_0"], np.random.default_rng(2), L=1)
    assert m.runner is None  # a model built by hand runs its numpy layers until a runner is chosen
    m.layers[0].mlp = lambda x: x
    choose_runner(m)
    assert m.runner is None


def test_forward_hidden_takes_the_native_path_when_served():
    rng = np.random.default_rng(3)
    m = _model("qwen3", ["Q8_0"], rng, L=1)
    choose_runner(m)
    dec = m.runner.decoder
    calls = []
    orig = dec.forward_layers
    dec.forward_layers = lambda *a: calls.append(1) or orig(*a)
    cache = m.new_cache(16)
    logits = m.forward(np.array([1, 2, 3]), cache)
    assert calls == [1] and cache.length == 3 and logits.shape == (m.config.vocab_size,)
    half = m.new_cache(16)
    half.k = [a.astype(np.float16) for a in half.k]  # not a cache the C side writes: the numpy layers run
    assert not m.runner.serves(half)
    m.forward(np.array([1]), half)
    assert calls == [1] and half.length == 1


def test_after_layer_hook_runs_between_native_layers():
    """With an after_layer hook (the vision-language model's DeepStack additions) the native decoder runs one
    C call per layer and applies the hook's result, equal to the numpy layers with the same hook."""
    rng = np.random.default_rng(5)
    m = _model("qwen3", ["f32"], rng)
    choose_runner(m)
    assert m.runner is not None
    T, D = 5, m.config.hidden_size
    h = rng.standard_normal((T, D)).astype(np.float32)
    extra = rng.standard_normal((T, D)).astype(np.float32)
    cos, sin = qwen3.rope_cos_sin(np.arange(T), m.config.head_dim, m.config.rope_theta)
    seen = []

    def hook(i, x):
        seen.append(i)
        return x + extra if i == 0 else x

    ca, cb = m.new_cache(16), m.new_cache(16)
    want = qwen3.numpy_layers(m, h, ca, cos, sin, after_layer=hook)
    got = qwen3.forward_hidden(m, h, cb, cos, sin, after_layer=hook)
    assert seen == list(range(len(m.layers))) * 2
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    assert np.abs(got - qwen3.numpy_layers(m, h, m.new_cache(16), cos, sin)).max() > 1e-3  # the hook mattered


def test_attention_reads_float16_caches_like_its_twin():
    """kq_attention over IEEE-half caches (converted in blocks of 256 positions) equals the numpy twin over the
    same caches, and both equal float32 attention over the exactly widened values."""
    rng = np.random.default_rng(4)
    for T, S, hd in [(1, 1, 64), (1, 300, 64), (5, 600, 128), (3, 11, 24)]:
        H, KV, L = 4, 2, 640
        q = rng.standard_normal((T, H, hd)).astype(np.float32)
        kc, vc = (rng.standard_normal((2, KV, L, hd)) * 3).astype(np.float16)
        kc[0, 0, :4] = [6e-8, -3e-5, 65504, -0.0]  # a subnormal, the smallest normal's neighbour, the largest half
        got = kernels.attention(q, kc, vc, S)
        np.testing.assert_allclose(got, ops_numpy.attention(q, kc, vc, S), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got, kernels.attention(q, kc.astype(np.float32), vc.astype(np.float32), S),
                                   rtol=1e-5, atol=1e-5)  # the values summed in blocks: float rounding only


@pytest.mark.parametrize("kinds", [["f32"], ["Q8_0"]])
def test_native_decoder_writes_float16_caches_rounded_like_numpy(kinds):
    rng = np.random.default_rng(zlib.crc32(("f16 " + kinds[0]).encode()))
    m = _model("qwen3", kinds, rng)
    dec = native_layers(m)
    full, half, ref = m.new_cache(64), m.new_cache(64, np.float16), m.new_cache(64, np.float16)
    assert dec.serves(half) and half.bytes_per_token * 2 == full.bytes_per_token
    cfg = m.config
    for tokens in ([3, 1, 4, 1, 5], [9], [2]):
        pos = full.length + np.arange(len(tokens))
        cos, sin = qwen3.rope_cos_sin(pos, cfg.head_dim, cfg.rope_theta)
        h = m.embed.rows(np.array(tokens))
        a = dec.forward_hidden(h, full, cos, sin)
        start = half.length
        b = dec.forward_hidden(h, half, cos, sin)
        c = qwen3.numpy_layers(m, h, ref, cos, sin)  # numpy layers, f16 cache
        # the first layer's new keys/values see the same inputs: stored with numpy's float16 rounding
        np.testing.assert_array_equal(half.k[0][:, start:half.length], full.k[0][:, start:full.length].astype(np.float16))
        np.testing.assert_array_equal(half.v[0][:, start:half.length], full.v[0][:, start:full.length].astype(np.float16))
        if kinds[0] == "f32":
            assert np.abs(b - a).max() <= 2e-2 * np.abs(a).max()  # float16 keys/values vs float32 ones
            assert np.abs(b - c).max() <= 1e-4 * np.abs(c).max()  # C vs numpy over the same float16 cache
        else:  # 8-bit activations turn small differences into a different rounding now and then: compare RMS
            assert np.sqrt(np.mean((b - a) ** 2)) <= 2e-2 * np.sqrt(np.mean(a ** 2))
            assert np.sqrt(np.mean((b - c) ** 2)) <= 2e-2 * np.sqrt(np.mean(c ** 2))


@pytest.mark.parametrize("H", [8, 6])  # 4 or 3 query heads per KV head
@pytest.mark.parametrize("kv_dtype", [np.float32, np.float16])
def test_attention_rows_independent_of_chunking_and_threads(kv_dtype, H):
    """A query's attention depends only on it, the cache and its causal limit: computing 40 tokens at once (several
    query blocks per KV head, keys in 3 blocks), in uneven chunks, one at a time, or with a thread count that splits
    the grouped heads gives bit-identical rows (chunked prefill and decode agree with whole prefill); positions
    past S are never read (NaN there leaves the result finite), and the result equals the numpy twin."""
    rng = np.random.default_rng(7)
    KV, hd, L, S, T = 2, 64, 700, 650, 40
    q = rng.standard_normal((T, H, hd)).astype(np.float32)
    kc, vc = (rng.standard_normal((2, KV, L, hd)) * 2).astype(kv_dtype)
    kc[:, S:], vc[:, S:] = np.nan, np.nan
    before = kernels.get_threads()
    try:
        kernels.set_threads(1)
        whole = kernels.attention(q, kc, vc, S)
        assert np.isfinite(whole).all()
        np.testing.assert_allclose(whole, ops_numpy.attention(q, kc[:, :S], vc[:, :S], S), rtol=1e-5, atol=1e-5)
        for threads in (1, 3):
            kernels.set_threads(threads)
            for a, b in [(0, 13), (13, 14), (14, 40), (39, 40)]:
                np.testing.assert_array_equal(kernels.attention(q[a:b], kc, vc, S - T + b), whole[a:b])
    finally:
        kernels.set_threads(before)


def _fail_alloc(n: int) -> int:
    """kq_test_fail_alloc: arm (n > 0: the n-th scratch request fails) or disarm; the requests counted so far."""
    f = kernels._lib.kq_test_fail_alloc
    f.restype, f.argtypes = ctypes.c_int64, [ctypes.c_int64]
    return f(n)


def test_a_failed_allocation_is_a_memory_error_and_stops_the_layers():
    """kq_forward returns at its first failing status: a scratch allocation failing anywhere in the layers is a
    MemoryError (never merged with a later status), and nothing after it asks for memory again (no later
    product or layer runs on the lost values)."""
    m = _model("qwen3", ["Q8_0"], np.random.default_rng(5), L=2)
    dec = native_layers(m)
    assert dec is not None
    cos, sin = qwen3.rope_cos_sin(np.arange(3), m.config.head_dim, m.config.rope_theta)
    h = m.embed.rows(np.array([3, 1, 4]))
    kernels.set_threads(1)  # the scratch requests in one fixed order, all on this thread
    try:
        _fail_alloc(0)
        _fail_alloc(1 << 40)  # counted, never reached
        want = dec.forward_hidden(h.copy(), m.new_cache(16), cos, sin)
        total = _fail_alloc(0)
        assert total >= 2 * 8  # per layer: the forward's own, seven products, attention
        for n in range(1, total + 1):
            _fail_alloc(n)
            with pytest.raises(MemoryError):
                dec.forward_hidden(h.copy(), m.new_cache(16), cos, sin)
            assert _fail_alloc(0) == n, f"requests after the failing one (request {n} of {total})"
        np.testing.assert_array_equal(dec.forward_hidden(h.copy(), m.new_cache(16), cos, sin), want)
    finally:
        _fail_alloc(0)
        kernels.configure_threads()
