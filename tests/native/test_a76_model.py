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
    # the float tiles: one pass of 4 rows x 6 columns (24 FMAs) per k-step, p x V 6 rows x 16 values (GCC's code)
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
