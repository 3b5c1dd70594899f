"""Runs the kernel library's entry points through appliance/native/driver/kq_driver.c in a subprocess (the aarch64
build under qemu-aarch64: scripts/qemu_aarch64_kernels.sh), behind the ctypes wrappers themselves: DriverLib
stands in for kernels._lib, so kernels.matmul, bound_matmul, MoEFFN... run their own checks and conversions and
only the C call crosses to the driver. Each pointer argument's bytes are copied out of this process by the size
the C side reads (worked out from the call's other arguments, as the C does), the outputs copied back.
Selected by KESTREL_KERNEL_DRIVER='command line of the driver'; kernels_under_test() installs it once."""
from __future__ import annotations

import ctypes
import os
import shlex
import struct
import subprocess
import threading

from appliance.native import abi, kernels
from appliance.native.qtypes import QType, row_bytes

IN, OUT, INOUT = 0, 1, 2
ACT32_BYTES, ACT256_BYTES = 40, 292


def _addr(p) -> int:
    """A pointer argument as the wrappers pass it (an int, None, or a ctypes c_void_p) -> its address (0: NULL)."""
    if p is None:
        return 0
    return int(p.value or 0) if isinstance(p, ctypes.c_void_p) else int(p)


def _f32_bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def _weight_bytes(qtype: int, rows: int, n: int) -> int:
    """Bytes of a (rows, n) weight of this qtype (with the X8 flag: in the x8 layout); 0 for a shape the C side
    refuses before reading (it is not read then)."""
    try:
        q = QType(qtype & 0xff)
        if rows <= 0 or n <= 0:
            return 0
        if qtype & kernels.X8:
            return (rows + 7) // 8 * kernels.x8_row_bytes(q, n)
        return rows * row_bytes(q, n)
    except ValueError:
        return 0


