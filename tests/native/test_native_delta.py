"""The C delta-rule kernels (src/delta.c) against their numpy twins (native/delta_numpy.py): fuzzed shapes,
chunk sizes and decays; the chunked C form equals the C token loop; bad operands are refused, never read."""
import os

import numpy as np
import pytest

from appliance.native import delta_numpy, kernels

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
