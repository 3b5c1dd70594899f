"""Property-based fuzzing of every Python-callable native entry point against its numpy twin: hypothesis picks
the shapes (empty, one, odd, not a multiple of a block or tile, a few hundred), the input layouts (Fortran
order, strided, negative strides, float64), the SIMD level and the pool's thread count; the C result must equal
the twin within the tolerance of the hand-written tests (tests/native/test_native_kernels.py, _decoder.py, _moe.py,
_vision.py): bit-exact for the quantized products, quantizers, dequantizers and the x8 repack, a float
tolerance elsewhere. Invalid arguments: tests/native/test_native_fuzz_invalid.py. The sanitizer tier
(tests/system/test_native_sanitizers.py) runs both files under ASan/UBSan and TSan; KESTREL_FUZZ_SCALE=20 is the long run.
"""
import os

import numpy as np
import pytest
from hypothesis import given, strategies as st

from appliance.engine import vision
from appliance.native import dequant_numpy, kernels, ops_numpy, twins
from appliance.native.qtypes import BLOCK, QType, row_bytes
from tests.support.ggml_blocks import random_weight
from tests.support.native_fuzz import LAYOUTS, MACHINES, fuzz, layout, normal, use

if os.environ.get("KESTREL_NATIVE") == "0":
    pytest.skip("native kernels disabled by KESTREL_NATIVE=0", allow_module_level=True)
pytestmark = pytest.mark.usefixtures("native_lib")

QTYPES = list(QType)
FLOAT = (QType.F32, QType.F16, QType.BF16)
SEEDS = st.integers(0, 2**32 - 1)
W_LAYOUTS = ["c", "strided_rows", "reversed", "typed"]


@pytest.fixture(scope="module", autouse=True)
def restore_simd():
    yield
    kernels.set_simd_level(kernels.simd_max())


def weight(qtype: QType, rows: int, n: int, rng) -> np.ndarray:
    """(rows, row_bytes) uint8 blocks of a random tensor (also of no rows or no columns)."""
    if rows == 0 or n == 0:
        return np.zeros((rows, row_bytes(qtype, n)), np.uint8)
    return random_weight(qtype, rows, n, rng)


def weight_layout(w: np.ndarray, qtype: QType, kind: str) -> np.ndarray:
    """The same bytes as another array a caller may hand in: strided rows, negative strides, or typed."""
    if kind == "strided_rows":
        b = np.zeros((2 * w.shape[0], w.shape[1]), np.uint8)
        b[::2] = w
        return b[::2]
    if kind == "reversed":
        return layout(w, "reversed")
    if kind == "typed" and qtype in FLOAT:
        return w.view({QType.F32: np.float32, QType.F16: np.float16, QType.BF16: np.uint16}[qtype])
    return w


def width(qtype: QType, blocks: int, floats: int) -> int:
    return floats if BLOCK[qtype][0] == 1 else BLOCK[qtype][0] * blocks


def assert_product(qtype, got, w, x):
    """got == x @ W.T: bit-exact for the quantized types, within the float-product bound otherwise."""
    T, rows = x.shape[0], w.shape[0]
    assert got.shape == (T, rows) and got.dtype == np.float32
    if got.size == 0 or x.shape[1] == 0:
        np.testing.assert_array_equal(got, np.zeros((T, rows), np.float32))
        return
    want = twins.matmul(qtype, w, x)
    if qtype in FLOAT:
        bound = 1e-6 * x.shape[1] * np.abs(x) @ np.abs(dequant_numpy.dequantize(qtype, w)).T + 1e-30
        assert np.all(np.abs(got - want) <= bound)
    else:
        np.testing.assert_array_equal(got, want)


@fuzz(200)
@given(qtype=st.sampled_from(QTYPES), rows=st.integers(0, 40), blocks=st.integers(0, 4), floats=st.integers(0, 300),
       T=st.integers(0, 20), scale=st.sampled_from([1e-3, 1.0, 30.0]), xl=st.sampled_from(LAYOUTS),
       wl=st.sampled_from(W_LAYOUTS), machine=MACHINES, seed=SEEDS)
