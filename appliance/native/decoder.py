"""NativeDecoder: the decoder layers of a Qwen3Model (qwen3/qwen2/llama) run by one C call per forward
(src/ops.c kq_forward) instead of a few hundred numpy calls per token.

Policy: built only when every piece is something the C side serves — linear weights that are native
QuantWeights, float32 DenseWeights or HalfWeights; a SwiGLU MLP or mixture-of-experts routed experts bound for
the C side (qwen3_moe.SparseMoE.native_moe: one kq_moe_ffn per layer inside the same call, its counts accounted
after it); float32 or float16 KV caches — otherwise `build` returns None and the caller keeps the numpy forward (vision
hooks, no library).
Numerics: the same C matmuls as QuantWeight, float32 norms/RoPE/attention; equal to qwen3.forward_hidden
within float rounding (tests/test_native_decoder.py).
"""
from __future__ import annotations

import ctypes
import weakref

import numpy as np

from . import kernels
from .qtypes import QType

_P, _I64 = ctypes.c_void_p, ctypes.c_int64
_LINEARS = ("q", "k", "v", "o", "gate", "up", "down")
_KV_TYPES = (np.dtype(np.float32), np.dtype(np.float16))
_VECTORS = ("attn_norm", "mlp_norm", "q_norm", "k_norm", "q_bias", "k_bias", "v_bias")


class _Linear(ctypes.Structure):
    _fields_ = [("qtype", ctypes.c_int32), ("pad", ctypes.c_int32), ("w", _P), ("rows", _I64), ("n", _I64)]


class _Layer(ctypes.Structure):
    _fields_ = [(n, _Linear) for n in _LINEARS] + [(n, _P) for n in _VECTORS] + [("moe", _P)]


class _Model(ctypes.Structure):
    _fields_ = [("n_layers", _I64), ("hidden", _I64), ("n_heads", _I64), ("n_kv", _I64), ("head_dim", _I64),
                ("inter", _I64), ("eps", ctypes.c_float), ("pad", ctypes.c_int32), ("layers", _P)]


def native_linear(w) -> tuple[int, np.ndarray] | None:
    """(qtype, data) for a weight the C kernels read: (rows, row_bytes) blocks, (rows, n) floats, or the x8
    layout (qtype | kernels.X8); None if the C side cannot serve it."""
    from appliance.engine.quant_weights import QuantWeight
    if isinstance(w, QuantWeight):
        if not w.native:
            return None
        x8 = w.x8()
        return (int(w.qtype) | kernels.X8, x8) if x8 is not None else (w.qtype, w.raw)
    arr = getattr(w, "w", None)  # weights.DenseWeight
    if isinstance(arr, np.ndarray) and arr.dtype == np.float32 and arr.ndim == 2 and arr.flags.c_contiguous:
        return QType.F32, arr
    raw, dtype = getattr(w, "raw", None), getattr(w, "dtype", None)  # weights.HalfWeight
    if isinstance(raw, np.ndarray) and dtype in ("BF16", "F16") and raw.ndim == 2 and raw.flags.c_contiguous:
        return (QType.BF16 if dtype == "BF16" else QType.F16), raw
    return None


