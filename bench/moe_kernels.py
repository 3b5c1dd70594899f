"""MoE decode micro-benchmark, A/B between two builds of the kernel library in one process: one routed-experts
call (kq_moe_ffn, T tokens) of a Qwen3-30B-A3B-shaped layer (128 experts, top-8, hidden 2048, inter 768) with a
new random token each call, and the in-place expert products alone (kq_matmul at T=1 over expert-shaped
matrices, gate/up (768, 2048) and down (2048, 768)), on cold weights (all experts of several layers, far beyond
the caches). Library A and B run interleaved in rounds; the report is per-call times (best round; one thread: its CPU time) and the B/A time ratio
(below 1: B is faster), so a shared, loaded machine moves both sides alike.

    python bench/moe_kernels.py --a build/a.so --b appliance/native/_kestrel_native.so [--types q8_0,q4_0]
        [--threads 1,2] [--layers 2] [--rounds 7] [--calls 40] [--tokens 1]
"""
from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from appliance.native import abi, kernels
from appliance.native.qtypes import QType
from bench.gguf_bench import random_blocks

E, K, D, I = 128, 8, 2048, 768
_P, _I64 = ctypes.c_void_p, ctypes.c_int64


def open_lib(path: str):
    lib = ctypes.CDLL(os.path.abspath(path))
    lib.kq_moe_ffn.restype, lib.kq_moe_ffn.argtypes = ctypes.c_int, [_P, _P, _I64, _P]
    lib.kq_matmul.restype, lib.kq_matmul.argtypes = ctypes.c_int, [ctypes.c_int, _P, _I64, _I64, _P, _I64, _P]
    lib.kq_set_threads.restype, lib.kq_set_threads.argtypes = ctypes.c_int, [ctypes.c_int, _P, ctypes.c_int]
    abi.check(lib)
    return lib


def layer(q: QType, rng) -> kernels.MoEFFN:
    """One MoE layer's experts, stacked as GGUF stores them, bound as kq_moe."""
    gate = random_blocks(rng, q.name, E * I, D).reshape(E, I, -1)  # any stored type, sane fp16 scales
    up = random_blocks(rng, q.name, E * I, D).reshape(E, I, -1)
    down = random_blocks(rng, q.name, E * D, I).reshape(E, D, -1)
    router = rng.standard_normal((E, D)).astype(np.float32)
    return kernels.MoEFFN(router, K, True, (q, list(gate)), (q, list(up)), (q, list(down)))


def mapped_layers(path: str) -> list[kernels.MoEFFN]:
    """Every MoE layer of a GGUF file (bench/moe_bench.py's), experts read in place from the file's mapping as the
    engine reads them (page-cache pages, not anonymous memory)."""
    from appliance.engine.load.gguf import open_gguf

    r = open_gguf(path)
    t = {x.name: x for x in r.tensors}
    out = []
    for i in range(10**6):
        if f"blk.{i}.ffn_gate_exps.weight" not in t:
            return out
        q = QType(int(t[f"blk.{i}.ffn_gate_exps.weight"].tensor_type))
        mats = [t[f"blk.{i}.ffn_{k}_exps.weight"].data.view(np.uint8).reshape(E, -1, t[f"blk.{i}.ffn_{k}_exps.weight"].data.shape[-1] * t[f"blk.{i}.ffn_{k}_exps.weight"].data.dtype.itemsize) for k in ("gate", "up", "down")]
        router = np.asarray(t[f"blk.{i}.ffn_gate_inp.weight"].data, np.float32).reshape(E, D)
        out.append(kernels.MoEFFN(router, K, True, *((q, list(m)) for m in mats)))


