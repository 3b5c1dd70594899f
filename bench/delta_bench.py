"""The gated delta rule (Qwen3.5's linear-attention layers, src/delta.c) A/B between builds of the kernel library,
with the numpy twins (native/delta_numpy.py) as the reference point measured in the same run: the token loop
(kq_gated_delta_step: decode at T = 1, and the runtime's prefill) and the chunked form (kq_gated_delta_chunked,
chunks of 64) over the Qwen3.5-2B's linear-attention width (16 value heads, dk = dv = 128) at T = 1 and T = 256,
1 and 2 pool threads. Best of 3 rounds of wall time per call; ratios against library A (below 1: faster).
--a76: the token loop's inner loops on the board's cores instead (bench/a76_mca.py: clang for aarch64, llvm-mca's
Neoverse-N1 model for the Cortex-A76 and its Cortex-A55 model), cycles per key row of a 32-column block and per
token and head at dk = dv = --dim.

    python bench/delta_bench.py [--a /tmp/base.so] [--b appliance/native/_kestrel_native.so] [--heads 16] [--a76]
"""
from __future__ import annotations

import argparse
import ctypes
import os
import re
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from appliance.native import delta_numpy  # noqa: E402

_P, _I64 = ctypes.c_void_p, ctypes.c_int64


def load(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(os.path.abspath(path))
    lib.kq_gated_delta_step.argtypes = [_P] * 5 + [_I64] * 4 + [_P, _P]
    lib.kq_gated_delta_chunked.argtypes = [_P] * 5 + [_I64] * 4 + [_P, _I64, _P]
    lib.kq_set_threads.argtypes = [ctypes.c_int, _P, ctypes.c_int]
    return lib


def operands(rng, T: int, nh: int, dk: int, dv: int):
    f = np.float32
    q = (delta_numpy.l2_normalize(rng.standard_normal((T, nh, dk)).astype(f)) * f(dk ** -0.5)).astype(f)
    k = delta_numpy.l2_normalize(rng.standard_normal((T, nh, dk)).astype(f)).astype(f)
    v = rng.standard_normal((T, nh, dv)).astype(f)
    return q, k, v, -rng.uniform(0, 1, (T, nh)).astype(f), rng.uniform(0, 1, (T, nh)).astype(f)


def best_ms(fn, reps: int, rounds: int = 3) -> float:
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best * 1e3


def board_cycles(d: int) -> int:
    """The token loop's two passes over a key row of a 32-column block (S^T k with S^T q; the state update), cut
    from clang's aarch64 assembly of src/delta.c's step_block32, and the cycles of one token and head."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import a76_mca
    src_dir = os.path.join(ROOT, "appliance", "native", "src")
    asm = a76_mca.compile_asm(open(os.path.join(src_dir, "delta.c")).read(), [src_dir], flags=["-ffp-contract=off"])
    loops = a76_mca.innermost_loops(a76_mca.find_function(a76_mca.functions(asm), "step_block32"))
    float_ops = [sum(1 for ln in lp if re.search(r"\bf(?:mul|add|sub)\b", ln)) for lp in loops]
    passes = [lp for lp, n in zip(loops, float_ops) if n >= 24]  # the two passes: 8 vectors of 4 lanes each
    if len(passes) != 2:
        raise SystemExit(f"expected the token loop's two passes in step_block32, found loops with {float_ops} float ops")
    print(f"dk = dv = {d}: 32-column blocks, {d // 32} per head, {d} key rows each")
    for core in ("a76", "a55"):
        per_row = [a76_mca.mca(lp, core).cycles for lp in passes]
        token_head = sum(per_row) * d * (d // 32)
        print(f"{core}: read pass {per_row[0]:.1f} + write pass {per_row[1]:.1f} cycles per key row; "
              f"{token_head / 1e3:.1f}K cycles per token and head (both passes, without the k.q dot)")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", default=None, help="library A (the baseline); default: only B")
    ap.add_argument("--b", default=os.path.join(ROOT, "appliance", "native", "_kestrel_native.so"))
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--a76", action="store_true", help="llvm-mca cycles of the token loop on Cortex-A76 / A55")
    args = ap.parse_args(argv)
    if args.a76:
        return board_cycles(args.dim)
    libs = {"B": load(args.b)} if args.a is None else {"A": load(args.a), "B": load(args.b)}
    nh, d = args.heads, args.dim
    rng = np.random.default_rng(0)
    print(f"{nh} heads, dk = dv = {d}; ms per call (best of 3 rounds); load {os.getloadavg()[0]:.1f}")
    print("| T | threads | form | " + " | ".join(libs) + (" | B/A" if "A" in libs else "") + " | numpy | B/numpy |")
    print("|---|---|---|" + "---|" * (len(libs) + (1 if "A" in libs else 0) + 2))
    for T, reps in ((256, 5), (1, 2000)):
        q, k, v, g, b = operands(rng, T, nh, d, d)
        s0 = rng.standard_normal((nh, d, d)).astype(np.float32)
        for form in ("step", "chunk64") if T > 1 else ("step",):
            s = s0.copy()
            if form == "step":
                np_ms = best_ms(lambda: delta_numpy.gated_delta_step(q, k, v, g, b, s), max(1, reps // 20))
            else:
                np_ms = best_ms(lambda: delta_numpy.gated_delta_chunked(q, k, v, g, b, s, 64), max(1, reps // 5))
            for thr in (1, 2):
                ms = {}
                for name, lib in libs.items():
                    lib.kq_set_threads(thr, None, 0)
                    s, out = s0.copy(), np.empty_like(v)
                    ptrs = [a.ctypes.data for a in (q, k, v, g, b)]
                    if form == "step":
                        call = lambda: lib.kq_gated_delta_step(*ptrs, T, nh, d, d, s.ctypes.data, out.ctypes.data)  # noqa: E731
                    else:
                        call = lambda: lib.kq_gated_delta_chunked(*ptrs, T, nh, d, d, s.ctypes.data, 64,  # noqa: E731
                                                                  out.ctypes.data)
                    ms[name] = best_ms(call, reps)
                row = [str(T), str(thr), form] + [f"{ms[n]:.3f}" for n in libs]
                if "A" in libs:
                    row.append(f"{ms['B'] / ms['A']:.2f}")
                row += [f"{np_ms:.3f}", f"{ms['B'] / np_ms:.2f}"]
                print("| " + " | ".join(row) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
