"""Invalid arguments to the native entry points end in a clear Python exception raised before C reads or writes
anything (ValueError for shapes and sizes, TypeError for types, IndexError for row ids out of range), never in a
crash, an out-of-bounds access (the sanitizer tier runs this file under ASan) or a silent wrong answer; and
non-finite inputs (NaN, inf) never take the library outside its arrays. hypothesis draws the case and its
sizes; after each, a valid product still equals its twin. Valid arguments: tests/native/test_native_fuzz.py."""
import functools
import os

import numpy as np
import pytest
from hypothesis import given, strategies as st

from appliance.native import kernels, ops_numpy, twins
from appliance.native.qtypes import BLOCK, QType
from tests.support.ggml_blocks import random_weight
from tests.support.native_fuzz import MACHINES, fuzz, use

if os.environ.get("KESTREL_NATIVE") == "0":
    pytest.skip("native kernels disabled by KESTREL_NATIVE=0", allow_module_level=True)
pytestmark = pytest.mark.usefixtures("native_lib")

SEEDS = st.integers(0, 2**32 - 1)
SIZES = st.integers(1, 9)
NOT_REAL = [np.complex64, object, "U3", "datetime64[s]"]


@pytest.fixture(scope="module", autouse=True)
def restore_simd():
    yield
    kernels.set_simd_level(kernels.simd_max())