def timed(fn, calls: int, clock=time.perf_counter) -> float:
    t0 = clock()
    for i in range(calls):
        fn(i)
    return (clock() - t0) / calls


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", required=True, help="library A (the baseline)")
    ap.add_argument("--b", required=True, help="library B (or several, comma-separated: each against A)")
    ap.add_argument("--types", default="q8_0,q4_0")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--what", default="moe,gate,down")
    ap.add_argument("--gguf", default=os.path.expanduser("~/.cache/kestrel-bench/random-qwen3-30b-a3b-4l-{type}.gguf"),
                    help="read the experts in place from this file (bench/moe_bench.py's); '' for random arrays")
    a = ap.parse_args(argv)
    names = ["A"] + [f"B{i}" if "," in a.b else "B" for i, _ in enumerate(a.b.split(","))]
    libs = dict(zip(names, [open_lib(p) for p in [a.a, *a.b.split(",")]]))
    rng = np.random.default_rng(0)
    print(f"load average {os.getloadavg()[0]:.2f}; A={a.a} B={a.b}; {a.layers} layers of {E} experts, "
          f"top-{K}, T={a.tokens}", flush=True)
    print(f"{'type':6}{'thr':>4} {'what':6}{'A ms':>9}" + "".join(f"{k + ' ms':>9}{k + '/A':>7}" for k in names[1:])
          + f"  {'A GB/s':>7}", flush=True)
    for name in a.types.split(","):
        q = QType[name.upper()]
        path = a.gguf.format(type=name)
        layers = mapped_layers(path) if a.gguf else [layer(q, rng) for _ in range(a.layers)]
        for f in layers:  # page the mapping in: the engine's steady state
            for w in f._keep[1:]:
                w.sum()
        xs = [rng.standard_normal((a.tokens, D)).astype(np.float32) for _ in range(64)]
        out = np.empty((a.tokens, D), np.float32)
        rb_gate = layers[0]._keep[1].shape[-1]  # row bytes of a gate matrix (768, 2048)
        rb_down = layers[0]._keep[1 + 2 * E].shape[-1]
        gates = [w for f in layers for w in f._keep[1:1 + 2 * E]]  # gate and up matrices, in place
        downs = [w for f in layers for w in f._keep[1 + 2 * E:]]
        x1, xd = np.ones((1, D), np.float32), np.ones((1, I), np.float32)
        o1, od = np.empty((1, I), np.float32), np.empty((1, D), np.float32)
        order, order_d = rng.permutation(len(gates)), rng.permutation(len(downs))

        def moe(lib):
            return lambda i: lib.kq_moe_ffn(layers[i % len(layers)].address, xs[i % len(xs)].ctypes.data,
                                            a.tokens, out.ctypes.data)

        def gate(lib):
            return lambda i: lib.kq_matmul(int(q), gates[order[i % len(gates)]].ctypes.data, I, D,
                                           x1.ctypes.data, 1, o1.ctypes.data)

        def down(lib):
            return lambda i: lib.kq_matmul(int(q), downs[order_d[i % len(downs)]].ctypes.data, D, I,
                                           xd.ctypes.data, 1, od.ctypes.data)

        x8s = []
        if "x8" in a.what:  # the same gate matrices in the x8 layout (the dense weights' path), for reference: all of
            # them, so both sides read the same number of bytes (this CPU's L3 holds 480 MB: 64 matrices would be a
            # cache-resident baseline against in-place experts read from memory)
            x8s = [kernels.repack_x8(q, gates[i]) for i in order]

        def x8(lib):
            return lambda i: lib.kq_matmul(int(q) | kernels.X8, x8s[i % len(x8s)].ctypes.data, I, D,
                                           x1.ctypes.data, 1, o1.ctypes.data)

        head = None
        if "head" in a.what:  # the output matrix (151936, 2048) in the x8 layout: the largest read of a decode step
            from appliance.engine.load.gguf import open_gguf

            t = next(t for t in open_gguf(path).tensors if t.name == "output.weight")
            raw = t.data.view(np.uint8).reshape(int(t.shape[1]), -1)
            head = (raw.shape[0], kernels.repack_x8(q, raw))
            xo = np.empty((1, head[0]), np.float32)

        def head_x8(lib):
            return lambda i: lib.kq_matmul(int(q) | kernels.X8, head[1].ctypes.data, head[0], D, x1.ctypes.data, 1,
                                           xo.ctypes.data)

        per_call = {"moe": a.tokens * K * 3 * I * rb_gate, "gate": I * rb_gate, "down": D * rb_down,
                    "x8": I * rb_gate, "head": head[1].nbytes if head else 0}
        kinds = {"moe": moe, "gate": gate, "down": down, "x8": x8, "head": head_x8}
        for n in (int(t) for t in a.threads.split(",")):
            for lib in libs.values():
                lib.kq_set_threads(n, None, 0)
            # one thread: this thread's CPU time (time the OS gave to others is not counted); two: wall time
            clock = time.thread_time if n == 1 else time.perf_counter
            for what in a.what.split(","):
                calls = a.calls * (1 if what == "moe" else 8) // (20 if what == "head" else 1)
                times = {k: [] for k in names}
                for r in range(a.rounds):
                    for key in (names if r % 2 == 0 else names[::-1]):
                        fn = kinds[what](libs[key])
                        fn(0)
                        times[key].append(timed(fn, calls, clock))
                med = {k: min(v) for k, v in times.items()}  # the least disturbed round
                ta, gb = med["A"], per_call[what] / 1e9
                print(f"{name:6}{n:>4} {what:6}{ta * 1e3:>9.3f}" +
                      "".join(f"{med[k] * 1e3:>9.3f}{med[k] / ta:>7.3f}" for k in names[1:]) + f"  {gb / ta:>7.1f}",
                      flush=True)
    print(f"load average {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
