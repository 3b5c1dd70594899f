"""Every C kernel equals its numpy twin: bit-exact for the integer (quantized) paths and the dequantizers,
tight tolerance for the float-weight products; per type, per SIMD level this CPU has, odd sizes, and
thread counts that do not divide the row count.

The library must be built (the package install builds it); KESTREL_NATIVE=0 opts out explicitly.
KESTREL_KERNEL_DRIVER runs them through the test driver instead (scripts/qemu_aarch64_kernels.sh: the
aarch64 build under qemu).
"""
import os

import numpy as np
import pytest

from appliance.native import dequant_numpy, ops_numpy, twins
from appliance.native.qtypes import BLOCK, QType
from tests.support.ggml_blocks import random_weight
from tests.support.kernel_driver import active, kernels_under_test, reload

kernels = kernels_under_test()

if os.environ.get("KESTREL_NATIVE") == "0":
    pytest.skip("native kernels disabled by KESTREL_NATIVE=0", allow_module_level=True)


@pytest.fixture(scope="module", autouse=True)
def lib():
    assert kernels.available(), f"native library not available: {kernels.load_error}"
    yield
    kernels.set_simd_level(kernels.simd_max())
    reload()


LEVELS = list(range(kernels.simd_max() + 1)) if kernels.available() else [0]
FLOAT = [QType.F32, QType.F16, QType.BF16]
INTEGER = [q for q in QType if q not in FLOAT]


def _x(rng, T, n, scale=1.0):
    x = (rng.standard_normal((T, n)) * scale).astype(np.float32)
    x[0, :5] = 0.0  # exact zeros and, below, a block of zeros (scale 0)
    if n >= 64:
        x[-1, 32:64] = 0.0
    return x


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("qtype", INTEGER, ids=lambda t: t.name)
def test_quantized_matmul_is_bit_exact(qtype, level):
    assert kernels.set_simd_level(level) == level
    rng = np.random.default_rng(10 * level + int(qtype))
    bs = BLOCK[qtype][0]
    for rows, nblocks, T in [(1, 1, 1), (5, 3, 1), (37, 2, 7), (9, 5, 3), (6, 2, 13)]:
        n = max(bs, 32) * nblocks
        w = random_weight(qtype, rows, n, rng)
        x = _x(rng, T, n, scale=rng.uniform(0.01, 30))
        got, want = kernels.matmul(qtype, w, x), twins.matmul(qtype, w, x)
        assert got.shape == (T, rows)
        np.testing.assert_array_equal(got, want, err_msg=f"{qtype.name} rows={rows} n={n} T={T}")


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("qtype", [QType.Q8_0, QType.Q4_0, QType.Q5_0, QType.Q5_1, QType.IQ4_NL],
                         ids=lambda t: t.name)
