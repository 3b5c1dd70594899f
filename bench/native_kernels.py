"""Kernel micro-benchmark: matrix-vector (decode) and matrix-matrix (prefill) products per weight type on
cold weights (a set larger than the caches, streamed once per pass), for the numpy path of QuantWeight and
the native kernels (the file's row layout and, for Q8_0/Q4_0/Q4_1, the x8 layout), at each thread count.
Decode is reported as GB/s of weight bytes and as a fraction of this machine's copy bandwidth; prefill as
integer/float multiply-add throughput (2 ops per weight per token).

    python bench/native_kernels.py [--rows 4096] [--cols 2048] [--mb 256] [--prefill 64] [--threads 1,2]
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from appliance.engine.quant_weights import QuantWeight
from appliance.native import kernels
from appliance.native.qtypes import BLOCK, QType

_SCALES = {QType.Q8_0: (0,), QType.Q4_0: (0,), QType.Q4_1: (0, 2), QType.Q4_K: (0, 2), QType.Q6_K: (208,)}
X8 = (QType.Q8_0, QType.Q4_0, QType.Q4_1)


def weight_bytes(qtype: QType, rows: int, cols: int, rng) -> np.ndarray:
    """Random block data with sane fp16 scales (speed does not depend on the values otherwise)."""
    bs, nb = BLOCK[qtype]
    if qtype in (QType.F32, QType.F16, QType.BF16):
        x = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
        if qtype == QType.F32:
            return x.view(np.uint8)
        if qtype == QType.F16:
            return x.astype(np.float16).view(np.uint8)
        return (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    b = rng.integers(0, 256, (rows, cols // bs, nb), dtype=np.uint8)
    for off in _SCALES[qtype]:
        b[..., off:off + 2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    return b.reshape(rows, -1)


def best_time(fn, reps: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def copy_bandwidth(nbytes: int = 256 << 20) -> float:
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    return 2 * nbytes / best_time(lambda: np.copyto(dst, src), reps=5) / 1e9  # read + write


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=2048)
    ap.add_argument("--mb", type=int, default=256, help="total weight bytes per type (beyond the caches)")
    ap.add_argument("--prefill", type=int, default=64)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--types", default="Q8_0,Q4_0,Q4_1,Q4_K,Q6_K,BF16,F16,F32")
    ap.add_argument("--no-numpy", action="store_true")
    a = ap.parse_args(argv)
    if not kernels.available():
        raise SystemExit(f"native library not available: {kernels.load_error}")
    rng = np.random.default_rng(0)
    threads = [int(t) for t in a.threads.split(",")]
    bw = copy_bandwidth()
    print(f"simd {kernels.simd_name()}; copy bandwidth {bw:.1f} GB/s (read+write); {a.rows}x{a.cols} matrices, "
          f"~{a.mb} MB per type; prefill {a.prefill} tokens")
    print(f"{'type':6} {'layout':6} {'thr':>3} {'decode GB/s':>11} {'of copy bw':>10} {'prefill GOP/s':>13}")
    for name in a.types.split(","):
        q = QType[name]
        one = weight_bytes(q, a.rows, a.cols, rng)
        ws = [one] + [weight_bytes(q, a.rows, a.cols, rng) for _ in range(max(0, a.mb * 2**20 // one.nbytes - 1))]
        total = sum(w.nbytes for w in ws)
        x1 = rng.standard_normal((1, a.cols)).astype(np.float32)
        xp = rng.standard_normal((a.prefill, a.cols)).astype(np.float32)
        ops = 2.0 * a.rows * a.cols * a.prefill
        layouts = [("rows", ws)] + ([("x8", [kernels.repack_x8(q, w) for w in ws])] if q in X8 else [])
        for lname, data in layouts:
            mm = (lambda w, x: kernels.matmul(q, w, x)) if lname == "rows" else \
                (lambda w, x: kernels.matmul_x8(q, w, a.rows, x))
            for t in threads:
                kernels.set_threads(t)
                dec = total / best_time(lambda: [mm(w, x1) for w in data]) / 1e9
                pre = ops / best_time(lambda: mm(data[0], xp), reps=2) / 1e9
                print(f"{name:6} {lname:6} {t:3d} {dec:11.1f} {dec / bw:10.2f} {pre:13.1f}", flush=True)
        if not a.no_numpy:
            w = QuantWeight(q, (a.rows, a.cols), one, native=False)
            dec = one.nbytes / best_time(lambda: w(x1), reps=1) / 1e9
            pre = ops / best_time(lambda: w(xp), reps=1) / 1e9
            print(f"{name:6} {'numpy':6} {'-':>3} {dec:11.2f} {dec / bw:10.3f} {pre:13.1f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
