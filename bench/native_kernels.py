"""Kernel micro-benchmark: matrix-vector (decode) and matrix-matrix (prefill) products per weight type,
native library (1..N threads) against the numpy path of QuantWeight, as GB/s of weight bytes streamed and
as a fraction of this machine's measured copy bandwidth.

    python bench/native_kernels.py [--rows 8192] [--cols 4096] [--prefill 64] [--threads 1,2]
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from appliance.engine.quant_weights import QuantWeight
from appliance.native import kernels
from appliance.native.qtypes import BLOCK, QType

_SCALES = {QType.Q8_0: (0,), QType.Q4_0: (0,), QType.Q4_1: (0, 2), QType.Q4_K: (0, 2), QType.Q6_K: (208,)}


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


def best_time(fn, min_time=0.3, reps=3) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        n, t0 = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            dt = time.perf_counter() - t0
            if dt >= min_time / reps:
                break
        best = min(best, dt / n)
    return best


def copy_bandwidth(nbytes=512 << 20) -> float:
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    t = best_time(lambda: np.copyto(dst, src), min_time=1.0)
    return 2 * nbytes / t / 1e9  # read + write


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--prefill", type=int, default=64)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--types", default="Q8_0,Q4_0,Q4_1,Q4_K,Q6_K,BF16,F16,F32")
    ap.add_argument("--numpy", action="store_true", help="also time the numpy path (slow)")
    a = ap.parse_args(argv)
    if not kernels.available():
        raise SystemExit(f"native library not available: {kernels.load_error}")
    rng = np.random.default_rng(0)
    threads = [int(t) for t in a.threads.split(",")]
    bw = copy_bandwidth()
    print(f"simd {kernels.simd_name()}; copy bandwidth {bw:.1f} GB/s (read+write)")
    print(f"{'type':6} {'MB':>6} " + " ".join(f"{'mv t' + str(t) + ' GB/s':>12}" for t in threads)
          + " " + " ".join(f"{'mm' + str(a.prefill) + ' t' + str(t) + ' ms':>12}" for t in threads)
          + ("  numpy mv GB/s  numpy mm ms" if a.numpy else ""))
    for name in a.types.split(","):
        q = QType[name]
        raw = weight_bytes(q, a.rows, a.cols, rng)
        mb = raw.nbytes / 1e6
        x1 = rng.standard_normal((1, a.cols)).astype(np.float32)
        xp = rng.standard_normal((a.prefill, a.cols)).astype(np.float32)
        mv, mm = [], []
        for t in threads:
            kernels.set_threads(t)
            mv.append(raw.nbytes / best_time(lambda: kernels.matmul(q, raw, x1)) / 1e9)
            mm.append(best_time(lambda: kernels.matmul(q, raw, xp), reps=2) * 1e3)
        row = f"{name:6} {mb:6.1f} " + " ".join(f"{v:12.1f}" for v in mv) + " " + " ".join(f"{v:12.1f}" for v in mm)
        if a.numpy:
            w = QuantWeight(q, (a.rows, a.cols), raw, native=False)
            row += f"  {raw.nbytes / best_time(lambda: w(x1), reps=1) / 1e9:13.2f}"
            row += f"  {best_time(lambda: w(xp), reps=1) * 1e3:11.1f}"
        print(row, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