def test_decode_columns_are_bit_exact(qtype, level):
    """The single-column (decode) path walks several blocks per step on the AVX-512 level (Q8_0: 2, Q4_0: 4) and
    then the remaining blocks one by one: every block count around those steps, rows that leave a partial tile,
    and a leftover column after the 4-column passes (each column fetching its rows ahead)."""
    kernels.set_simd_level(level)
    rng = np.random.default_rng(90 + 10 * level + int(qtype))
    for rows, nb, T in [(3, 1, 1), (5, 2, 1), (6, 3, 1), (9, 4, 1), (7, 5, 1), (10, 6, 1), (5, 7, 1), (13, 8, 1),
                        (4, 9, 1), (6, 64, 1), (9, 24, 5), (3, 13, 6)]:
        n = 32 * nb
        w = random_weight(qtype, rows, n, rng)
        x = _x(rng, T, n, scale=rng.uniform(0.01, 30))
        np.testing.assert_array_equal(kernels.matmul(qtype, w, x), twins.matmul(qtype, w, x),
                                      err_msg=f"{qtype.name} rows={rows} n={n} T={T}")


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("qtype", [QType.Q8_0, QType.Q4_0], ids=lambda t: t.name)
def test_decode_columns_exact_past_32_bit_running_totals(qtype, level):
    """The NEON decode columns (matmul_neon_col.inc) keep each row's integer dot running over the whole row and
    take a block's sum as the difference of two totals: rows of extreme values long enough that those totals
    wrap around 32 bits still give every block's exact sum (Q8_0: 127 * y, 6,000 blocks; Q4_0: nibbles 15 * y,
    45,000 blocks)."""
    kernels.set_simd_level(level)
    nb = 6000 if qtype == QType.Q8_0 else 45000
    w = np.zeros((5, nb, 34 if qtype == QType.Q8_0 else 18), np.uint8)
    w[..., 0:2] = np.float16(0.001).reshape(1).view(np.uint8)
    w[..., 2:] = 127 if qtype == QType.Q8_0 else 0xFF
    w[3, :, 2:] = 0x81 if qtype == QType.Q8_0 else 0x0F  # one row of other values: -127, and nibbles 15 / 0
    w = w.reshape(5, -1)
    x = np.ones((1, 32 * nb), np.float32)
    x[0, 1::7] = 0.5
    top = 127 if qtype == QType.Q8_0 else 15
    assert top * twins.quantize_q8_32(x)["q"].astype(np.int64).sum() > 2**31  # row 0's running total wraps
    np.testing.assert_array_equal(kernels.matmul(qtype, w, x), twins.matmul(qtype, w, x))


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("qtype", twins.X8_TYPES, ids=lambda t: t.name)
def test_x8_layout_matmul_is_bit_exact(qtype, level):
    kernels.set_simd_level(level)
    rng = np.random.default_rng(70 + 10 * level + int(qtype))
    for rows, nb, T in [(1, 1, 1), (7, 3, 1), (9, 2, 5), (37, 4, 13), (16, 1, 4), (13, 2, 40)]:  # T = 40: past the AVX2 level's x8iq4_row_t
        n = BLOCK[qtype][0] * nb
        w = random_weight(qtype, rows, n, rng)
        w8 = kernels.repack_x8(qtype, w)
        np.testing.assert_array_equal(w8, twins.repack_x8(qtype, w))
        np.testing.assert_array_equal(twins.unpack_x8(qtype, w8, rows), w)
        x = _x(rng, T, n, scale=rng.uniform(0.01, 30))
        np.testing.assert_array_equal(kernels.matmul_x8(qtype, w8, rows, x), twins.matmul(qtype, w, x),
                                      err_msg=f"{qtype.name} rows={rows} n={n} T={T}")


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("qtype", FLOAT, ids=lambda t: t.name)
def test_float_matmul_matches_twin(qtype, level):
    kernels.set_simd_level(level)
    rng = np.random.default_rng(int(qtype))
    # n not a multiple of 8 too; n past 256 and T past several multi-token tiles; T past several column blocks
    # (matmul.c's cache blocking: 24 columns of 2048 floats a block)
    for rows, n, T in [(1, 1, 1), (5, 13, 2), (37, 67, 5), (6, 256, 1), (9, 600, 13), (4, 1031, 20), (9, 2048, 61)]:
        w = random_weight(qtype, rows, n, rng)
        x = _x(rng, T, n)
        got, want = kernels.matmul(qtype, w, x), twins.matmul(qtype, w, x)
        bound = 1e-6 * n * np.abs(x) @ np.abs(dequant_numpy.dequantize(qtype, w)).T + 1e-30
        assert np.all(np.abs(got - want) <= bound), (qtype.name, rows, n, T)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("qtype", FLOAT, ids=lambda t: t.name)
