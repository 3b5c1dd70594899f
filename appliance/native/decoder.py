"""NativeDecoder: the decoder layers of a Qwen3-family model run by one C call per forward (src/ops.c
kq_forward), or one per layer when a hook runs between layers, instead of a few hundred numpy calls per token.

Policy: native is the floor: this module takes plain numbers, arrays and specs and knows nothing of the
engine's classes. `NativeDecoder.from_specs(dims, layers)` binds the layers when every piece is something
the C side serves — linear weights as (qtype, data) with their shape (the weights' own `native_spec()`), a
SwiGLU MLP or the routed experts of a mixture-of-experts layer bound as kernels.MoEFFN (one kq_moe_ffn per
layer inside the same call; its counts go to the layer's callback after each forward) — otherwise it returns
None and the engine keeps its numpy layers. KV caches must be float32 or float16 and contiguous (`serves`).
Numerics: the same C matmuls as QuantWeight, float32 norms/RoPE/attention; equal to the numpy layers within
float rounding (tests/native/test_native_decoder.py).
"""
from __future__ import annotations

import ctypes
import weakref
from dataclasses import dataclass

import numpy as np

from . import kernels
from .abi import LINEARS as _LINEARS, VECTORS as _VECTORS, Layer as _Layer, Linear as _Linear, Model as _Model
from .qtypes import QType, row_bytes

_P = ctypes.c_void_p
_KV_TYPES = (np.dtype(np.float32), np.dtype(np.float16))


@dataclass(frozen=True)
class DecoderDims:
    n_layers: int
    hidden: int
    n_heads: int
    n_kv: int
    head_dim: int
    inter: int
    eps: float


