"""bench/a76_model.py, the off-board cost model of the board: its loop extraction finds the inner loop of known
small functions (compiled C, and inline assembly with numeric labels and `.inst` words), llvm-mca gives it a
positive cycle count on both cores, and every kernel of ours in the model yields one, with the work per iteration
its sdot count says. llama.cpp's kernels are timed too when the peer's source is already unpacked (the bench
fetches it; a test does not download 76 MB). Skipped only without clang or an llvm-mca of LLVM >= 17
(scripts/test.sh installs clang and llvm-19)."""
import os
import shutil
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "bench"))
import a76_float  # noqa: E402
import a76_mca  # noqa: E402
import a76_model  # noqa: E402

if not a76_mca.have_tools():
    pytest.skip("clang / llvm-mca (LLVM >= 17) missing: scripts/test.sh installs clang and llvm-19",
                allow_module_level=True)

SMALL = r"""
#include <arm_neon.h>
#include <stdint.h>
int32_t two_dots(const int8_t *a, const int8_t *b, long n) {
    int32x4_t acc = vdupq_n_s32(0);
#pragma clang loop unroll(disable)
    for (long i = 0; i < n; i++) acc = vdotq_s32(acc, vld1q_s8(a + 16 * i), vld1q_s8(b + 16 * i));
    return vaddvq_s32(acc);
}
void spelled(long n) {
    __asm__ __volatile__("1:\n"
                         ".inst 0x4e829420 // sdot v0.4s, v1.16b, v2.16b\n"
                         ".inst 0x4e829420\n"
                         "subs %x[n], %x[n], #1\n"
                         "bgt 1b\n" : [n] "+r"(n) : : "v0", "cc");
}
"""


@pytest.fixture(scope="module")
def small_funcs():
    return a76_mca.functions(a76_mca.compile_asm(SMALL, []))


def test_extraction_finds_a_compiled_inner_loop(small_funcs):
    loop = a76_mca.pick_loop(a76_mca.find_function(small_funcs, "two_dots"))
    assert a76_mca.dots(loop) == 1
    assert any(ln.startswith(("b.", "cbnz", "cbz")) for ln in loop[-2:])  # ends at the backward branch
    for core in ("a76", "a55"):
        c = a76_mca.mca(loop, core)
        assert 0 < c.rthroughput <= c.cycles < 20
    # the A55 (in order, one 64-bit vector pipe for sdot) is not faster than the A76
    assert a76_mca.mca(loop, "a55").cycles >= a76_mca.mca(loop, "a76").cycles


def test_extraction_reads_inline_assembly_labels_and_inst_words(small_funcs):
    loop = a76_mca.pick_loop(a76_mca.find_function(small_funcs, "spelled"), want_dots=2)
    assert [ln.split()[0] for ln in loop] == ["sdot", "sdot", "subs", "b.gt"]
    assert a76_mca.mca(loop, "a76").cycles > 0


def test_extraction_reads_gcc_assembly():
    """GCC (the board's compiler, --gcc) writes `bne` for `b.ne` and `%function`: the loop is found all the same."""
    if not shutil.which(a76_mca.GCC):
        pytest.skip("no aarch64 GCC (Debian: gcc-aarch64-linux-gnu)")
    funcs = a76_mca.functions(a76_mca.compile_asm(SMALL.split("void spelled")[0], [], gcc=True))
    loop = a76_mca.pick_loop(a76_mca.find_function(funcs, "two_dots"), want_dots=1)
    assert loop[-1].startswith("b.") and a76_mca.mca(loop, "a76").cycles > 0


def test_a_wrong_expectation_fails_loudly(small_funcs):
    with pytest.raises(ValueError, match="expected 3"):
        a76_mca.pick_loop(a76_mca.find_function(small_funcs, "two_dots"), want_dots=3)


@pytest.fixture(scope="module")
def ours():
    return a76_model.measure([k for k in a76_model.KERNELS if k.side == "ours"], None)


def test_every_kernel_of_ours_gets_a_positive_cost(ours):
    res = ours
    assert set(res) == {k for k in a76_model.KERNELS if k.side == "ours"}
    for k, r in res.items():
        assert r["a76"] > 0 and r["a55"] > 0 and r["blocks"] >= 1, k
    by = {k.func: r for k, r in res.items()}
    # the in-place decode columns step over two blocks (matmul_neon_col.inc)
    assert by["mca_dec_q8_0"]["blocks"] == 2 and by["mca_dec_q4_0"]["blocks"] == 2
    # the float tiles: a pass of 4 rows x 6 columns (F32) or 2 rows x 8 (F16, BF16) per k-step, p x V 6 rows x 16
    # values (F32) or 8 x 8 (F16; GCC's code)
    assert all(by[f"mca_pre_{t}"]["blocks"] == 1 for t in ("f32", "f16", "bf16"))
    assert by["mca_pv_f16"]["blocks"] == 1 and by["mca_pv_f32"]["blocks"] == 1


