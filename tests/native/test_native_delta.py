"""The C delta-rule kernels (src/delta.c) against their numpy twins (native/delta_numpy.py): fuzzed shapes,
chunk sizes and decays; the chunked C form equals the C token loop; the causal conv1d (one thread, no pool) with
its carried state, for fewer new rows than the state holds too; bad operands are refused, never read.
KESTREL_KERNEL_DRIVER runs them through the test driver (scripts/qemu_aarch64_kernels.sh: the aarch64 build)."""
import os

import numpy as np
import pytest

from appliance.native import delta_numpy
from tests.support.kernel_driver import kernels_under_test

kernels = kernels_under_test()

if os.environ.get("KESTREL_NATIVE") == "0":
    pytest.skip("native kernels disabled by KESTREL_NATIVE=0", allow_module_level=True)


@pytest.fixture(scope="module", autouse=True)
def lib():
    assert kernels.available(), f"native library not available: {kernels.load_error}"


def operands(rng, T, nh, dk, dv, decay=2.0):
    f = np.float32
    q = (delta_numpy.l2_normalize(rng.standard_normal((T, nh, dk)).astype(f)) * f(dk ** -0.5)).astype(f)
    k = delta_numpy.l2_normalize(rng.standard_normal((T, nh, dk)).astype(f)).astype(f)
    v = rng.standard_normal((T, nh, dv)).astype(f)
    g = -rng.uniform(0.0, decay, (T, nh)).astype(f)
    beta = rng.uniform(0.0, 1.0, (T, nh)).astype(f)
    state = rng.standard_normal((nh, dk, dv)).astype(f)
    return q, k, v, g, beta, state


def close(a, b, tol=2e-5):
    return float(np.max(np.abs(a - b), initial=0.0)) <= tol * max(1.0, float(np.max(np.abs(b), initial=0.0)))


def test_fuzzed_shapes_match_the_twins():
    rng = np.random.default_rng(35)
    for _ in range(60):
        T, nh, dk, dv = (int(rng.integers(1, 90)), int(rng.integers(1, 5)), int(rng.integers(1, 20)),
                         int(rng.integers(1, 20)))
        chunk = int(rng.choice([1, 2, 7, 16, 64, 100]))
        q, k, v, g, beta, s0 = operands(rng, T, nh, dk, dv, decay=float(rng.choice([0.01, 1.0, 8.0])))
        s_np, s_c = s0.copy(), s0.copy()
        want = delta_numpy.gated_delta_step(q, k, v, g, beta, s_np)
        got = kernels.gated_delta_step(q, k, v, g, beta, s_c)
        assert close(got, want) and close(s_c, s_np), (T, nh, dk, dv)
        s_np, s_c = s0.copy(), s0.copy()
        want = delta_numpy.gated_delta_chunked(q, k, v, g, beta, s_np, chunk)
        got = kernels.gated_delta_chunked(q, k, v, g, beta, s_c, chunk)
        assert close(got, want, 1e-4) and close(s_c, s_np, 1e-4), (T, nh, dk, dv, chunk)


def test_wide_heads_match_the_twins_and_split_tokens_alike():
    """The token loop's paths at real widths: full 32-column blocks in registers (dv 32, 64, 128), a narrower last
    block (dv 80, 40), key widths past the 32 KB stack block (dk 300: the state in place); and a token's result
    does not depend on how many tokens one call holds (decode == prefill, the verify pass's one-by-one calls)."""
    rng = np.random.default_rng(36)
    for T, nh, dk, dv in [(17, 2, 128, 128), (9, 3, 16, 32), (33, 1, 64, 64), (12, 2, 128, 80), (7, 2, 300, 40),
                          (5, 1, 300, 64), (1, 4, 128, 128)]:
        q, k, v, g, beta, s0 = operands(rng, T, nh, dk, dv)
        s_np, s_c = s0.copy(), s0.copy()
        want = delta_numpy.gated_delta_step(q, k, v, g, beta, s_np)
        got = kernels.gated_delta_step(q, k, v, g, beta, s_c)
        assert close(got, want) and close(s_c, s_np), (T, nh, dk, dv)
        s_one = s0.copy()
        one = np.concatenate([kernels.gated_delta_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1],
                                                       beta[t:t + 1], s_one) for t in range(T)])
        assert np.array_equal(one, got) and np.array_equal(s_one, s_c), (T, nh, dk, dv)
        s_ch = s0.copy()
        got_ch = kernels.gated_delta_chunked(q, k, v, g, beta, s_ch, 8)
        assert close(got_ch, want, 1e-4) and close(s_ch, s_np, 1e-4), (T, nh, dk, dv)


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_kernel_equals_the_token_loop(chunk):
    q, k, v, g, beta, s0 = operands(np.random.default_rng(1), 150, 4, 32, 24)
    s_loop, s_chunk = s0.copy(), s0.copy()
    want = kernels.gated_delta_step(q, k, v, g, beta, s_loop)
    got = kernels.gated_delta_chunked(q, k, v, g, beta, s_chunk, chunk)
    assert close(got, want, 1e-4) and close(s_chunk, s_loop, 1e-4)