def test_matmul_equals_twin(qtype, rows, blocks, floats, T, scale, xl, wl, machine, seed):
    use(machine)
    rng = np.random.default_rng(seed)
    n = width(qtype, blocks, floats)
    w, x = weight(qtype, rows, n, rng), normal(rng, (T, n), scale)
    assert_product(qtype, kernels.matmul(qtype, weight_layout(w, qtype, wl), layout(x, xl)), w, x)


@fuzz(150)
@given(qtype=st.sampled_from(twins.X8_TYPES), rows=st.integers(0, 40), blocks=st.integers(0, 4),
       T=st.integers(0, 20), scale=st.sampled_from([1e-3, 1.0, 30.0]), xl=st.sampled_from(LAYOUTS),
       machine=MACHINES, seed=SEEDS)
def test_x8_repack_and_products_equal_twin(qtype, rows, blocks, T, scale, xl, machine, seed):
    """repack_x8 equals its twin byte for byte; matmul_x8 and bound_matmul (row and x8 layouts) equal the
    row-layout twin product."""
    use(machine)
    rng = np.random.default_rng(seed)
    n = width(qtype, blocks, 0)
    w, x = weight(qtype, rows, n, rng), normal(rng, (T, n), scale)
    w8 = kernels.repack_x8(qtype, w)
    assert w8.shape == ((rows + 7) // 8, kernels.x8_row_bytes(qtype, n)) and w8.dtype == np.uint8
    if w.size:
        np.testing.assert_array_equal(w8, twins.repack_x8(qtype, w))
        np.testing.assert_array_equal(twins.unpack_x8(qtype, w8, rows), w)
    assert_product(qtype, kernels.matmul_x8(qtype, w8, rows, layout(x, xl)), w, x)
    assert_product(qtype, kernels.bound_matmul(qtype, w, w8)(x), w, x)
    assert_product(qtype, kernels.bound_matmul(qtype, w)(x), w, x)


@fuzz(100)
@given(T=st.integers(0, 6), b32=st.integers(0, 20), b256=st.integers(0, 3), scale=st.sampled_from([1e-6, 1.0, 1e4]),
       ties=st.booleans(), xl=st.sampled_from(LAYOUTS), machine=MACHINES, seed=SEEDS)
def test_activation_quantizers_equal_twin(T, b32, b256, scale, ties, xl, machine, seed):
    use(machine)
    rng = np.random.default_rng(seed)
    for n, c, py in [(32 * b32, kernels.quantize_q8_32, twins.quantize_q8_32),
                     (256 * b256, kernels.quantize_q8_K, twins.quantize_q8_K)]:
        x = normal(rng, (T, n), scale)
        if ties and x.size:  # a block whose scale is a power of two: values k + 0.5 times it round half to even
            s = np.float32(2.0 ** rng.integers(-10, 10))
            x[0, 0] = 127 * s
            x[0, 1:min(n, 32)] = (rng.integers(-120, 120, min(n, 32) - 1) + 0.5) * s
        got = c(layout(x, xl))
        assert got.shape == (T, n // (32 if c is kernels.quantize_q8_32 else 256))
        if got.size:
            assert got.tobytes() == py(x).tobytes()


@fuzz(120)
@given(qtype=st.sampled_from(QTYPES), rows=st.integers(0, 20), blocks=st.integers(0, 3), floats=st.integers(0, 70),
       ids=st.lists(st.integers(0, 19), max_size=12), id_dtype=st.sampled_from(["int64", "int32", "uint16", "list"]),
       wl=st.sampled_from(W_LAYOUTS), seed=SEEDS)
def test_dequantize_and_get_rows_equal_twin(qtype, rows, blocks, floats, ids, id_dtype, wl, seed):
    rng = np.random.default_rng(seed)
    n = width(qtype, blocks, floats)
    w = weight(qtype, rows, n, rng)
    got = kernels.dequantize(qtype, weight_layout(w, qtype, wl))
    want = dequant_numpy.dequantize(qtype, w) if w.size else np.zeros((rows, n), np.float32)
    np.testing.assert_array_equal(got, want)
    ids = [i for i in ids if i < rows]
    ids_arg = ids if id_dtype == "list" else np.array(ids, dtype=id_dtype)
    got = kernels.get_rows(qtype, weight_layout(w, qtype, wl), ids_arg)
    np.testing.assert_array_equal(got, want[np.array(ids, dtype=np.int64)].reshape(len(ids), n))


@fuzz(150)
@given(T=st.integers(0, 40), n=st.integers(0, 300), nh=st.integers(1, 6), half=st.integers(1, 70),
       eps=st.sampled_from([1e-6, 1e-5, 0.5]), xl=st.sampled_from(LAYOUTS), machine=MACHINES, seed=SEEDS)
def test_decoder_ops_equal_twins(T, n, nh, half, eps, xl, machine, seed):
    """rms_norm, rope, swiglu (tolerance of test_native_decoder.test_ops_equal_twins)."""
    use(machine)
    rng = np.random.default_rng(seed)
    x, w = normal(rng, (T, n), 3.0), (1 + 0.3 * rng.standard_normal(n)).astype(np.float32)
    got = kernels.rms_norm(layout(x, xl), w, eps)
    np.testing.assert_allclose(got, ops_numpy.rms_norm(x, w, eps) if n else x, rtol=1e-5, atol=1e-6)
    q = normal(rng, (T, nh, 2 * half))
    ang = rng.uniform(-30, 30, (T, half))
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    np.testing.assert_allclose(kernels.rope(layout(q, xl), cos, sin), ops_numpy.rope(q, cos, sin), rtol=1e-5,
                               atol=1e-6)
    g, u = normal(rng, (T, n), 8.0), normal(rng, (T, n))
    with np.errstate(over="ignore"):  # the twin's exp(-g) for g < -88 (silu -> -0)
        np.testing.assert_allclose(kernels.swiglu(layout(g, xl), u), ops_numpy.swiglu(g, u), rtol=1e-5, atol=1e-6)


@fuzz(150)
@given(T=st.integers(1, 12), past=st.integers(0, 300), slack=st.integers(0, 20), KV=st.integers(1, 3),
       rep=st.integers(1, 4), hd=st.one_of(st.integers(1, 24), st.sampled_from([64, 128])), f16=st.booleans(),
       xl=st.sampled_from(LAYOUTS), machine=MACHINES, seed=SEEDS)
def test_attention_equals_twin(T, past, slack, KV, rep, hd, f16, xl, machine, seed):
    """Causal grouped-query attention over float32 and float16 caches; the cache past S holds NaN, so a read
    past the causal limit shows up as a wrong answer."""
    use(machine)
    rng = np.random.default_rng(seed)
    S = T + past
    H, L = KV * rep, S + slack
    q = normal(rng, (T, H, hd))
    kc, vc = normal(rng, (2, KV, L, hd), 1.5).astype(np.float16 if f16 else np.float32)
    kc[:, S:], vc[:, S:] = np.nan, np.nan
    got = kernels.attention(layout(q, xl), kc, vc, S)
    assert got.shape == (T, H, hd)
    np.testing.assert_allclose(got, ops_numpy.attention(q, kc, vc, S), rtol=1e-5, atol=1e-5)


@fuzz(120)
@given(T=st.integers(0, 80), n=st.integers(1, 1100), big=st.booleans(), gelu_n=st.integers(0, 3000),
       xl=st.sampled_from(LAYOUTS), machine=MACHINES, seed=SEEDS)
def test_vision_norm_and_gelu_equal_twins(T, n, big, gelu_n, xl, machine, seed):
    """layer_norm and gelu_tanh, below and above the sizes where they go to the pool (65536 elements)."""
    use(machine)
    rng = np.random.default_rng(seed)
    x = normal(rng, (T, n), 3.0) + np.float32(2)
    w, b = rng.standard_normal((2, n)).astype(np.float32)
    np.testing.assert_allclose(kernels.layer_norm(layout(x, xl), w, b), vision.layer_norm(x, w, b), rtol=1e-5,
                               atol=2e-5)
    g = normal(rng, (65536 + gelu_n if big else gelu_n,), 5.0)
    np.testing.assert_allclose(kernels.gelu_tanh(layout(g, xl)), vision.gelu_tanh(g), rtol=1e-5, atol=1e-6)


@fuzz(100)
@given(N=st.integers(1, 130), heads=st.integers(1, 4), half=st.integers(1, 40), xl=st.sampled_from(LAYOUTS),
       machine=MACHINES, seed=SEEDS)
def test_self_attention_equals_twin(N, heads, half, xl, machine, seed):
    use(machine)
    rng = np.random.default_rng(seed)
    hd = 2 * half
    qkv = normal(rng, (N, 3 * heads * hd), 2.0)
    ang = rng.uniform(-20, 20, (N, half))
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    got = kernels.self_attention(layout(qkv, xl), heads, cos, sin)
    assert got.shape == (N, heads * hd)
    np.testing.assert_allclose(got, vision.self_attention(qkv, heads, cos, sin), rtol=1e-5, atol=3e-5)


@fuzz(100)
@given(gq=st.sampled_from(QTYPES), dq=st.sampled_from(QTYPES), E=st.integers(1, 6), k=st.integers(1, 6),
       dblocks=st.integers(1, 2), iblocks=st.integers(1, 2), floats=st.integers(1, 70), T=st.integers(0, 12),
       norm=st.booleans(), stacked=st.booleans(), machine=MACHINES, seed=SEEDS)
def test_moe_ffn_equals_twin(gq, dq, E, k, dblocks, iblocks, floats, T, norm, stacked, machine, seed):
    """The routed experts (kernels.MoEFFN) against ops_numpy.moe_ffn: the same experts per token (counts) and
    outputs within test_native_moe's tolerance when the down products are float; quantized down products
    round the C SwiGLU's output to 8 bits, where a last-bit difference can move one step, so there each
    token's output is compared by relative RMS error (a wrong expert or weight is off by ~100%)."""
    use(machine)
    rng = np.random.default_rng(seed)
    k = min(k, E)
    D, I = width(gq, dblocks, floats), width(dq, iblocks, floats + 3)

    def experts(qtype, rows, n):
        if stacked:
            w = np.stack([weight(qtype, rows, n, rng) for _ in range(E)])  # (E, rows, row_bytes)
            return qtype, [w[e] for e in range(E)]
        return qtype, [weight(qtype, rows, n, rng) for _ in range(E)]

    gate, up, down = experts(gq, I, D), experts(gq, I, D), experts(dq, D, I)
    router = rng.standard_normal((E, D)).astype(np.float32)
    x = normal(rng, (T, D), 0.05 if gq in FLOAT else 1.0)
    ffn = kernels.MoEFFN(router, k, norm, gate, up, down)
    got = ffn(x)
    assert got.shape == (T, D)
    if T == 0:
        return
    with np.errstate(over="ignore"):  # the twin's exp(-g) for g < -88 (silu -> -0)
        want = ops_numpy.moe_ffn(x, router, k, norm, gate, up, down)
    top, _ = ops_numpy.route(x, router, k, norm)
    np.testing.assert_array_equal(ffn.counts, np.bincount(top.ravel(), minlength=E))
    if dq in FLOAT:  # the float-product bound over each token's weighted down products, as in assert_product
        top, wts = ops_numpy.route(x, router, k, norm)
        mags = np.zeros_like(want)  # (T, D): sum over the token's experts of w * |h| @ |W_down|.T
        for t, j in np.ndindex(*top.shape):
            e = top[t, j]
            with np.errstate(over="ignore"):
                h = ops_numpy.swiglu(twins.matmul(gq, gate[1][e], x[t:t + 1]), twins.matmul(gq, up[1][e], x[t:t + 1]))
            mags[t] += wts[t, j] * (np.abs(h) @ np.abs(dequant_numpy.dequantize(dq, down[1][e])).T)[0]
        assert np.all(np.abs(got - want) <= 1e-6 * (I + 10) * mags + 1e-6)
    else:
        err = np.sqrt(np.mean((got - want) ** 2, axis=-1))
        assert np.all(err <= 1e-2 * np.sqrt(np.mean(want ** 2, axis=-1)) + 1e-6)