def test_float_matmul_column_does_not_depend_on_batch(qtype, level):
    """A token's output is the same whether it is computed alone (decode), in a chunk or in a whole prefill
    (a multi-token tile keeps one arithmetic per output: one FMA chain over k), and wherever it falls among the
    column blocks of a long batch (84 columns of 777 floats a block here)."""
    kernels.set_simd_level(level)
    rng = np.random.default_rng(40 + int(qtype))
    w = random_weight(qtype, 11, 777, rng)
    x = _x(rng, 200, 777)
    full = kernels.matmul(qtype, w, x)
    for a, b in [(0, 1), (5, 6), (3, 10), (7, 23), (80, 90), (150, 200)]:
        np.testing.assert_array_equal(kernels.matmul(qtype, w, x[a:b]), full[a:b])


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("kv_dtype", [np.float32, np.float16])
def test_attention_matches_twin_and_rows_do_not_depend_on_chunking(kv_dtype, level):
    """kq_attention (score tiles, online softmax, probability x value tiles reading the cache as stored) equals
    the numpy twin at every SIMD level: head sizes that are whole value slices (64, 128) and not (24, 80: the
    scalar column tail; 40 with 18 rows: NEON's 8-row float16 tile, whose 8-wide slices reach columns 32-39 that
    a token alone (2 rows) takes in its 16-wide tile's last slice), row counts (query heads x tokens) that leave
    every partial tile, keys across blocks of 256; and a query's row is bit-identical whether its token is
    computed alone, in a chunk or in the whole."""
    kernels.set_simd_level(level)
    rng = np.random.default_rng(70 + level)
    for T, S, H, KV, hd in [(1, 1, 2, 1, 64), (1, 300, 4, 2, 128), (7, 530, 6, 2, 80), (3, 11, 5, 5, 24),
                            (11, 700, 8, 2, 64), (2, 257, 14, 2, 128), (9, 300, 4, 2, 40)]:
        L = S + 5
        q = rng.standard_normal((T, H, hd)).astype(np.float32)
        kc, vc = (rng.standard_normal((2, KV, L, hd)) * 2).astype(kv_dtype)
        kc[:, S:], vc[:, S:] = np.nan, np.nan  # past S: never read
        got = kernels.attention(q, kc, vc, S)
        np.testing.assert_allclose(got, ops_numpy.attention(q, kc[:, :S], vc[:, :S], S), rtol=2e-5, atol=2e-5,
                                   err_msg=f"T={T} S={S} H={H} KV={KV} hd={hd}")
        for a, b in [(0, 1), (T - 1, T), (T // 2, T)]:
            np.testing.assert_array_equal(kernels.attention(q[a:b], kc, vc, S - T + b), got[a:b])


@pytest.mark.parametrize("level", LEVELS)
def test_activation_quantizers_are_bit_exact(level):
    kernels.set_simd_level(level)
    rng = np.random.default_rng(3)
    for T, n in [(1, 256), (4, 512)]:
        x = _x(rng, T, n, scale=5.0)
        x[1 % T, 7] = 0.5 * 127 / 127  # ties and extremes
        assert kernels.quantize_q8_32(x).tobytes() == twins.quantize_q8_32(x).tobytes()
        assert kernels.quantize_q8_K(x).tobytes() == twins.quantize_q8_K(x).tobytes()


@pytest.mark.parametrize("level", LEVELS)
def test_activation_rounding_is_half_to_even(level):
    kernels.set_simd_level(level)
    # a block whose scale is exactly 1 (amax 127): values k + 0.5 land on ties
    x = np.zeros((1, 32), np.float32)
    x[0, 0] = 127.0
    x[0, 1:6] = [0.5, 1.5, 2.5, -0.5, -2.5]
    for f in (kernels.quantize_q8_32, twins.quantize_q8_32):
        assert f(x)["q"][0, 0, :6].tolist() == [127, 0, 2, 2, 0, -2]
    x256 = np.zeros((1, 256), np.float32)
    x256[0, :32] = x[0]
    x256[0, 200:203] = [-126.5, 125.5, -3.5]
    for f in (kernels.quantize_q8_K, twins.quantize_q8_K):
        q = f(x256)["q"][0, 0]
        assert q[:6].tolist() == [127, 0, 2, 2, 0, -2] and q[200:203].tolist() == [-126, 126, -4]


@pytest.mark.parametrize("qtype", list(QType), ids=lambda t: t.name)
def test_dequantize_and_get_rows_are_bit_exact(qtype):
    rng = np.random.default_rng(50 + int(qtype))
    n = 2 * max(BLOCK[qtype][0], 32)
    w = random_weight(qtype, 11, n, rng)
    np.testing.assert_array_equal(kernels.dequantize(qtype, w), dequant_numpy.dequantize(qtype, w))
    ids = np.array([10, 0, 3, 3, 7])
    np.testing.assert_array_equal(kernels.get_rows(qtype, w, ids), dequant_numpy.get_rows(qtype, w, ids))


@pytest.mark.parametrize("threads", [1, 2, 3, 5])
def test_thread_pool_splits_odd_row_counts(threads):
    assert kernels.set_threads(threads) == threads
    assert kernels.get_threads() == threads
    rng = np.random.default_rng(threads)
    for qtype in (QType.Q8_0, QType.Q4_K, QType.BF16):
        for rows in (1, 3, 37):
            n = 256
            w = random_weight(qtype, rows, n, rng)
            x = _x(rng, 3, n)
            got = kernels.matmul(qtype, w, x)
            want = twins.matmul(qtype, w, x)
            if qtype == QType.BF16:
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
            else:
                np.testing.assert_array_equal(got, want)
    # the pool survives many back-to-back jobs (decode issues thousands)
    w = random_weight(QType.Q4_0, 13, 64, rng)
    x = _x(rng, 1, 64)
    first = kernels.matmul(QType.Q4_0, w, x)
    for _ in range(300):
        np.testing.assert_array_equal(kernels.matmul(QType.Q4_0, w, x), first)


def test_wrappers_reject_bad_shapes():
    w = random_weight(QType.Q8_0, 4, 64, np.random.default_rng(0))
    with pytest.raises(ValueError):
        kernels.matmul(QType.Q8_0, w, np.zeros((1, 32), np.float32))
    with pytest.raises(IndexError):
        kernels.get_rows(QType.Q8_0, w, np.array([4]))


def test_concurrent_callers_get_correct_results():
    """Two Python threads using the kernels at once (the pool runs one job at a time; the other runs alone)."""
    import threading
    if active():
        pytest.skip("in-process library only (the test driver serves one call at a time)")
    kernels.set_threads(2)
    rng = np.random.default_rng(9)
    w = random_weight(QType.Q4_0, 64, 256, rng)
    xs = [_x(rng, 3, 256) for _ in range(2)]
    want = [twins.matmul(QType.Q4_0, w, x) for x in xs]
    bad = []

    def run(i):
        for _ in range(200):
            if not np.array_equal(kernels.matmul(QType.Q4_0, w, xs[i]), want[i]):
                bad.append(i)

    ts = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not bad
