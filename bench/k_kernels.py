"""K-format dense product micro-benchmark, A/B between two builds of the kernel library in one process: kq_matmul
over Qwen3-1.7B-shaped matrices (gate/up (6144, 2048), down (2048, 6144), q/o (2048, 2048), k/v (1024, 2048)) of
one weight type, on cold weights (a set of matrices beyond the caches, each read once per pass), in the layout the
engine serves that type in (x8 for twins.X8_TYPES unless --layout row), at T = 1 (decode) and T = --prefill
columns. Libraries A and B run interleaved in rounds; the report is the best round's time per weight pass (one
thread: this thread's CPU time), GB/s of weight bytes at T = 1, integer Gop/s (2 per weight and column) at T > 1, and the B/A time ratio (below
1: B is faster), so a shared, loaded machine moves both sides alike. --layout row-x8 runs A on the row layout and B on
the x8 layout of the same matrices (one library may be both: --a L --b L), the layout change alone.

    python bench/k_kernels.py --a /tmp/base.so --b appliance/native/_kestrel_native.so [--types q5_k,q6_k]
        [--threads 1] [--prefill 64] [--rounds 7] [--mb 192] [--layout auto|row|row-x8]
"""
from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from appliance.native import abi, kernels, twins
from appliance.native.qtypes import QType
from bench.gguf_bench import random_blocks

_P, _I64 = ctypes.c_void_p, ctypes.c_int64
SHAPES = [(6144, 2048), (6144, 2048), (2048, 6144), (2048, 2048), (1024, 2048), (1024, 2048), (2048, 2048)]


def open_lib(path: str):
    lib = ctypes.CDLL(os.path.abspath(path))
    lib.kq_matmul.restype, lib.kq_matmul.argtypes = ctypes.c_int, [ctypes.c_int, _P, _I64, _I64, _P, _I64, _P]
    lib.kq_set_threads.restype, lib.kq_set_threads.argtypes = ctypes.c_int, [ctypes.c_int, _P, ctypes.c_int]
    abi.check(lib)
    return lib


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", required=True, help="library A (the baseline)")
    ap.add_argument("--b", required=True, help="library B")
    ap.add_argument("--types", default="q5_k,q6_k")
    ap.add_argument("--threads", default="1")
    ap.add_argument("--prefill", default="64", help="column counts of the multi-column passes (comma-separated)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--mb", type=int, default=192, help="weight bytes per type (beyond the caches)")
    ap.add_argument("--layout", default="auto", choices=["auto", "row", "row-x8"])
    a = ap.parse_args(argv)
    libs = {"A": open_lib(a.a), "B": open_lib(a.b)}
    rng = np.random.default_rng(0)
    print(f"load average {os.getloadavg()[0]:.2f}; A={a.a} B={a.b}", flush=True)
    print(f"{'type':7}{'lay':>4}{'thr':>4}{'T':>5}{'A ms':>9}{'B ms':>9}{'B/A':>7}{'A rate':>9}{'B rate':>9}", flush=True)
    for name in a.types.split(","):
        q = QType[name.upper()]
        x8 = {"A": a.layout == "auto" and q in twins.X8_TYPES,
              "B": a.layout in ("auto", "row-x8") and q in twins.X8_TYPES}
        mats = []  # (rows, {side: the matrix in that side's layout}, n)
        while sum(m[1]["A"].nbytes for m in mats) < a.mb << 20:
            rows, n = SHAPES[len(mats) % len(SHAPES)]
            w = random_blocks(rng, q.name, rows, n)
            w8 = kernels.repack_x8(q, w) if x8["A"] or x8["B"] else None
            mats.append((rows, {k: w8 if x8[k] else w for k in x8}, n))
        qt = {k: int(q) | (kernels.X8 if x8[k] else 0) for k in x8}
        nbytes = sum(m[1]["A"].nbytes for m in mats)
        for nthr in (int(t) for t in a.threads.split(",")):
            for lib in libs.values():
                lib.kq_set_threads(nthr, None, 0)
            clock = time.thread_time if nthr == 1 else time.perf_counter
            for T in [1] + [int(t) for t in a.prefill.split(",")]:
                xs = {n: (rng.standard_normal((T, n)) * 0.5).astype(np.float32) for n in {m[2] for m in mats}}
                outs = [np.empty((T, m[0]), np.float32) for m in mats]
                passes = max(1, 6 // T) if T > 1 else 6

                def run(key):
                    lib = libs[key]
                    t0 = clock()
                    for _ in range(passes):
                        for (rows, w, n), o in zip(mats, outs):
                            lib.kq_matmul(qt[key], w[key].ctypes.data, rows, n, xs[n].ctypes.data, T, o.ctypes.data)
                    return (clock() - t0) / passes

                times = {"A": [], "B": []}
                for r in range(a.rounds):
                    for key in ("A", "B") if r % 2 == 0 else ("B", "A"):
                        times[key].append(run(key))
                ta, tb = min(times["A"]), min(times["B"])
                nw = sum(m[0] * m[2] for m in mats)
                rate = (lambda t: f"{nbytes / t / 1e9:>7.1f}GB") if T == 1 else (
                    lambda t: f"{2 * nw * T / t / 1e9:>7.1f}G")  # GB/s of weights; integer Gop/s (2 per weight)
                lay = "/".join(dict.fromkeys("x8" if x8[k] else "row" for k in x8))
                print(f"{name:7}{lay:>4}{nthr:>4}{T:>5}{ta * 1e3:>9.2f}{tb * 1e3:>9.2f}"
                      f"{tb / ta:>7.3f}{rate(ta):>9}{rate(tb):>9}", flush=True)
    print(f"load average {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
