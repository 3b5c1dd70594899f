"""QuantWeight (numpy path and, when built, the native path) against gguf's dequantizer and float matmul."""
import numpy as np
import pytest

from appliance.engine.quant_weights import QuantWeight, half_weight
from appliance.native import kernels
from appliance.native.dequant_numpy import dequantize
from appliance.native.qtypes import BLOCK, QType
from tests.support.ggml_blocks import random_weight, reference_dequantize

ALL = list(QType)
PATHS = [False] + ([True] if kernels.available() else [])


@pytest.mark.parametrize("qtype", ALL, ids=lambda t: t.name)
def test_dequantize_twin_equals_gguf(qtype):
    rng = np.random.default_rng(int(qtype))
    n = 3 * max(BLOCK[qtype][0], 32)
    raw = random_weight(qtype, 7, n, rng)
    np.testing.assert_array_equal(dequantize(qtype, raw), reference_dequantize(qtype, raw))


@pytest.mark.parametrize("native", PATHS, ids=lambda b: "native" if b else "numpy")
@pytest.mark.parametrize("qtype", ALL, ids=lambda t: t.name)
def test_quant_weight_matches_float_reference(qtype, native):
    rng = np.random.default_rng(100 + int(qtype))
    out, n = 37, 2 * 256
    raw = random_weight(qtype, out, n, rng)
    w = QuantWeight(qtype, (out, n), raw, native=native)
    wf = reference_dequantize(qtype, raw)  # (out, n)
    for T in (1, 5):
        x = rng.standard_normal((T, n)).astype(np.float32)
        y = w(x)
        ref = x.astype(np.float64) @ wf.T.astype(np.float64)
        assert y.shape == (T, out) and y.dtype == np.float32
        # quantized activations (native path) cost ~0.5% of the row norm; float paths agree to rounding
        scale = np.abs(x).max() * np.abs(wf).sum(axis=1)[None, :]
        tol = 1e-2 if (native and qtype not in (QType.F32, QType.F16, QType.BF16)) else 1e-5
        assert np.all(np.abs(y - ref) <= tol * scale), qtype
        ids = np.array([0, out - 1, 3, 3])
        np.testing.assert_array_equal(w.rows(ids), wf[ids])


def test_quant_weight_rejects_bad_input():
    raw = random_weight(QType.Q8_0, 4, 64, np.random.default_rng(0))
    with pytest.raises(ValueError, match="needs"):
        QuantWeight(QType.Q8_0, (5, 64), raw)
    with pytest.raises(ValueError, match="multiple of the block size"):
        QuantWeight(QType.Q8_0, (4, 60), raw)
    with pytest.raises(ValueError, match="not supported"):
        QuantWeight(16, (4, 64), raw)  # IQ2_XXS
    w = QuantWeight(QType.Q8_0, (4, 64), raw)
    with pytest.raises(ValueError, match="does not fit"):
        w(np.zeros((1, 32), np.float32))
    with pytest.raises(IndexError):
        w.rows(np.array([4]))


@pytest.mark.parametrize("qtype", [q for q in QType if BLOCK[q][0] > 1], ids=lambda t: t.name)
def test_bad_sizes_are_refused(qtype):
    """A row that is not a whole number of blocks, or data of another size than the shape needs, is a ValueError
    (QuantWeight, and the native wrappers for the rows they are handed)."""
    bs, nbytes = BLOCK[qtype]
    raw = random_weight(qtype, 3, 2 * bs, np.random.default_rng(int(qtype)))
    with pytest.raises(ValueError, match="multiple of the block size"):
        QuantWeight(qtype, (3, 2 * bs - 16), raw)
    with pytest.raises(ValueError, match="needs"):
        QuantWeight(qtype, (3, bs), raw)
    if kernels.available():
        x = np.zeros((1, 2 * bs), np.float32)
        for bad in (raw[:, :-1], raw[:, : nbytes + 1]):
            with pytest.raises(ValueError, match="whole number of blocks"):
                kernels.matmul(qtype, bad, x)
            with pytest.raises(ValueError, match="whole number of blocks"):
                kernels.dequantize(qtype, bad)


def test_half_weight_serves_bf16_bits_in_place():
    rng = np.random.default_rng(1)
    bits = rng.integers(0x3c00, 0x3f80, (6, 64), dtype=np.uint16)  # bf16 in [2^-7, 1)
    w = half_weight(bits, "BF16")
    assert np.shares_memory(w.raw, bits)
    wf = (bits.astype(np.uint32) << 16).view(np.float32)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    np.testing.assert_allclose(w(x), x @ wf.T, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not kernels.available(), reason="needs the native library (built by the package install)")
@pytest.mark.parametrize("qtype", [QType.Q8_0, QType.Q4_0, QType.Q4_1], ids=lambda t: t.name)
def test_products_use_the_x8_layout_lookups_do_not(qtype):
    rng = np.random.default_rng(5)
    raw = random_weight(qtype, 13, 64, rng)
    w = QuantWeight(qtype, (13, 64), raw)
    w.rows(np.array([1, 2]))
    assert w._x8 is None  # an embedding table that is only looked up is never rearranged
    x = rng.standard_normal((3, 64)).astype(np.float32)
    y = w(x)
    assert w._x8 is not None and w._x8.nbytes == 16 * raw.shape[1]  # 2 groups of 8 rows, same bytes per row
    np.testing.assert_array_equal(y, kernels.matmul(qtype, raw, x))  # same arithmetic as the file's layout