def test_float_multiply_adds_are_counted_by_lanes():
    assert a76_float.float_macs(["fmla\tv0.4s, v1.4s, v2.4s", "fmla\tv3.8h, v4.8h, v5.8h",
                                 "fmla\tv6.4s, v7.4s, v8.s[1]", "fmul\tv9.4s, v9.4s, v1.4s"]) == 16
    assert a76_float.float_macs(["fmul\tv1.4s, v1.4s, v3.4s", "fmul\tv2.4s, v2.4s, v3.4s", "fadd\td0, d0, d1"]) == 8


def test_llama_cpp_kernels_get_a_positive_cost():
    ggml = a76_model.llama_src()  # the peer's sdist from PyPI, unpacked once into ~/.cache/kestrel-bench
    theirs = [k for k in a76_model.KERNELS if k.side != "ours"]
    res = a76_model.measure(theirs, ggml)
    assert set(res) == set(theirs)
    assert all(r["a76"] > 0 and r["a55"] > 0 for r in res.values())


def test_board_prediction_is_bounded_by_bandwidth(ours):
    costs = a76_model.board_costs(ours)
    board = {"bw": 20.0, "ghz": 2.4, "cores": 4}
    p = a76_model.predict(costs, a76_model.QWEN3_1_7B, "Q4_0", "ours", board)
    assert 0 < p["decode"] <= p["bw_limit"] + 1e-9 and p["decode"] <= p["compute_limit"] + 1e-9
    assert 0.9 < p["gb"] < 1.1  # 1.72 G weights at 4.5 bits


# ---- bench/a76_context.py: decode at context ----

BOARD = {"bw": 20.0, "ghz": 2.4, "cores": 4}


def test_kv_bytes_and_the_decode_split_follow_the_shapes():
    import a76_context as ctx
    # Qwen3-1.7B at 32K: 28 layers x K and V x 8 KV heads x 128 x 32768 positions x 2 bytes = 3.76 GB per token
    assert ctx.kv_bytes(a76_model.QWEN3_1_7B, 32768) == 28 * 2 * 8 * 128 * 32768 * 2 == 3_758_096_384
    assert ctx.kv_bytes(a76_model.SMOLLM2_135M, 1024) == 30 * 2 * 3 * 64 * 1024 * 2
    # kq_attention's decode groups on 4 threads: 1.7B 2 query heads a task, 30B-A3B 8, SmolLM2's 3 kept whole (9
    # tasks of 1 would take 3 rounds), a group of 8 on 1 or 2 KV heads cut to give the 4 threads a task each
    assert [ctx.ours_group(h, kv, 4) for h, kv in ((16, 8), (32, 8), (32, 4), (9, 3), (8, 1), (16, 2))] == \
        [2, 4, 8, 3, 2, 4]
    # SmolLM2's 9 tasks on 4 threads: KV heads 1 and 2 span two rounds, read twice once a round overflows the caches
    assert ctx.ours_reads(3, 3, 4, 1 << 10) == 1 and ctx.ours_reads(3, 3, 4, 8 << 20) == 5 / 3


def _synthetic(per_key: float) -> dict:
    c = {"softmax": 0.0, "dot": (per_key, 32, 0.0), "mad": (per_key, 32, 0.0), "soft_max": 0.0, "expf": 0.0}
    for hd, g in ((64, 1), (128, 2), (128, 4), (128, 8)):
        c[("score", hd, g)] = c[("pv", hd, g)] = per_key * g * hd / 32
    return c