class DriverLib:
    """The ctypes library's entry points (kernels._SIGNATURES' names and argument order) served by the driver."""

    def __init__(self, argv: list[str]):
        self.argv = argv
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.lock = threading.Lock()  # one request and its reply at a time on the pipe

    def _call(self, name: str, scalars, bufs) -> tuple[int, bytes]:
        """bufs: (address, bytes, direction). Returns the status and the bytes after it (a name for kq_simd_name);
        OUT / INOUT buffers are written back to their addresses."""
        bufs = [(_addr(a), max(0, int(n)), d) for a, n, d in bufs]
        head = struct.pack(f"<q{len(name)}sq{len(scalars)}qq", len(name), name.encode(), len(scalars),
                           *[int(v) for v in scalars], len(bufs))
        head += b"".join(struct.pack("<qq", n, d) for _, n, d in bufs)
        payload = b"".join(ctypes.string_at(a, n) for a, n, d in bufs if d != OUT and n)
        assert self.proc.stdin and self.proc.stdout
        with self.lock:
            self.proc.stdin.write(head + payload)
            self.proc.stdin.flush()
            size = self.proc.stdout.read(8)
            if len(size) != 8:
                raise RuntimeError(f"kernel driver exited ({self.proc.wait()}) in {name}")
            (total,) = struct.unpack("<q", size)
            reply = self.proc.stdout.read(total)
        (rc,) = struct.unpack("<q", reply[:8])
        at = 8
        for a, n, d in bufs:
            if d != IN and n:
                ctypes.memmove(a, reply[at:at + n], n)
                at += n
        return rc, reply[at:]

    def _int(self, name: str, *scalars) -> int:
        return self._call(name, scalars, [])[0]

    # configuration
    def kq_abi_version(self): return self._int("kq_abi_version")
    def kq_struct_size(self, i): return self._int("kq_struct_size", i)
    def kq_simd_level(self): return self._int("kq_simd_level")
    def kq_simd_max(self): return self._int("kq_simd_max")
    def kq_set_simd_level(self, level): return self._int("kq_set_simd_level", level)
    def kq_simd_name(self) -> bytes: return self._call("kq_simd_name", [], [])[1]
    def kq_set_threads(self, n, cpus, ncpus): return self._int("kq_set_threads", n)  # never pinned under qemu
    def kq_get_threads(self): return self._int("kq_get_threads")
    def kq_test_fail_alloc(self, n): return self._int("kq_test_fail_alloc", n)

    # products, quantizers, layouts
    def kq_quantize_q8_32(self, x, T, n, out):
        self._call("kq_quantize_q8_32", [T, n], [(x, T * n * 4, IN), (out, T * (n // 32) * ACT32_BYTES, OUT)])

    def kq_quantize_q8_K(self, x, T, n, out):
        self._call("kq_quantize_q8_K", [T, n], [(x, T * n * 4, IN), (out, T * (n // 256) * ACT256_BYTES, OUT)])

    def kq_dequantize(self, qt, w, rows, n, out):
        return self._call("kq_dequantize", [qt, rows, n],
                          [(w, _weight_bytes(qt, rows, n), IN), (out, rows * n * 4, OUT)])[0]

    def kq_get_rows(self, qt, w, n, ids, T, out):
        rows = max(ctypes.cast(_addr(ids), ctypes.POINTER(ctypes.c_int64))[i] for i in range(T)) + 1 if T else 0
        return self._call("kq_get_rows", [qt, n, T], [(w, _weight_bytes(qt, rows, n), IN), (ids, T * 8, IN),
                                                      (out, T * n * 4, OUT)])[0]

    def kq_matmul(self, qt, w, rows, n, x, T, out):
        return self._call("kq_matmul", [qt, rows, n, T], [(w, _weight_bytes(qt, rows, n), IN), (x, T * n * 4, IN),
                                                          (out, T * rows * 4, OUT)])[0]

    def kq_repack_x8(self, qt, w, rows, n, out):
        return self._call("kq_repack_x8", [qt, rows, n], [(w, _weight_bytes(qt, rows, n), IN),
                                                          (out, _weight_bytes(qt | kernels.X8, rows, n), OUT)])[0]

    # decoder operations
    def kq_rms_norm(self, x, w, T, n, eps, out):
        self._call("kq_rms_norm", [T, n, _f32_bits(eps)], [(x, T * n * 4, IN), (w, n * 4, IN), (out, T * n * 4, OUT)])

    def kq_rope(self, x, T, nh, hd, cos, sin):
        self._call("kq_rope", [T, nh, hd], [(x, T * nh * hd * 4, INOUT), (cos, T * (hd // 2) * 4, IN),
                                            (sin, T * (hd // 2) * 4, IN)])

    def kq_swiglu(self, g, u, n, out):
        self._call("kq_swiglu", [n], [(g, n * 4, IN), (u, n * 4, IN), (out, n * 4, OUT)])

    def kq_attention(self, q, kc, vc, max_len, T, S, H, KV, hd, f16, out):
        cache = KV * max_len * hd * (2 if f16 else 4)
        return self._call("kq_attention", [max_len, T, S, H, KV, hd, f16],
                          [(q, T * H * hd * 4, IN), (kc, cache, IN), (vc, cache, IN), (out, T * H * hd * 4, OUT)])[0]

    def _delta(self, name, q, k, v, g, beta, T, nh, dk, dv, state, extra, out):
        return self._call(name, [T, nh, dk, dv, *extra],
                          [(q, T * nh * dk * 4, IN), (k, T * nh * dk * 4, IN), (v, T * nh * dv * 4, IN),
                           (g, T * nh * 4, IN), (beta, T * nh * 4, IN), (state, nh * dk * dv * 4, INOUT),
                           (out, T * nh * dv * 4, OUT)])[0]

    def kq_gated_delta_step(self, q, k, v, g, beta, T, nh, dk, dv, state, out):
        return self._delta("kq_gated_delta_step", q, k, v, g, beta, T, nh, dk, dv, state, [], out)

    def kq_gated_delta_chunked(self, q, k, v, g, beta, T, nh, dk, dv, state, chunk, out):
        return self._delta("kq_gated_delta_chunked", q, k, v, g, beta, T, nh, dk, dv, state, [chunk], out)

    def kq_causal_conv1d(self, x, state, w, T, C, K, out):
        ok = T >= 0 and C >= 0 and K >= 1  # the C side refuses other sizes before reading
        return self._call("kq_causal_conv1d", [T, C, K], [(x, T * C * 4 if ok else 0, IN),
                                                         (state, (K - 1) * C * 4 if ok else 0, INOUT),
                                                         (w, C * K * 4 if ok else 0, IN), (out, T * C * 4 if ok else 0, OUT)])[0]

    # vision operations
    def kq_layer_norm(self, x, w, b, T, n, eps, out):
        self._call("kq_layer_norm", [T, n, _f32_bits(eps)],
                   [(x, T * n * 4, IN), (w, n * 4, IN), (b, n * 4, IN), (out, T * n * 4, OUT)])

    def kq_gelu_tanh(self, x, n, out):
        self._call("kq_gelu_tanh", [n], [(x, n * 4, IN), (out, n * 4, OUT)])

    def kq_self_attention(self, qkv, N, H, hd, cos, sin, out):
        return self._call("kq_self_attention", [N, H, hd],
                          [(qkv, N * 3 * H * hd * 4, IN), (cos, N * (hd // 2) * 4, IN), (sin, N * (hd // 2) * 4, IN),
                           (out, N * H * hd * 4, OUT)])[0]

    def kq_moe_ffn(self, m_addr, x, T, out):
        """The kq_moe struct at m_addr, read here: its router, byte counts and expert matrices travel as buffers."""
        m = abi.MoE.from_address(_addr(m_addr))
        E, D = m.n_experts, m.hidden
        i64s = [ctypes.cast(p, ctypes.POINTER(ctypes.c_int64)) for p in (m.gate_bytes, m.up_bytes, m.down_bytes)]
        ptrs = [ctypes.cast(p, ctypes.POINTER(ctypes.c_void_p)) for p in (m.gate, m.up, m.down)]
        bufs = [(m.router, E * D * 4, IN)] + [(_addr(p), E * 8, IN) for p in (m.gate_bytes, m.up_bytes, m.down_bytes)]
        bufs += [(ptrs[j][e], i64s[j][e], IN) for j in range(3) for e in range(E)]
        if m.counts:
            bufs.append((m.counts, E * 4, OUT))
        bufs += [(x, T * D * 4, IN), (out, T * D * 4, OUT)]
        return self._call("kq_moe_ffn", [E, m.top_k, D, m.inter, m.norm_topk, m.gate_qtype, m.up_qtype,
                                         m.down_qtype, int(bool(m.counts)), T], bufs)[0]


_driver: DriverLib | None = None


def active() -> bool:
    """True when the kernel tests run against the driver ($KESTREL_KERNEL_DRIVER)."""
    return bool(os.environ.get("KESTREL_KERNEL_DRIVER"))


def kernels_under_test():
    """appliance.native.kernels, its library replaced by $KESTREL_KERNEL_DRIVER's driver when that is set (once:
    the driver's ABI version and struct sizes checked as a library's are at load), else the loaded library."""
    global _driver
    if active():
        if _driver is None:
            _driver = DriverLib(shlex.split(os.environ["KESTREL_KERNEL_DRIVER"]))
            abi.check(_driver)
        kernels._lib, kernels.load_error = _driver, None
        _driver.kq_set_threads(1, None, 0)
        _driver.kq_set_simd_level(_driver.kq_simd_max())
    return kernels


def reload():
    """The state a test module leaves: the driver at its best SIMD level and one thread, or the library reloaded."""
    return kernels_under_test() if active() else kernels.load()