def f32(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def off(draw, n: int) -> int:
    """A size other than n (not below 0)."""
    return draw(st.integers(0, n + 5).filter(lambda m: m != n))


def matmul_cases(draw, rng):
    q = draw(st.sampled_from(list(QType)))
    bs, nbytes = BLOCK[q]
    rows, n = draw(SIZES), bs * draw(SIZES) if bs > 1 else draw(SIZES)
    w, x = random_weight(q, rows, n, rng), f32(rng, draw(SIZES), n)
    x8q = draw(st.sampled_from(twins.X8_TYPES))
    n8 = BLOCK[x8q][0] * draw(SIZES)
    w8 = kernels.repack_x8(x8q, random_weight(x8q, rows, n8, rng))
    x8, xs = f32(rng, 2, n8), f32(rng, 3, n)
    bound = kernels.bound_matmul(q, w)
    part = draw(st.integers(1, nbytes - 1))  # bytes cut off each row: never a whole block
    groups = (rows + 7) // 8  # another row count needs another number of 8-row groups (the layout has no count)
    rows8 = draw(st.integers(0, rows + 20).filter(lambda r: (r + 7) // 8 != groups))
    return [
        (ValueError, lambda: kernels.matmul(q, w, f32(rng, 2, off(draw, n)))),
        (ValueError, lambda: kernels.matmul(q, w, x[0])),
        (ValueError, lambda: kernels.matmul(q, w, x[None])),
        (TypeError, lambda: kernels.matmul(q, w, x.astype(draw(st.sampled_from(NOT_REAL))))),
        (ValueError, lambda: kernels.matmul(q, w[:, :-part], x)),
        (ValueError, lambda: kernels.matmul(q, w.reshape(-1), x)),
        (ValueError, lambda: kernels.matmul(draw(st.sampled_from([4, 5, 99, -1, 0x108])), w, x)),
        (ValueError, lambda: kernels.dequantize(q, w[:, :-part])),
        (IndexError, lambda: kernels.get_rows(q, w, [draw(st.sampled_from([-1, rows, rows + 7]))])),
        (TypeError, lambda: kernels.get_rows(q, w, np.array([0.0, 0.7]))),
        (TypeError, lambda: kernels.get_rows(q, w, np.array([True]))),
        (ValueError, lambda: kernels.repack_x8(draw(st.sampled_from(list(QType))), w[:, :-1])),
        (ValueError, lambda: kernels.repack_x8(draw(st.sampled_from([QType.F32, QType.F16, QType.BF16])), w)),
        (ValueError, lambda: kernels.matmul_x8(x8q, w8, rows8, x8)),
        (ValueError, lambda: kernels.matmul_x8(x8q, w8, rows, f32(rng, 2, off(draw, n8)))),
        (ValueError, lambda: kernels.matmul_x8(x8q, w8.astype(np.float32), rows, x8)),
        (ValueError, lambda: kernels.matmul_x8(x8q, np.repeat(w8, 2, axis=1)[:, ::2], rows, x8)),
        (ValueError, lambda: kernels.matmul_x8(x8q, w8, -draw(SIZES), x8)),
        (TypeError, lambda: kernels.matmul_x8(x8q, w8, rows + 0.5, x8)),
        (ValueError, lambda: kernels.matmul_x8(draw(st.sampled_from([QType.F32, QType.F16, QType.BF16])), w8,
                                               rows, x8)),
        (ValueError, lambda: kernels.bound_matmul(x8q, random_weight(x8q, rows + 8, n8, rng), w8)),
        (ValueError, lambda: bound(f32(rng, 2, off(draw, n)))),
        (ValueError, lambda: bound(x.astype(np.float64))),
        (ValueError, lambda: bound(np.repeat(xs, 2, axis=1)[:, ::2])),
        (ValueError, lambda: bound(x.tolist())),
        (ValueError, lambda: kernels.quantize_q8_32(f32(rng, 2, 32 * draw(SIZES) + draw(st.integers(1, 31))))),
        (ValueError, lambda: kernels.quantize_q8_K(f32(rng, 2, 256 * draw(SIZES) - draw(st.integers(1, 255))))),
        (ValueError, lambda: kernels.quantize_q8_32(f32(rng, 32))),
    ]


def op_cases(draw, rng):
    T, n, nh, half = draw(SIZES), draw(SIZES), draw(SIZES), draw(SIZES)
    x, w = f32(rng, T, n), f32(rng, n)
    q, cs = f32(rng, T, nh, 2 * half), f32(rng, T, half)
    KV, rep, hd, S = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(SIZES), draw(SIZES)
    L, H = S + draw(st.integers(0, 3)), KV * rep
    qa, kc = f32(rng, min(T, S), H, hd), f32(rng, KV, L, hd).astype(draw(st.sampled_from([np.float32, np.float16])))
    heads = draw(st.integers(1, 3))
    qkv, sc = f32(rng, T, 3 * heads * 2 * half), f32(rng, T, half)
    return [
        (ValueError, lambda: kernels.rms_norm(x, f32(rng, off(draw, n)), 1e-6)),
        (ValueError, lambda: kernels.rms_norm(x, w[None], 1e-6)),
        (ValueError, lambda: kernels.rms_norm(x[0], w, 1e-6)),
        (ValueError, lambda: kernels.rope(q[0], cs, cs)),
        (ValueError, lambda: kernels.rope(q[None], cs, cs)),
        (ValueError, lambda: kernels.rope(f32(rng, T, nh, 2 * half + 1), cs, cs)),
        (ValueError, lambda: kernels.rope(q, f32(rng, off(draw, T), half), cs)),
        (ValueError, lambda: kernels.rope(q, cs, f32(rng, T, off(draw, half)))),
        (ValueError, lambda: kernels.swiglu(x, f32(rng, T, off(draw, n)))),
        (ValueError, lambda: kernels.swiglu(x, x.T) if x.shape != x.T.shape else kernels.swiglu(x, x[None])),
        (ValueError, lambda: kernels.attention(f32(rng, 1, H + draw(st.integers(1, KV - 1)) if KV > 1 else 0, hd),
                                               kc, kc, S)),  # heads not a multiple of the KV heads
        (ValueError, lambda: kernels.attention(f32(rng, 1, draw(st.integers(0, KV - 1)), hd), kc, kc, S)),
        (ValueError, lambda: kernels.attention(qa, kc, kc[:, :-1], S)),
        (ValueError, lambda: kernels.attention(f32(rng, 1, H, off(draw, hd)), kc, kc, S)),
        (ValueError, lambda: kernels.attention(qa, kc, kc, L + draw(SIZES))),
        (ValueError, lambda: kernels.attention(f32(rng, S + draw(SIZES), H, hd), kc, kc, S)),
        (ValueError, lambda: kernels.attention(qa, kc, kc, -draw(st.integers(0, 3)))),
        (ValueError, lambda: kernels.attention(qa[0], kc, kc, S)),
        (ValueError, lambda: kernels.attention(qa, kc[0], kc[0], S)),
        (TypeError, lambda: kernels.attention(qa, kc, kc, S + 0.5)),
        (ValueError, lambda: kernels.layer_norm(x, w, f32(rng, off(draw, n)))),
        (ValueError, lambda: kernels.layer_norm(x, f32(rng, off(draw, n)), w)),
        (ValueError, lambda: kernels.layer_norm(x[0], w, w)),
        (TypeError, lambda: kernels.gelu_tanh(x.astype(np.complex64))),
        (ValueError, lambda: kernels.self_attention(qkv, -draw(st.integers(0, 2)), sc, sc)),
        (TypeError, lambda: kernels.self_attention(qkv, heads + 0.5, sc, sc)),
        (ValueError, lambda: kernels.self_attention(qkv[:, :-draw(st.integers(1, 3))], heads, sc, sc)),
        (ValueError, lambda: kernels.self_attention(f32(rng, T, 3 * heads * (2 * half + 1)), heads, sc, sc)),
        (ValueError, lambda: kernels.self_attention(qkv, heads, f32(rng, off(draw, T), half), sc)),
        (ValueError, lambda: kernels.self_attention(qkv, heads, sc, f32(rng, T, off(draw, half)))),
        (ValueError, lambda: kernels.self_attention(qkv[:0], heads, sc[:0], sc[:0])),
    ]


def moe_cases(draw, rng):
    q = draw(st.sampled_from([QType.Q8_0, QType.Q4_0, QType.F32, QType.BF16]))
    E, D = draw(st.integers(1, 4)), 32 * draw(st.integers(1, 2))
    I = D + 32 * draw(st.integers(1, 2))  # not D: gate's shape is never down's
    k = draw(st.integers(1, E))
    gate = (q, [random_weight(q, I, D, rng) for _ in range(E)])
    down = (q, [random_weight(q, D, I, rng) for _ in range(E)])
    router = f32(rng, E, D)
    ffn = kernels.MoEFFN(router, k, True, gate, gate, down)
    return [
        (ValueError, lambda: kernels.MoEFFN(router, k, True, gate, gate, (q, down[1][:-1]))),
        (ValueError, lambda: kernels.MoEFFN(router, draw(st.sampled_from([0, -1, E + 1])), True, gate, gate, down)),
        (TypeError, lambda: kernels.MoEFFN(router, k + 0.5, True, gate, gate, down)),
        (ValueError, lambda: kernels.MoEFFN(router, k, True, gate, gate, gate)),
        (ValueError, lambda: kernels.MoEFFN(router, k, True, gate, (q, [random_weight(q, I + 32, D, rng)] * E), down)),
        (ValueError, lambda: kernels.MoEFFN(router[0], k, True, gate, gate, down)),
        (ValueError, lambda: kernels.MoEFFN(f32(rng, E, D + 32), k, True, gate, gate, down)),
        (ValueError, lambda: kernels.MoEFFN(router, k, True, (q, [m[:, :-1] for m in gate[1]]), gate, down)),
        (ValueError, lambda: ffn(f32(rng, 2, off(draw, D)))),
        (ValueError, lambda: ffn(f32(rng, D))),
        (TypeError, lambda: ffn(f32(rng, 2, D).astype(np.complex64))),
    ]


def expect_each(table) -> None:
    """Run every (exception, call) of the table; each must raise its exception (the message names the case's
    line in this file)."""
    for exc, call in table:
        where = f"the case at line {call.__code__.co_firstlineno}"
        try:
            call()
        except exc:
            continue
        except Exception as e:
            raise AssertionError(f"{where}: {type(e).__name__}: {e} (expected {exc.__name__})") from e
        raise AssertionError(f"{where}: no {exc.__name__} raised")


def still_correct(rng):
    """After a refused call the library still computes right (no state was corrupted)."""
    w, x = random_weight(QType.Q8_0, 9, 64, rng), f32(rng, 3, 64)
    np.testing.assert_array_equal(kernels.matmul(QType.Q8_0, w, x), twins.matmul(QType.Q8_0, w, x))


@pytest.mark.parametrize("cases", [matmul_cases, op_cases, moe_cases], ids=lambda f: f.__name__)
@fuzz(40)
@given(data=st.data(), machine=MACHINES, seed=SEEDS)
def test_invalid_arguments_raise_clear_errors(cases, data, machine, seed):
    use(machine)
    rng = np.random.default_rng(seed)
    expect_each(cases(data.draw, rng))
    still_correct(rng)


@fuzz(20)
@given(n=st.integers(-3, 70), cpus=st.one_of(st.none(), st.lists(st.integers(-3, 5000), max_size=70)), seed=SEEDS)
def test_pool_sizes_and_pins_are_clamped(n, cpus, seed):
    """Any thread count is clamped to 1..64 and any CPU list (ids past the CPU set, negative) pins what it can;
    the pool still computes right. The caller's own affinity (pinned as thread 0) is restored after."""
    mask = os.sched_getaffinity(0)
    try:
        got = kernels.set_threads(n, cpus)
        assert got == kernels.get_threads() and 1 <= got <= min(max(n, 1), 64)
        still_correct(np.random.default_rng(seed))
    finally:
        kernels.set_threads(1)
        os.sched_setaffinity(0, mask)


def sprinkle(draw, rng, x: np.ndarray, values=(np.nan, np.inf, -np.inf, 3e38, -3e38)) -> np.ndarray:
    """x with NaN, +inf, -inf or huge values at drawn places."""
    x = x.copy()
    flat = x.reshape(-1)
    for _ in range(draw(st.integers(1, 4))):
        flat[rng.integers(0, flat.size)] = draw(st.sampled_from(values))
    return x


@fuzz(80)
@given(data=st.data(), E=st.integers(1, 8), T=st.integers(1, 6), machine=MACHINES, seed=SEEDS)
def test_non_finite_inputs_stay_in_bounds(data, E, T, machine, seed):
    """NaN and inf activations give NaN/inf results, never a read or write outside the arrays: the router of the
    routed experts picks real experts (NaN probabilities rank last, as in the twin), and every op returns its
    shape."""
    use(machine)
    rng = np.random.default_rng(seed)
    draw = data.draw
    k, q = draw(st.integers(1, E)), draw(st.sampled_from([QType.Q8_0, QType.Q4_K, QType.F16]))
    D = 256
    gate = (q, [random_weight(q, 32 if q == QType.F16 else 256, D, rng) for _ in range(E)])
    down = (q, [random_weight(q, D, 32 if q == QType.F16 else 256, rng) for _ in range(E)])
    x = sprinkle(draw, rng, f32(rng, T, D), (np.nan, np.inf, -np.inf))  # (huge finite sums overflow by order)
    ffn = kernels.MoEFFN(f32(rng, E, D), k, draw(st.booleans()), gate, gate, down)
    assert ffn(x).shape == (T, D)
    with np.errstate(all="ignore"):
        top, _ = ops_numpy.route(x, ffn.router, k, bool(ffn._c.norm_topk))
    np.testing.assert_array_equal(ffn.counts, np.bincount(top.ravel(), minlength=E))
    for qt in (QType.Q8_0, QType.Q4_1, QType.Q6_K, QType.BF16):
        assert kernels.matmul(qt, random_weight(qt, 5, D, rng), x).shape == (T, 5)
    hd, H = draw(st.sampled_from([8, 64])), 4
    qa, kc = sprinkle(draw, rng, f32(rng, T, H, hd)), sprinkle(draw, rng, f32(rng, 2, T + 3, hd))
    with np.errstate(over="ignore"):  # 3e38 is inf in float16
        kv16 = kc.astype(np.float16)
    assert kernels.attention(qa, kc, kv16, T + 1).shape == (T, H, hd)
    assert kernels.rms_norm(x, f32(rng, D), 1e-6).shape == x.shape
    assert kernels.swiglu(x, x[::-1]).shape == x.shape
    assert kernels.gelu_tanh(x).shape == x.shape
    assert kernels.layer_norm(x, f32(rng, D), f32(rng, D)).shape == x.shape
    qkv = sprinkle(draw, rng, f32(rng, T, 3 * H * hd))
    cs = f32(rng, T, hd // 2)
    assert kernels.self_attention(qkv, H, cs, cs).shape == (T, H * hd)
    still_correct(rng)


@functools.lru_cache(maxsize=1)
def tiny_decoder():
    """A two-layer Qwen3-shaped model (Q8_0) bound for the native decoder: (model, NativeDecoder)."""
    from appliance.engine.layer_runner import native_layers
    from tests.native.test_native_decoder import _model
    m = _model("qwen3", ["Q8_0"], np.random.default_rng(5), D=64, H=4, KV=2, hd=16, I=64, L=2, V=17)
    return m, native_layers(m).decoder


@fuzz(50)
@given(data=st.data(), T=st.integers(1, 5), seed=SEEDS)
def test_native_decoder_refuses_mismatched_arrays(data, T, seed):
    """kq_forward reads h, cos/sin, every cache array and every weight at the model's sizes: NativeDecoder
    refuses (ValueError) arrays of other shapes before the call, and a spec whose data does not fill its shape
    at binding; no tokens is an empty result."""
    from appliance.engine import qwen3
    from appliance.engine.layer_runner import layer_specs
    from appliance.native.decoder import NativeDecoder
    draw, rng = data.draw, np.random.default_rng(seed)
    m, dec = tiny_decoder()
    D, hd, KV, L = 64, 16, 2, 16
    cache = m.new_cache(L)
    h, (cos, sin) = f32(rng, T, D), qwen3.rope_cos_sin(np.arange(T), hd, 10000.0)
    assert dec.forward_layers(h[:0], cache, cos[:0], sin[:0]).shape == (0, D)

    def cache_with(i, a):
        c = m.new_cache(L)
        c.k[i] = a
        return c

    def spec_with(name, value):
        specs = layer_specs(m)
        specs[draw(st.integers(0, 1))][name] = value
        return NativeDecoder.from_specs(dec.dims, specs)

    q_data, long = layer_specs(m)[0]["q"], L + draw(SIZES)  # long: more tokens than the cache holds
    cases = [
        lambda: dec.forward_layers(f32(rng, T, off(draw, D)), cache, cos, sin),
        lambda: dec.forward_layers(h[0], cache, cos, sin),
        lambda: dec.forward_layers(h, cache, f32(rng, T, off(draw, hd // 2)), sin),
        lambda: dec.forward_layers(h, cache, cos, f32(rng, off(draw, T), hd // 2)),
        lambda: dec.forward_layers(h, cache_with(draw(st.integers(0, 1)), np.zeros((KV, L - 1, hd), np.float32)),
                                   cos, sin),
        lambda: dec.forward_layers(h, cache_with(0, np.zeros((KV, L, hd), np.float64)), cos, sin),
        lambda: dec.forward_layers(h, cache_with(1, np.zeros((KV, L, hd), np.float32)[:, :, ::-1]), cos, sin),
        lambda: dec.forward_layers(f32(rng, long, D), cache, *qwen3.rope_cos_sin(np.arange(long), hd, 1e4)),
        lambda: spec_with("q", (q_data[0], q_data[1][:-draw(st.integers(1, 8))])),
        lambda: spec_with("attn_norm", f32(rng, off(draw, D))),
        lambda: spec_with("k_norm", f32(rng, off(draw, hd))),
        lambda: spec_with("attn_norm", None),
    ]
    expect_each([(ValueError, call) for call in cases])
    still_correct(rng)


@fuzz(40)
@given(data=st.data(), seed=SEEDS)
def test_the_c_side_refuses_a_weight_whose_bytes_do_not_match_its_shape(data, seed):
    """Python checks every spec first (above); the C side checks again, itself: kq_forward refuses (-1, a
    ValueError) a linear whose (rows, n) is not the model's or whose byte count is not rows x n of its type,
    before anything runs (the cache stays untouched), and kq_moe_ffn an expert matrix whose byte count is not
    its shape's. The specs are bent in their ctypes structs, past the Python checks; set back, both compute
    as before."""
    from appliance.engine import qwen3
    from appliance.native.abi import LINEARS
    draw, rng = data.draw, np.random.default_rng(seed)
    m, dec = tiny_decoder()
    h, (cos, sin) = f32(rng, 1, 64), qwen3.rope_cos_sin(np.arange(1), 16, 10000.0)
    want = dec.forward_layers(h, m.new_cache(16), cos, sin)
    lin = getattr(dec._layers[draw(st.integers(0, 1))], draw(st.sampled_from(LINEARS)))
    field = draw(st.sampled_from(["nbytes", "rows", "n"]))
    saved = getattr(lin, field)
    setattr(lin, field, saved + draw(st.sampled_from([-34, -1, 1, 8, 34, 1 << 20])))
    cache = m.new_cache(16)
    try:
        with pytest.raises(ValueError, match="refused"):
            dec.forward_layers(h, cache, cos, sin)
    finally:
        setattr(lin, field, saved)
    assert not any(a.any() for a in (*cache.k, *cache.v)), "a layer ran before the refusal"
    np.testing.assert_array_equal(dec.forward_layers(h, m.new_cache(16), cos, sin), want)

    q = draw(st.sampled_from([QType.Q8_0, QType.Q4_0, QType.F32]))
    E, D, I = draw(st.integers(1, 3)), 32, 64
    mats = [(q, [random_weight(q, r, c, rng) for _ in range(E)]) for r, c in ((I, D), (I, D), (D, I))]
    router, x = f32(rng, E, D), f32(rng, 2, D)
    ffn = kernels.MoEFFN(router, 1, True, *mats)
    want = ffn(x)
    np.testing.assert_allclose(want, ops_numpy.moe_ffn(x, router, 1, True, *mats), rtol=1e-4, atol=1e-3)
    sizes, e = ffn._sizes[draw(st.integers(0, 2))], draw(st.integers(0, E - 1))
    saved = sizes[e]
    sizes[e] = saved + draw(st.sampled_from([-1, 1, 34, -saved]))
    try:
        with pytest.raises(ValueError, match="refused"):
            ffn(x)
    finally:
        sizes[e] = saved
    np.testing.assert_array_equal(ffn(x), want)