class NativeDecoder:
    def __init__(self, dims: DecoderDims, layers: list[dict]):
        c = self.dims = dims
        self._keep: list[np.ndarray] = []
        arr = (_Layer * len(layers))()
        self._moe = []  # (bound experts, on_counts(counts, tokens)): called after each forward
        for i, spec in enumerate(layers):
            moe = spec.get("moe")
            if moe is not None:
                ffn, _on_counts = moe
                self._moe.append(moe)
                arr[i].moe = ffn.address
            for name in _LINEARS:
                if name not in spec:
                    continue  # an MoE layer's gate/up/down
                qtype, a = spec[name]
                self._keep.append(a)
                shape = spec[name + "_shape"]
                setattr(arr[i], name, _Linear(int(qtype), 0, a.ctypes.data, shape[0], shape[1], a.nbytes))
            for name in _VECTORS:
                v = spec.get(name)
                if v is not None:
                    v = np.ascontiguousarray(v, dtype=np.float32)
                    self._keep.append(v)
                    setattr(arr[i], name, v.ctypes.data)
        self._layers = arr
        self._model = _Model(c.n_layers, c.hidden, c.n_heads, c.n_kv, c.head_dim, c.inter, c.eps, 0,
                             ctypes.addressof(arr))
        self._one = [_Model(1, c.hidden, c.n_heads, c.n_kv, c.head_dim, c.inter, c.eps, 0,
                            ctypes.addressof(arr) + i * ctypes.sizeof(_Layer))
                     for i in range(len(layers))]  # layer i alone (low-memory mode runs one layer per call)
        self._caches: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @classmethod
    def from_specs(cls, dims: DecoderDims, layers: list[dict]) -> "NativeDecoder | None":
        """A NativeDecoder over `layers` (one dict per layer: the vectors by name (None when absent); q, k, v, o
        and either gate, up, down as (qtype, data) with `name_shape` (out, in), or `moe` = (kernels.MoEFFN,
        on_counts)), or None if the library is missing or any piece is not one the C side serves."""
        if not kernels.available() or len(layers) != dims.n_layers:
            return None
        hd, H, KV, D, I = dims.head_dim, dims.n_heads, dims.n_kv, dims.hidden, dims.inter
        want = {"q": (H * hd, D), "k": (KV * hd, D), "v": (KV * hd, D), "o": (D, H * hd),
                "gate": (I, D), "up": (I, D), "down": (D, I)}
        for spec in layers:
            moe = spec.get("moe")
            needed = _LINEARS[:4] if moe is not None else _LINEARS
            if moe is not None and moe[0].shape[1] != D:
                return None
            if any(spec.get(n) is None for n in needed) or any(spec[n + "_shape"] != want[n] for n in needed):
                return None
            if (spec.get("q_norm") is None) != (spec.get("k_norm") is None) \
                    or (spec.get("q_bias") is None) != (spec.get("k_bias") is None) \
                    or (spec.get("q_bias") is None) != (spec.get("v_bias") is None):
                return None
            _check_sizes(dims, spec, needed)
        return cls(dims, layers)

    def _check_cache(self, cache) -> None:
        """The C side writes layer l's keys/values at (j * max_len + pos) * head_dim: every array must be
        (n_kv, max_len, head_dim), one per layer."""
        c, want = self.dims, (self.dims.n_kv, cache.max_len, self.dims.head_dim)
        if len(cache.k) != c.n_layers or len(cache.v) != c.n_layers \
                or any(a.shape != want for a in (*cache.k, *cache.v)):
            raise ValueError(f"the native decoder needs {c.n_layers} KV cache arrays of shape {want} per side")

    def serves(self, cache) -> bool:
        """Whether this cache is one the C side writes: float32 or float16, contiguous (n_kv, max_len, head_dim)."""
        arrays = (*cache.k, *cache.v)
        return all(a.dtype == arrays[0].dtype and a.dtype in _KV_TYPES and a.flags.c_contiguous for a in arrays)

    def _cache_ptrs(self, cache):
        """Pointer arrays of the cache's layers, kept with the arrays they point into: rebuilt whenever the cache
        holds other arrays than when they were taken (a cache whose arrays were replaced, resized or freed
        would otherwise hand C dangling addresses)."""
        entry = self._caches.get(cache)
        arrays = (*cache.k, *cache.v)
        if entry is None or len(entry[2]) != len(arrays) or any(a is not b for a, b in zip(entry[2], arrays)):
            if not self.serves(cache):
                raise ValueError("the native decoder needs float32 or float16 contiguous KV caches")
            self._check_cache(cache)
            n = len(cache.k)
            entry = ((_P * n)(*[a.ctypes.data for a in cache.k]), (_P * n)(*[a.ctypes.data for a in cache.v]), arrays)
            self._caches[cache] = entry
        return entry[0], entry[1]

    def forward_layers(self, h: np.ndarray, cache, cos: np.ndarray, sin: np.ndarray,
                       layer_done=None, after_layer=None) -> np.ndarray:
        """Run every layer on h (T, hidden) at positions cache.length.. (cos/sin (T, hd/2)); writes the T new
        keys/values into the cache (does not commit them) and returns the last layer's output (T, hidden).
        With layer_done or after_layer, one C call per layer; then h = after_layer(i, h) (the vision-language
        model's DeepStack additions) and layer_done(i) after layer i."""
        h = np.array(h, dtype=np.float32, order="C")  # updated in place by C
        cos, sin = (np.ascontiguousarray(a, dtype=np.float32) for a in (cos, sin))
        T = h.shape[0]
        if h.shape != (T, self.dims.hidden) or cos.shape != (T, self.dims.head_dim // 2) or sin.shape != cos.shape:
            raise ValueError(f"forward_layers needs h (T, {self.dims.hidden}) and cos/sin (T, "
                             f"{self.dims.head_dim // 2}); got {h.shape}, {cos.shape}, {sin.shape}")
        if cache.length + T > cache.max_len:  # the engine checks first; this guards the C writes
            raise ValueError(f"context length {cache.max_len} exceeded")
        if T == 0:
            return h
        kp, vp = self._cache_ptrs(cache)
        f16 = int(cache.k[0].dtype == np.float16)
        if layer_done is None and after_layer is None:
            rc = kernels._lib.kq_forward(ctypes.addressof(self._model), kp, vp, cache.max_len, f16,
                                         h.ctypes.data, T, cache.length, cos.ctypes.data, sin.ctypes.data)
        else:
            size, rc = ctypes.sizeof(_P), 0
            for i, one in enumerate(self._one):
                rc = kernels._lib.kq_forward(ctypes.addressof(one), ctypes.addressof(kp) + i * size,
                                             ctypes.addressof(vp) + i * size, cache.max_len, f16, h.ctypes.data, T,
                                             cache.length, cos.ctypes.data, sin.ctypes.data)
                if rc != 0:
                    break
                if after_layer is not None:
                    out = after_layer(i, h)
                    if out is not h:
                        h[...] = out  # (T, hidden): the C side keeps writing into h
                if layer_done is not None:
                    layer_done(i)
        if rc == -2:  # the first failing status, as kq_forward returns it
            raise MemoryError("native forward: the native library could not allocate its scratch memory")
        if rc == -1:  # checked here first: a spec or size the C side's own checks refuse
            raise ValueError("native forward: the native library refused the layers' specs or sizes (-1)")
        if rc != 0:
            raise RuntimeError(f"native forward failed ({rc})")
        for ffn, on_counts in self._moe:  # each MoE layer ran once over the T tokens
            on_counts(ffn.counts, T)
        return h


def _check_sizes(dims: DecoderDims, spec: dict, linears) -> None:
    """The C side reads every weight and vector whole at the model's sizes: a short array would be read past
    its end, so a spec whose data does not fill its shape is refused (ValueError)."""
    hd, H, KV, D = dims.head_dim, dims.n_heads, dims.n_kv, dims.hidden
    if not (D > 0 and hd > 0 and hd % 2 == 0 and 0 < KV <= H and H % KV == 0):
        raise ValueError(f"decoder sizes not served: {dims}")
    for name in linears:
        qtype, data = spec[name]
        rows, n = spec[name + "_shape"]
        q = QType(int(qtype) & ~kernels.X8)
        need = ((rows + 7) // 8 * kernels.x8_row_bytes(q, n)) if int(qtype) & kernels.X8 else rows * row_bytes(q, n)
        if data.nbytes != need or not data.flags.c_contiguous:
            raise ValueError(f"{name}: {q.name} ({rows}, {n}) needs {need} contiguous bytes, got {data.nbytes}")
    lengths = {"attn_norm": D, "mlp_norm": D, "q_norm": hd, "k_norm": hd, "q_bias": H * hd, "k_bias": KV * hd,
               "v_bias": KV * hd}
    for name, n in lengths.items():
        v = spec.get(name)
        if v is None and name in ("attn_norm", "mlp_norm"):
            raise ValueError(f"{name} is required")
        if v is not None and np.size(v) != n:
            raise ValueError(f"{name} has {np.size(v)} values, the model needs {n}")
