"""ctypes bindings of the C library (src/*.c), with the same names and argument order as the numpy twins
(twins.py, dequant_numpy.py).

Policy: the library is optional. It is looked up next to this file (built by the package's install) or at
$KESTREL_NATIVE_LIB; KESTREL_NATIVE=0 turns it off. Any failure to load leaves `available()` False and the
callers on their numpy paths. At load the pool gets the default thread plan of cpu_topology (big cores on
big.LITTLE boards, pinned); `set_threads` changes it.
"""
from __future__ import annotations

import ctypes
import operator
import os
from typing import Any

import numpy as np

from . import abi, cpu_topology
from .args import product_out as _product_out, real_array as _f32, weight_rows as _rows, whole_blocks as _whole_blocks
from .library_path import library_candidates
from .qtypes import QType, row_bytes

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_I = ctypes.c_int

_SIGNATURES = {
    "kq_abi_version": (_I, []),
    "kq_struct_size": (_I64, [_I]),
    "kq_simd_level": (_I, []),
    "kq_simd_max": (_I, []),
    "kq_set_simd_level": (_I, [_I]),
    "kq_simd_name": (ctypes.c_char_p, []),
    "kq_set_threads": (_I, [_I, _P, _I]),
    "kq_get_threads": (_I, []),
    "kq_quantize_q8_32": (None, [_P, _I64, _I64, _P]),
    "kq_quantize_q8_K": (None, [_P, _I64, _I64, _P]),
    "kq_dequantize": (_I, [_I, _P, _I64, _I64, _P]),
    "kq_get_rows": (_I, [_I, _P, _I64, _P, _I64, _P]),
    "kq_matmul": (_I, [_I, _P, _I64, _I64, _P, _I64, _P]),
    "kq_repack_x8": (_I, [_I, _P, _I64, _I64, _P]),
    "kq_rms_norm": (None, [_P, _P, _I64, _I64, ctypes.c_float, _P]),
    "kq_rope": (None, [_P, _I64, _I64, _I64, _P, _P]),
    "kq_swiglu": (None, [_P, _P, _I64, _P]),
    "kq_attention": (_I, [_P, _P, _P, _I64, _I64, _I64, _I64, _I64, _I64, _I, _P]),
    "kq_gated_delta_step": (_I, [_P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _P, _P]),
    "kq_gated_delta_chunked": (_I, [_P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _P, _I64, _P]),
    "kq_causal_conv1d": (_I, [_P, _P, _P, _I64, _I64, _I64, _P]),
    "kq_layer_norm": (None, [_P, _P, _P, _I64, _I64, ctypes.c_float, _P]),
    "kq_gelu_tanh": (None, [_P, _I64, _P]),
    "kq_self_attention": (_I, [_P, _I64, _I64, _I64, _P, _P, _P]),
    "kq_moe_ffn": (_I, [_P, _P, _I64, _P]),
    "kq_forward": (_I, [_P, _P, _P, _I64, _I, _P, _I64, _I64, _P, _P]),
}

_lib: Any = None  # the ctypes.CDLL once loaded (its functions are untyped either way)
load_error: str | None = None


def load(path: str | None = None):
    """(Re)load the library; returns it or None (reason in `load_error`)."""
    global _lib, load_error
    _lib, load_error = None, None
    if os.environ.get("KESTREL_NATIVE", "1") == "0" and path is None:
        load_error = "disabled by KESTREL_NATIVE=0"
        return None
    paths = [path] if path else library_candidates()
    if not paths:
        load_error = "native library not built"
        return None
    try:
        lib = ctypes.CDLL(paths[0])
        for name, (res, args) in _SIGNATURES.items():
            f = getattr(lib, name)
            f.restype, f.argtypes = res, args
        abi.check(lib)
    except (OSError, AttributeError) as e:
        load_error = f"{paths[0]}: {e}"
        return None
    _lib = lib
    n, cpus = cpu_topology.thread_plan()
    set_threads(n, cpus)
    return lib


def available() -> bool:
    return _lib is not None


def simd_name() -> str:
    return _lib.kq_simd_name().decode()


def simd_max() -> int:
    return _lib.kq_simd_max()


def set_simd_level(level: int) -> int:
    """Force a SIMD level (0 scalar, 1 AVX2/NEON, 2 +VNNI/+dotprod), clamped to what the CPU has."""
    return _lib.kq_set_simd_level(level)