class NativeDecoder:
    def __init__(self, model, layers: list[dict]):
        c = model.config
        self.norm, self.eps = model.norm, c.rms_norm_eps  # no reference to the model itself: see native_decoder
        self._keep: list[np.ndarray] = []
        arr = (_Layer * len(layers))()
        self._moe = []  # (sparse block, its bound experts): counts are accounted after each forward
        for i, spec in enumerate(layers):
            moe = spec.get("moe")
            if moe is not None:
                block, ffn = moe
                self._moe.append(moe)
                arr[i].moe = ffn.address
            for name in _LINEARS:
                if name not in spec:
                    continue  # an MoE layer's gate/up/down
                qtype, a = spec[name]
                self._keep.append(a)
                shape = spec[name + "_shape"]
                setattr(arr[i], name, _Linear(int(qtype), 0, a.ctypes.data, shape[0], shape[1]))
            for name in _VECTORS:
                v = spec.get(name)
                if v is not None:
                    v = np.ascontiguousarray(v, dtype=np.float32)
                    self._keep.append(v)
                    setattr(arr[i], name, v.ctypes.data)
        self._layers = arr
        self._model = _Model(c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
                             c.head_dim, c.intermediate_size, c.rms_norm_eps, 0, ctypes.addressof(arr))
        self._one = [_Model(1, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                            c.intermediate_size, c.rms_norm_eps, 0, ctypes.addressof(arr) + i * ctypes.sizeof(_Layer))
                     for i in range(len(layers))]  # layer i alone (low-memory mode runs one layer per call)
        self._caches: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @classmethod
    def build(cls, model) -> "NativeDecoder | None":
        """A NativeDecoder for `model` (a qwen3.Qwen3Model), or None if any part is not served natively."""
        if not kernels.available():
            return None
        c = model.config
        specs = []
        for layer in model.layers:
            a, mlp = layer.attn, layer.mlp
            spec: dict = {"attn_norm": layer.attn_norm, "mlp_norm": layer.mlp_norm, "q_norm": a.q_norm,
                          "k_norm": a.k_norm, "q_bias": a.q_bias, "k_bias": a.k_bias, "v_bias": a.v_bias}
            linears = [("q", a.q), ("k", a.k), ("v", a.v), ("o", a.o)]
            native_moe = getattr(mlp, "native_moe", None)  # qwen3_moe.SparseMoE
            if native_moe is not None:
                ffn = native_moe()
                if ffn is None or ffn.shape[1] != c.hidden_size:
                    return None
                spec["moe"] = (mlp, ffn)
            elif all(hasattr(mlp, n) for n in ("gate", "up", "down")) and type(mlp).__name__ == "SwiGLU":
                linears += [("gate", mlp.gate), ("up", mlp.up), ("down", mlp.down)]
            else:
                return None
            for name, w in linears:
                nl = native_linear(w)
                if nl is None:
                    return None
                spec[name], spec[name + "_shape"] = nl, tuple(w.shape)
            if (a.q_norm is None) != (a.k_norm is None) or (a.q_bias is None) != (a.k_bias is None):
                return None
            hd, H, KV, D, I = c.head_dim, c.num_attention_heads, c.num_key_value_heads, c.hidden_size, \
                c.intermediate_size
            want = {"q": (H * hd, D), "k": (KV * hd, D), "v": (KV * hd, D), "o": (D, H * hd),
                    "gate": (I, D), "up": (I, D), "down": (D, I)}
            if any(spec[n + "_shape"] != want[n] for n in want if n in spec):
                return None
            specs.append(spec)
        return cls(model, specs)

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
        if cache.length + T > cache.max_len:
            from appliance.engine.kv_cache import ContextLengthError
            raise ContextLengthError(f"context length {cache.max_len} exceeded")
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
        if rc != 0:
            raise RuntimeError(f"native forward failed ({rc})")
        for block, ffn in self._moe:  # each MoE layer ran once over the T tokens
            block.record(ffn.counts, T)
        return h

    def forward_hidden(self, h: np.ndarray, cache, cos: np.ndarray, sin: np.ndarray,
                       layer_done=None, after_layer=None) -> np.ndarray:
        """Drop-in for qwen3.forward_hidden(model, h, cache, cos, sin, after_layer): commits the T tokens and
        returns the final-normed hidden states (T, hidden)."""
        from appliance.engine.qwen3 import rms_norm
        h = self.forward_layers(h, cache, cos, sin, layer_done, after_layer)
        cache.commit(h.shape[0])
        return rms_norm(h, self.norm, self.eps)


_BUILT: dict[int, tuple[weakref.ref, "NativeDecoder | None"]] = {}


def native_decoder(model) -> "NativeDecoder | None":
    """The NativeDecoder of `model`, built on first use and remembered for the model's lifetime (None when
    the model is not served natively). For qwen3.forward_hidden:

        dec = native_decoder(model) if after_layer is None else None
        if dec is not None:
            return dec.forward_hidden(h, cache, cos, sin)
    """
    entry = _BUILT.get(id(model))
    if entry is not None and entry[0]() is model:
        return entry[1]
    dec = NativeDecoder.build(model)
    key = id(model)
    _BUILT[key] = (weakref.ref(model, lambda _r, k=key: _BUILT.pop(k, None)), dec)
    return dec


def forget(model) -> None:
    """Drop the NativeDecoder built for `model` (its weights changed form, e.g. low-memory mode)."""
    _BUILT.pop(id(model), None)