def test_attention_rises_with_context_and_is_bounded_by_bandwidth_and_compute():
    import a76_context as ctx
    shape = a76_model.QWEN3_1_7B
    for per_key in (0.01, 200.0):  # bus-bound, compute-bound
        c = _synthetic(per_key)
        for side in ctx.SIDES:
            a = [ctx.attention(c, shape, p, side, BOARD) for p in (1024, 8192, 32768)]
            assert a[0]["s"] < a[1]["s"] < a[2]["s"], side
            for r in a:
                assert r["s"] >= r["bytes"] / 20e9 - 1e-12 and r["s"] >= r["compute_s"] - 1e-12
    # nearly free compute: ours is exactly one read of the cache over the bus
    a = ctx.attention(_synthetic(0.01), shape, 32768, "ours", BOARD)
    assert abs(a["s"] * shape.layers - ctx.kv_bytes(shape, 32768) / 20e9) < 1e-9
    # at 32K the KV read (0.188 s) is most of the token: 1.7B Q4_0 falls from its weight-bound 20.7 tok/s to ~4.2
    w = {(s, "decode", "Q4_0"): 3.0 for s in ("ours", "llama.cpp")}
    d = [ctx.decode_at(_synthetic(0.01), w, shape, "Q4_0", "ours", p, BOARD) for p in ctx.CONTEXTS]
    assert all(x["decode"] <= x["limit"] * (1 + 1e-9) for x in d)
    assert d[0]["decode"] > d[1]["decode"] > d[2]["decode"] > d[3]["decode"]
    assert 4.0 < d[3]["decode"] < 4.4 and d[3]["share"] > 0.99


def test_store_writeback_is_split_off():
    assert a76_mca.split_store_writeback(["str\tq5, [x1], 16", "stp\tx1, x2, [sp, #-16]!", "ldr\tq1, [x1], 16"]) == [
        "str\tq5, [x1]", "add\tx1, x1, #16", "sub\tsp, sp, #16", "stp\tx1, x2, [sp]", "ldr\tq1, [x1], 16"]


def test_attention_kernels_get_costs_that_amortise_over_the_group():
    import a76_context as ctx
    c = ctx.measure(a76_model.llama_src(fetch=False))
    hd = 128
    for kind in ("score", "pv"):
        assert 0 < c[(kind, hd, 2)] < c[(kind, hd, 4)] < c[(kind, hd, 8)]
        # a wider tile widens each f16 key or value vector once for more query rows
        assert c[(kind, hd, 8)] / 8 < c[(kind, hd, 2)] / 2
    assert 0 < c["softmax"] < 50
    if "dot" in c:  # the peer's source was there
        assert c["dot"][1] == c["mad"][1] == 32 and 0 < ctx._call(c["dot"], hd) < ctx._call(c["dot"], 2 * hd)
        assert c["soft_max"] > 0


# ---- bench/a76_vision.py: the vision tower's encode ----

def test_vision_tower_multiply_adds_follow_the_2b_widths():
    import a76_vision as vis
    import vision_bench
    m = vis.tower_macs(vision_bench.SHAPES["2b"]["vision"], 448)
    # 784 patches: the patch embedding 1536 -> 1024, 24 blocks of 12.58 M multiply-adds a patch (qkv 3.15 M, proj
    # 1.05 M, fc1 + fc2 8.39 M), the merger and 3 DeepStack mergers on 196 tokens (4096 -> 4096 -> 2048: 25.2 M)
    assert m["patches"] == 784
    assert m["weights"] == 784 * 1536 * 1024 + 24 * 784 * 12_582_912 + 4 * 196 * 25_165_824 == 257_723_203_584
    assert m["attention"] == 24 * 2 * 784 * 784 * 1024  # scores and probability x value, full attention


def test_vision_encode_is_priced_by_the_mmproj_type():
    import a76_vision as vis
    import vision_bench
    v = vision_bench.SHAPES["2b"]["vision"]
    costs = {(s, "prefill", q): c for s in vis.SIDES for q, c in (("F16", 6.0), ("Q8_0", 2.0), ("F32", 4.0))}
    f16, q8 = (vis.encode_seconds(costs, v, q, "ours", BOARD) for q in ("F16", "Q8_0"))
    assert abs(f16["weights_s"] - 3 * q8["weights_s"]) < 1e-9 and f16["attention_s"] == q8["attention_s"]
    # 257.7 GMAC at 6 cycles per 32 on 4 x 2.4 GHz: 5.03 s
    assert 5.0 < f16["weights_s"] < 5.1


def test_vision_report_prices_our_towers_from_the_kernel_table(ours):
    import a76_vision as vis
    rows = [ln for ln in vis.vision_report(ours, BOARD).splitlines() if ln.startswith("| Qwen3-VL")]
    # our rows for both towers and both mmproj types (llama.cpp's need its source: not measured in `ours`)
    assert len(rows) == 4 and all("| ours |" in r for r in rows)
    secs = [float(r.split("|")[7]) for r in rows]
    assert all(s > 0 for s in secs) and secs[0] > secs[1]  # the 2B's F16 tower slower than its Q8_0 one