def set_threads(n: int, cpus: list[int] | None = None) -> int:
    """Pool size (the calling thread counts as one); pin thread i to cpus[i % len(cpus)] when given."""
    if cpus:
        arr = (ctypes.c_int * len(cpus))(*cpus)
        return _lib.kq_set_threads(int(n), ctypes.cast(arr, _P), len(cpus))
    return _lib.kq_set_threads(int(n), None, 0)


def configure_threads(n: int | None = None) -> int:
    """Apply `--threads N` (None: the default plan): big cores first, pinned, on big.LITTLE boards."""
    count, cpus = cpu_topology.threads_plan_for(n)
    return set_threads(count, cpus)


def get_threads() -> int:
    return _lib.kq_get_threads()


def _ptr(a: np.ndarray) -> int:
    return a.ctypes.data


def _check(rc: int, what: str) -> None:
    """The C side's status: -2 is a failed allocation (MemoryError), any other non-zero a refused shape."""
    if rc == -2:
        raise MemoryError(f"{what}: the native library could not allocate its scratch memory")
    if rc != 0:
        raise ValueError(f"{what}: the native library refused the arguments ({rc})")


def quantize_q8_32(x: np.ndarray) -> np.ndarray:
    from .twins import ACT32
    x = _whole_blocks(_f32(x), 32)
    out = np.empty((x.shape[0], x.shape[1] // 32), ACT32)
    _lib.kq_quantize_q8_32(_ptr(x), x.shape[0], x.shape[1], _ptr(out))
    return out


def quantize_q8_K(x: np.ndarray) -> np.ndarray:
    from .twins import ACT256
    x = _whole_blocks(_f32(x), 256)
    out = np.empty((x.shape[0], x.shape[1] // 256), ACT256)
    _lib.kq_quantize_q8_K(_ptr(x), x.shape[0], x.shape[1], _ptr(out))
    return out


def dequantize(qtype, w: np.ndarray) -> np.ndarray:
    qtype = QType(int(qtype))
    w, n = _rows(qtype, w)
    out = np.empty((w.shape[0], n), np.float32)
    if out.size:
        _check(_lib.kq_dequantize(int(qtype), _ptr(w), w.shape[0], n, _ptr(out)), "dequantize")
    return out


def get_rows(qtype, w: np.ndarray, ids: np.ndarray) -> np.ndarray:
    qtype = QType(int(qtype))
    w, n = _rows(qtype, w)
    ids = np.asarray(ids)
    if ids.size and ids.dtype.kind not in "iu":
        raise TypeError(f"row ids must be integers, got {ids.dtype}")
    ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= w.shape[0]):
        raise IndexError("row id out of range")
    out = np.empty((ids.size, n), np.float32)
    if out.size:
        _check(_lib.kq_get_rows(int(qtype), _ptr(w), n, _ptr(ids), ids.size, _ptr(out)), "get_rows")
    return out


def matmul(qtype, w: np.ndarray, x: np.ndarray) -> np.ndarray:
    qtype = QType(int(qtype))
    w, n = _rows(qtype, w)
    x = _f32(x)
    if x.shape[1] != n:
        raise ValueError(f"input width {x.shape[1]} != weight width {n}")
    out = _product_out(x.shape[0], w.shape[0], n)
    if out.size and n:
        _check(_lib.kq_matmul(int(qtype), _ptr(w), w.shape[0], n, _ptr(x), x.shape[0], _ptr(out)), "matmul")
    return out


X8 = 0x100  # qtype flag of the x8 layout (src/repack.c)


def repack_x8(qtype, w: np.ndarray) -> np.ndarray:
    """Rows of a tensor of one of twins.X8_TYPES (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, IQ4_XS) -> the x8 layout the fastest
    kernels read (twins.repack_x8)."""
    from .twins import X8_TYPES
    qtype = QType(int(qtype))
    w, n = _rows(qtype, w)
    if qtype not in X8_TYPES:
        raise ValueError(f"{qtype.name} has no x8 layout")
    out = np.empty(((w.shape[0] + 7) // 8, x8_row_bytes(qtype, n)), np.uint8)
    if out.size:
        _check(_lib.kq_repack_x8(int(qtype), _ptr(w), w.shape[0], n, _ptr(out)), "repack_x8")
    return out


def x8_row_bytes(qtype: QType, n: int) -> int:
    """Bytes of one group of 8 rows of length n in the x8 layout."""
    if qtype in (QType.Q4_K, QType.Q5_K):  # super-blocks of 144 / 176 bytes -> groups of 1184 / 1440
        return row_bytes(qtype, n) // 144 * 1184 if qtype == QType.Q4_K else row_bytes(qtype, n) // 176 * 1440
    if qtype == QType.IQ4_XS:  # super-blocks of 136 bytes -> groups of 1104
        return row_bytes(qtype, n) // 136 * 1104
    return row_bytes(qtype, n) * 8


def _check_x8(qtype: QType, w8, rows: int, n: int) -> None:
    """w8 must be repack_x8's result for `rows` rows of length n: a contiguous uint8 (groups of 8, bytes)."""
    from .twins import X8_TYPES
    if qtype not in X8_TYPES:
        raise ValueError(f"{qtype.name} has no x8 layout")
    if rows < 0 or not isinstance(w8, np.ndarray) or w8.dtype != np.uint8 or not w8.flags.c_contiguous \
            or w8.shape != ((rows + 7) // 8, x8_row_bytes(qtype, n)):
        raise ValueError("x8 weights do not match the rows and input width (a contiguous uint8 repack_x8 result)")


def matmul_x8(qtype, w8: np.ndarray, rows: int, x: np.ndarray) -> np.ndarray:
    qtype = QType(int(qtype))
    x = _f32(x)
    n, rows = x.shape[1], operator.index(rows)
    _check_x8(qtype, w8, rows, n)
    out = _product_out(x.shape[0], rows, n)
    if out.size and n:
        _check(_lib.kq_matmul(int(qtype) | X8, _ptr(w8), rows, n, _ptr(x), x.shape[0], _ptr(out)), "matmul_x8")
    return out


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    x, w = _f32(x), _f32(w, 1)
    if w.shape != (x.shape[1],):
        raise ValueError(f"rms_norm weight of shape {w.shape} does not match the input width {x.shape[1]}")
    out = np.empty_like(x)
    _lib.kq_rms_norm(_ptr(x), _ptr(w), x.shape[0], x.shape[1], float(eps), _ptr(out))
    return out


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    out = np.array(_f32(x, 3), order="C")  # (T, nh, hd), a copy rotated in place
    cos, sin = _f32(cos), _f32(sin)  # (T, hd/2)
    T, nh, hd = out.shape
    if hd % 2 or cos.shape != (T, hd // 2) or sin.shape != cos.shape:
        raise ValueError(f"rope needs an even head size and cos/sin of shape ({T}, hd/2); got x {out.shape}, "
                         f"cos {cos.shape}, sin {sin.shape}")
    _lib.kq_rope(_ptr(out), T, nh, hd, _ptr(cos), _ptr(sin))
    return out


def swiglu(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    g, u = (_f32(a, np.ndim(a)) for a in (g, u))
    if g.shape != u.shape:
        raise ValueError(f"swiglu operands differ in shape: {g.shape} and {u.shape}")
    out = np.empty_like(g)
    _lib.kq_swiglu(_ptr(g), _ptr(u), g.size, _ptr(out))
    return out


def attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, S: int) -> np.ndarray:
    q = _f32(q, 3)  # (T, H, hd)
    k_cache, v_cache = np.asarray(k_cache), np.asarray(v_cache)
    kv = np.float16 if k_cache.dtype == np.float16 and v_cache.dtype == np.float16 else np.float32
    k_cache, v_cache = (_f32(a, 3, kv) for a in (k_cache, v_cache))  # read as stored
    T, H, hd = q.shape  # caches (KV, max_len, hd)
    KV, S = k_cache.shape[0], operator.index(S)
    if v_cache.shape != k_cache.shape or k_cache.shape[2] != hd or not 0 < KV <= H or H % KV or hd < 1:
        raise ValueError(f"attention needs caches (KV, max_len, {hd}) with KV dividing {H} heads; got "
                         f"{k_cache.shape} and {v_cache.shape}")
    if not 0 < T <= S <= k_cache.shape[1]:
        raise ValueError("attention needs 0 < T <= S <= cache length")
    out = np.empty_like(q)
    _check(_lib.kq_attention(_ptr(q), _ptr(k_cache), _ptr(v_cache), k_cache.shape[1], T, S, H, k_cache.shape[0],
                             hd, int(kv == np.float16), _ptr(out)), "attention")
    return out


def _delta_args(q, k, v, g, beta, state):
    """The delta rule's operands checked: q, k (T, nh, dk), v (T, nh, dv), g, beta (T, nh) as float32 copies or
    views; state (nh, dk, dv) must already be a C-contiguous float32 array (it is updated in place)."""
    q, k, v = (_f32(a, 3) for a in (q, k, v))
    g, beta = _f32(g), _f32(beta)
    T, nh, dk = q.shape
    dv = v.shape[2]
    if k.shape != q.shape or v.shape[:2] != (T, nh) or g.shape != (T, nh) or beta.shape != (T, nh):
        raise ValueError(f"delta rule operands disagree: q {q.shape}, k {k.shape}, v {v.shape}, g {g.shape}, "
                         f"beta {beta.shape}")
    if not (isinstance(state, np.ndarray) and state.dtype == np.float32 and state.flags.c_contiguous
            and state.flags.writeable and state.shape == (nh, dk, dv)):
        raise ValueError(f"delta rule state must be a writable C-contiguous float32 ({nh}, {dk}, {dv}) array")
    return q, k, v, g, beta, (T, nh, dk, dv)


def gated_delta_step(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
                     state: np.ndarray) -> np.ndarray:
    """delta_numpy.gated_delta_step in C: the token loop; state updated in place -> outputs (T, nh, dv)."""
    q, k, v, g, beta, (T, nh, dk, dv) = _delta_args(q, k, v, g, beta, state)
    out = np.empty_like(v)
    _check(_lib.kq_gated_delta_step(_ptr(q), _ptr(k), _ptr(v), _ptr(g), _ptr(beta), T, nh, dk, dv, _ptr(state),
                                    _ptr(out)), "gated_delta_step")
    return out


def gated_delta_chunked(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
                        state: np.ndarray, chunk: int = 64) -> np.ndarray:
    """delta_numpy.gated_delta_chunked in C: per chunk one triangular solve per head, then one state update."""
    q, k, v, g, beta, (T, nh, dk, dv) = _delta_args(q, k, v, g, beta, state)
    chunk = operator.index(chunk)
    if chunk < 1:
        raise ValueError("gated_delta_chunked needs a chunk size of at least 1")
    out = np.empty_like(v)
    _check(_lib.kq_gated_delta_chunked(_ptr(q), _ptr(k), _ptr(v), _ptr(g), _ptr(beta), T, nh, dk, dv, _ptr(state),
                                       chunk, _ptr(out)), "gated_delta_chunked")
    return out


def causal_conv1d(x: np.ndarray, state: np.ndarray, w: np.ndarray) -> np.ndarray:
    """delta_numpy.causal_conv1d in C: x (T, C), state (K-1, C) replaced by the last K-1 inputs, w (C, K) ->
    SiLU(conv) (T, C)."""
    x, w = _f32(x), _f32(w)
    (T, C), K = x.shape, w.shape[1]
    if w.shape[0] != C or K < 1:
        raise ValueError(f"causal_conv1d: kernel {w.shape} does not fit inputs of {C} channels")
    if not (isinstance(state, np.ndarray) and state.dtype == np.float32 and state.flags.c_contiguous
            and state.flags.writeable and state.shape == (K - 1, C)):
        raise ValueError(f"causal_conv1d: state must be a writable C-contiguous float32 ({K - 1}, {C}) array")
    out = np.empty_like(x)
    _check(_lib.kq_causal_conv1d(_ptr(x), _ptr(state), _ptr(w), T, C, K, _ptr(out)), "causal_conv1d")
    return out


def layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    x = _f32(x)  # (T, n)
    w, b = (_f32(a, 1) for a in (w, b))
    if w.shape != (x.shape[1],) or b.shape != w.shape:
        raise ValueError("layer_norm weight/bias do not match the input width")
    out = np.empty_like(x)
    _lib.kq_layer_norm(_ptr(x), _ptr(w), _ptr(b), x.shape[0], x.shape[1], float(eps), _ptr(out))
    return out


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    x = _f32(x, np.ndim(x))
    out = np.empty_like(x)
    _lib.kq_gelu_tanh(_ptr(x), x.size, _ptr(out))
    return out


def self_attention(qkv: np.ndarray, heads: int, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Bidirectional attention over one image: qkv (N, 3*hidden) with 2D RoPE cos/sin (N, hd/2) -> (N, hidden)."""
    qkv, heads = _f32(qkv), operator.index(heads)
    if heads < 1:
        raise ValueError(f"self_attention needs at least one head, got {heads}")
    n, hd = qkv.shape[0], qkv.shape[1] // (3 * heads)
    if qkv.shape[1] != 3 * heads * hd or hd % 2:
        raise ValueError("qkv width is not 3 * heads * an even head size")
    cos, sin = _f32(cos), _f32(sin)
    if cos.shape != (n, hd // 2) or sin.shape != cos.shape:
        raise ValueError("cos/sin must be (N, head_dim/2)")
    out = np.empty((n, heads * hd), np.float32)
    _check(_lib.kq_self_attention(_ptr(qkv), n, heads, hd, _ptr(cos), _ptr(sin), _ptr(out)), "self_attention")
    return out


def bound_matmul(qtype, w: np.ndarray, x8: np.ndarray | None = None):
    """matmul with the weight fixed: returns f(x) for contiguous float32 x (T, n) -> (T, rows), with the
    weight's checks done once (decode calls this a few hundred times per token; a call checks only x's type,
    shape and layout, and converts nothing). With x8 (the repack_x8 of w) the x8 kernels run."""
    qtype = QType(int(qtype))
    w, n = _rows(qtype, w)
    rows, wp, q, f = w.shape[0], w.ctypes.data, int(qtype), _lib.kq_matmul
    if x8 is not None:
        _check_x8(qtype, x8, rows, n)
        w, wp, q = x8, x8.ctypes.data, int(qtype) | X8
    empty = not (rows and n)  # no C call: an empty result, or sums over nothing (0)
    f32 = np.dtype(np.float32)

    def call(x: np.ndarray, _keep=w) -> np.ndarray:  # _keep: the array under wp lives as long as this function
        if type(x) is not np.ndarray or x.dtype != f32 or x.ndim != 2 or x.shape[1] != n or not x.flags.c_contiguous:
            raise ValueError(f"expected a contiguous float32 array (T, {n}), got {getattr(x, 'shape', type(x))}")
        if empty or not x.shape[0]:
            return np.zeros((x.shape[0], rows), np.float32)
        out = np.empty((x.shape[0], rows), np.float32)
        rc = f(q, wp, rows, n, x.ctypes.data, x.shape[0], out.ctypes.data)
        if rc:
            _check(rc, "matmul")
        return out
    return call


load()


class MoEFFN:
    """The routed experts of one MoE layer bound once (kq_moe): `__call__(x (T, hidden)) -> (T, hidden)`.
    gate, up, down: (qtype, per-expert arrays) with each expert's rows (out, row_bytes) or (out, in) in place
    (slices of a stacked tensor or separate tensors). After a call, `counts` (E,) holds the tokens each expert
    got. Twin: ops_numpy.moe_ffn."""

    def __init__(self, router: np.ndarray, top_k: int, norm_topk: bool, gate, up, down):
        self.router = _f32(router)  # (E, hidden)
        E, D = self.router.shape
        top_k = operator.index(top_k)
        if not 0 < top_k <= E:
            raise ValueError("top_k must be in 1..n_experts")
        self._keep = [self.router]
        ptrs, shapes, sizes = [], [], []
        for qtype, mats in (gate, up, down):
            qtype = QType(int(qtype))
            if len(mats) != E:
                raise ValueError(f"{len(mats)} expert matrices for {E} experts")
            rows = []
            for w in mats:
                w, n = _rows(qtype, w)
                rows.append(w)
                shapes.append((w.shape[0], n))
            self._keep += rows
            ptrs.append((_P * E)(*[w.ctypes.data for w in rows]))
            sizes.append((_I64 * E)(*[w.nbytes for w in rows]))
        I = shapes[0][0]
        if any(sh != (I, D) for sh in shapes[:2 * E]) or any(sh != (D, I) for sh in shapes[2 * E:]) or not (I and D):
            raise ValueError("expert matrices do not all have the shapes (inter, hidden) / (hidden, inter), "
                             "both positive")
        self.counts = np.zeros(E, np.int32)
        self.shape = (E, D, I)
        self._ptrs, self._sizes = ptrs, sizes
        self._c = abi.MoE(E, top_k, D, I, int(bool(norm_topk)), int(gate[0]), int(up[0]), int(down[0]),
                       self.router.ctypes.data, ctypes.addressof(ptrs[0]), ctypes.addressof(ptrs[1]),
                       ctypes.addressof(ptrs[2]), self.counts.ctypes.data, ctypes.addressof(sizes[0]),
                       ctypes.addressof(sizes[1]), ctypes.addressof(sizes[2]))

    @property
    def address(self) -> int:
        """The kq_moe struct's address (valid while this object lives)."""
        return ctypes.addressof(self._c)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        x = _f32(x)
        if x.shape[1] != self.shape[1]:
            raise ValueError(f"input width {x.shape[1]} != hidden {self.shape[1]}")
        out = np.empty_like(x)
        if x.shape[0]:
            _check(_lib.kq_moe_ffn(self.address, x.ctypes.data, x.shape[0], out.ctypes.data), "moe_ffn")
        return out


def moe_ffn(x: np.ndarray, router: np.ndarray, top_k: int, norm_topk: bool, gate, up, down) -> np.ndarray:
    return MoEFFN(router, top_k, norm_topk, gate, up, down)(x)