def test_bad_operands_are_refused():
    q, k, v, g, beta, s = operands(np.random.default_rng(2), 5, 2, 4, 3)
    with pytest.raises(ValueError, match="disagree"):
        kernels.gated_delta_step(q, k[:4], v, g, beta, s)
    with pytest.raises(ValueError, match="state"):
        kernels.gated_delta_step(q, k, v, g, beta, s.astype(np.float64))
    with pytest.raises(ValueError, match="state"):
        kernels.gated_delta_chunked(q, k, v, g, beta, s[:, :, :2], 4)
    with pytest.raises(ValueError, match="chunk"):
        kernels.gated_delta_chunked(q, k, v, g, beta, s, 0)


def test_fuzzed_causal_conv1d_matches_the_twin():
    """The pre-activation sums run in numpy's order (bit-exact), so the output differs by expf's ulp at most and
    the new state (a copy of inputs) is exact; a sequence fed in pieces equals it fed at once."""
    rng = np.random.default_rng(27)
    sizes = [(int(rng.integers(1, 40)), int(rng.integers(1, 70)), int(rng.integers(1, 6))) for _ in range(80)]
    # Qwen3.5's width (K 4, read in place) at a 2B layer's channels; the other widths go by blocks of 4096 / K
    # channels (several here), and a kernel wider than a block one channel at a time
    for T, C, K in sizes + [(3, 6144, 4), (5, 3000, 3), (2, 2, 5000)]:
        x = (rng.standard_normal((T, C)) * rng.choice([0.1, 1.0, 30.0])).astype(np.float32)
        w = rng.standard_normal((C, K)).astype(np.float32)
        s0 = rng.standard_normal((K - 1, C)).astype(np.float32)
        s_np, s_c = s0.copy(), s0.copy()
        with np.errstate(over="ignore"):  # exp(-out) of a very negative sum: inf, and SiLU -0.0 (expf's too)
            want = delta_numpy.causal_conv1d(x, s_np, w)
        got = kernels.causal_conv1d(x, s_c, w)
        assert np.array_equal(s_c, s_np), (T, C, K)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7, err_msg=str((T, C, K)))
        cut = int(rng.integers(0, T + 1))
        s_parts = s0.copy()
        parts = [kernels.causal_conv1d(x[:cut], s_parts, w) if cut else np.zeros((0, C), np.float32),
                 kernels.causal_conv1d(x[cut:], s_parts, w) if cut < T else np.zeros((0, C), np.float32)]
        assert np.array_equal(np.concatenate(parts), got) and np.array_equal(s_parts, s_np), (T, C, K, cut)


def test_causal_conv1d_refuses_bad_operands():
    x, w, s = np.ones((3, 5), np.float32), np.ones((5, 4), np.float32), np.zeros((3, 5), np.float32)
    with pytest.raises(ValueError, match="kernel"):
        kernels.causal_conv1d(x, s, w[:4])
    with pytest.raises(ValueError, match="kernel"):
        kernels.causal_conv1d(x, np.zeros((0, 5), np.float32), w[:, :0])  # K = 0
    for bad in (s.astype(np.float64), s[:2], s.T.copy(), np.asfortranarray(np.zeros((3, 5), np.float32))[:, ::1][::-1]):
        with pytest.raises(ValueError, match="state"):
            kernels.causal_conv1d(x, bad, w)
    frozen = s.copy()
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="state"):
        kernels.causal_conv1d(x, frozen, w)
    assert kernels._lib.kq_causal_conv1d(None, None, None, -1, 5, 4, None) == -1  # the C side's own checks
    assert kernels._lib.kq_causal_conv1d(None, None, None, 3, 5, 0, None) == -1
