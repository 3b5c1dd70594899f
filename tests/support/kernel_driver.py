"""Runs the kernel entry points through appliance/native/driver/kq_driver.c in a subprocess, with the same
Python interface as appliance.native.kernels, so the kernel tests can check a library built for another
architecture (aarch64 under qemu-aarch64). Selected by KESTREL_KERNEL_DRIVER='command line of the driver'."""
from __future__ import annotations

import os
import shlex
import struct
import subprocess

import numpy as np

from appliance.native import kernels
from appliance.native.qtypes import QType
from appliance.native.twins import ACT32, ACT256

OP_MATMUL, OP_Q8_32, OP_Q8_K, OP_DEQUANT, OP_GET_ROWS, OP_SET_SIMD, OP_SIMD_MAX, OP_SET_THREADS, \
    OP_GET_THREADS, OP_SIMD_NAME, OP_REPACK_X8, OP_ATTENTION = range(1, 13)


class DriverKernels:
    load_error = None

    def __init__(self, argv: list[str]):
        self.argv = argv
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def _call(self, op: int, *ints: int, payload: bytes = b"") -> bytes:
        self.proc.stdin.write(struct.pack(f"<{1 + len(ints)}q", op, *ints) + payload)
        self.proc.stdin.flush()
        head = self.proc.stdout.read(8)
        if len(head) != 8:
            raise RuntimeError(f"kernel driver exited ({self.proc.poll()})")
        (n,) = struct.unpack("<q", head)
        return self.proc.stdout.read(n)

    def _int(self, op: int, *ints: int) -> int:
        return struct.unpack("<q", self._call(op, *ints))[0]

    def available(self) -> bool:
        return self.proc.poll() is None

    def load(self):
        self.set_threads(1)
        self.set_simd_level(self.simd_max())

    def simd_max(self) -> int:
        return self._int(OP_SIMD_MAX)

    def simd_name(self) -> str:
        return self._call(OP_SIMD_NAME).decode()

    def set_simd_level(self, level: int) -> int:
        return self._int(OP_SET_SIMD, level)

    def set_threads(self, n: int, cpus=None) -> int:
        return self._int(OP_SET_THREADS, n)

    def get_threads(self) -> int:
        return self._int(OP_GET_THREADS)

    def quantize_q8_32(self, x):
        x = kernels._f32(x)
        raw = self._call(OP_Q8_32, *x.shape, payload=x.tobytes())
        return np.frombuffer(raw, ACT32).reshape(x.shape[0], -1)

    def quantize_q8_K(self, x):
        x = kernels._f32(x)
        raw = self._call(OP_Q8_K, *x.shape, payload=x.tobytes())
        return np.frombuffer(raw, ACT256).reshape(x.shape[0], -1)

    def dequantize(self, qtype, w):
        qtype = QType(int(qtype))
        w, n = kernels._rows(qtype, w)
        raw = self._call(OP_DEQUANT, int(qtype), w.shape[0], n, w.nbytes, payload=w.tobytes())
        return np.frombuffer(raw, np.float32).reshape(w.shape[0], n)

    def get_rows(self, qtype, w, ids):
        qtype = QType(int(qtype))
        w, n = kernels._rows(qtype, w)
        ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= w.shape[0]):
            raise IndexError("row id out of range")
        raw = self._call(OP_GET_ROWS, int(qtype), w.shape[0], n, w.nbytes, ids.size,
                         payload=w.tobytes() + ids.tobytes())
        return np.frombuffer(raw, np.float32).reshape(ids.size, n)

    def matmul(self, qtype, w, x):
        qtype = QType(int(qtype))
        w, n = kernels._rows(qtype, w)
        x = kernels._f32(x)
        if x.shape[1] != n:
            raise ValueError(f"input width {x.shape[1]} != weight width {n}")
        raw = self._call(OP_MATMUL, int(qtype), w.shape[0], n, x.shape[0], w.nbytes,
                         payload=w.tobytes() + x.tobytes())
        return np.frombuffer(raw, np.float32).reshape(x.shape[0], w.shape[0])

    def attention(self, q, k_cache, v_cache, S):
        q = np.ascontiguousarray(q, dtype=np.float32)  # (T, H, hd)
        kv = np.float16 if k_cache.dtype == np.float16 and v_cache.dtype == np.float16 else np.float32
        k_cache, v_cache = (np.ascontiguousarray(a, dtype=kv) for a in (k_cache, v_cache))  # (KV, L, hd)
        T, H, hd = q.shape
        KV, L = k_cache.shape[:2]
        raw = self._call(OP_ATTENTION, T, S, H, KV, L, hd, int(kv == np.float16),
                         payload=q.tobytes() + k_cache.tobytes() + v_cache.tobytes())
        (rc,) = struct.unpack("<q", raw[:8])
        if rc:
            raise RuntimeError(f"attention failed ({rc})")
        return np.frombuffer(raw[8:], np.float32).reshape(T, H, hd)


def _repack_x8(self, qtype, w):
    qtype = QType(int(qtype))
    w, n = kernels._rows(qtype, w)
    raw = self._call(OP_REPACK_X8, int(qtype), w.shape[0], n, w.nbytes, payload=w.tobytes())
    return np.frombuffer(raw, np.uint8).reshape((w.shape[0] + 7) // 8, -1)


def _matmul_x8(self, qtype, w8, rows, x):
    qtype = QType(int(qtype))
    x = kernels._f32(x)
    raw = self._call(OP_MATMUL, int(qtype) | kernels.X8, rows, x.shape[1], x.shape[0], w8.nbytes,
                     payload=np.ascontiguousarray(w8).tobytes() + x.tobytes())
    return np.frombuffer(raw, np.float32).reshape(x.shape[0], rows)


DriverKernels.repack_x8 = _repack_x8
DriverKernels.matmul_x8 = _matmul_x8


def kernels_under_test():
    """The kernel backend the native tests check: $KESTREL_KERNEL_DRIVER's driver, else the loaded library."""
    cmd = os.environ.get("KESTREL_KERNEL_DRIVER")
    return DriverKernels(shlex.split(cmd)) if cmd else kernels
