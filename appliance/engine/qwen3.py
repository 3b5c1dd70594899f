"""The Qwen3 decoder (also Qwen2 and Llama, which differ only by config flags): RMSNorm, per-head q/k RMSNorm,
rotary embeddings (rotate-half), grouped-query attention over a KVCache, and a SwiGLU MLP.

Policy: all activations are float32. Weights are called through the objects in weights.py (or quantized
equivalents), the KV cache is passed in, and a layer's MLP is any callable, so the mixture-of-experts block
drops in unchanged. `forward_hidden` is split out so the vision-language model can feed its own embeddings,
positions and per-layer additions (DeepStack).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol

import numpy as np

from appliance.native.ops_numpy import grouped_attention, rms_norm, rotate_half, swiglu

from .config import Qwen3Config
from .kv_cache import KVCache

if TYPE_CHECKING:
    from .weights import Embedding


def rope_cos_sin(positions: np.ndarray, head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))  # (hd/2,)
    ang = positions.astype(np.float64)[:, None] * inv_freq[None, :]  # (T, hd/2)
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE on x (n, T, hd) with cos/sin (T, hd/2)."""
    return rotate_half(x, cos, sin)


class SwiGLU:
    def __init__(self, gate, up, down):
        self.gate, self.up, self.down = gate, up, down

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return self.down(swiglu(self.gate(x), self.up(x)))  # (T, hidden)


@dataclass
class Attention:
    q: Callable
    k: Callable
    v: Callable
    o: Callable
    q_norm: np.ndarray | None = None  # (hd,)
    k_norm: np.ndarray | None = None
    q_bias: np.ndarray | None = None
    k_bias: np.ndarray | None = None
    v_bias: np.ndarray | None = None


@dataclass
class Layer:
    attn_norm: np.ndarray  # (hidden,)
    attn: Attention
    mlp_norm: np.ndarray
    mlp: Callable  # (T, hidden) -> (T, hidden)



class LayerHook(Protocol):
    """Low-memory mode's hook (resident.LayerStreaming): called after layer i ran."""

    def layer_done(self, i: int) -> None: ...


class LayerRunner(Protocol):
    """The decoder layers in other code (layer_runner.NativeLayers: C), chosen at load."""

    def serves(self, cache: KVCache) -> bool: ...

    def forward_hidden(self, h: np.ndarray, cache: KVCache, cos: np.ndarray, sin: np.ndarray,
                       layer_done: Callable[[int], None] | None = None,
                       after_layer: Callable[[int, np.ndarray], np.ndarray] | None = None) -> np.ndarray: ...


@dataclass
class Qwen3Model:
    config: Qwen3Config
    embed: Embedding  # .rows(ids) -> (T, hidden)
    layers: list[Layer]
    norm: np.ndarray
    lm_head: Callable  # (T, hidden) -> (T, vocab)
    layer_streaming: LayerHook | None = None  # low-memory mode (resident.LayerStreaming): layer_done(i) after layer i
    runner: LayerRunner | None = None  # chosen at load (layer_runner.choose_runner): NativeLayers, or None for the numpy layers
    expert_stats: object = None  # mixture-of-experts models (the loaders): qwen3_moe.ExpertLoadStats, MoEConfig
    moe_config: object = None

    def new_cache(self, max_len: int, dtype=np.float32) -> KVCache:
        c = self.config
        return KVCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, max_len, dtype)

    def forward(self, tokens: np.ndarray, cache: KVCache, logits: str = "last") -> np.ndarray | None:
        return forward(self, tokens, cache, logits)


def attention(cfg: Qwen3Config, a: Attention, x: np.ndarray, cache: KVCache, layer: int,
              cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    T = x.shape[0]
    H, KV, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q, k, v = a.q(x), a.k(x), a.v(x)  # (T, H*hd), (T, KV*hd), (T, KV*hd)
    if a.q_bias is not None:
        q, k, v = q + a.q_bias, k + a.k_bias, v + a.v_bias
    q = q.reshape(T, H, hd)
    k = k.reshape(T, KV, hd)
    if a.q_norm is not None:  # both or neither (config qk_norm)
        q = rms_norm(q, a.q_norm, cfg.rms_norm_eps)
    if a.k_norm is not None:
        k = rms_norm(k, a.k_norm, cfg.rms_norm_eps)
    q = apply_rope(q.transpose(1, 0, 2), cos, sin)  # (H, T, hd)
    k = apply_rope(k.transpose(1, 0, 2), cos, sin)  # (KV, T, hd)
    v = v.reshape(T, KV, hd).transpose(1, 0, 2)  # (KV, T, hd)
    keys, values = cache.update(layer, k, v)  # (KV, S, hd)
    out = grouped_attention(q, keys, values)  # (H, T, hd)
    out = out.transpose(1, 0, 2).reshape(T, H * hd)
    return a.o(out)  # (T, hidden)


def forward_hidden(model: Qwen3Model, h: np.ndarray, cache: KVCache, cos: np.ndarray, sin: np.ndarray,
                   after_layer: Callable[[int, np.ndarray], np.ndarray] | None = None) -> np.ndarray:
    """Run every decoder layer on hidden states h (T, hidden) at the rotary angles cos/sin (T, hd/2);
    commits the T tokens to the cache and returns the final-normed hidden states (T, hidden)."""
    done = model.layer_streaming.layer_done if model.layer_streaming is not None else None
    if model.runner is not None and model.runner.serves(cache):  # the same layers in C (chosen at load)
        return model.runner.forward_hidden(h, cache, cos, sin, layer_done=done, after_layer=after_layer)
    return numpy_layers(model, h, cache, cos, sin, after_layer, done)


def numpy_layers(model: Qwen3Model, h: np.ndarray, cache: KVCache, cos: np.ndarray, sin: np.ndarray,
                 after_layer: Callable[[int, np.ndarray], np.ndarray] | None = None,
                 done: Callable[[int], None] | None = None) -> np.ndarray:
    """forward_hidden's numpy path (the native layers' twin)."""
    cfg = model.config
    for i, layer in enumerate(model.layers):
        h = h + attention(cfg, layer.attn, rms_norm(h, layer.attn_norm, cfg.rms_norm_eps), cache, i, cos, sin)
        h = h + layer.mlp(rms_norm(h, layer.mlp_norm, cfg.rms_norm_eps))
        if after_layer is not None:
            h = after_layer(i, h)
        if done is not None:
            done(i)
    cache.commit(h.shape[0])
    return rms_norm(h, model.norm, cfg.rms_norm_eps)


def forward(model: Qwen3Model, tokens: np.ndarray, cache: KVCache, logits: str = "last") -> np.ndarray | None:
    """Append tokens (T,) to the sequence in cache. logits: 'last' -> (vocab,), 'all' -> (T, vocab), 'none',
    'hidden' -> the final-normed hidden states (T, hidden) (embedding models pool these)."""
    cfg = model.config
    positions = cache.length + np.arange(len(tokens))
    cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta)
    h = forward_hidden(model, model.embed.rows(np.asarray(tokens)), cache, cos, sin)  # (T, hidden)
    if logits == "none":
        return None
    if logits == "hidden":
        return h  # (T, hidden)
    if logits == "last":
        return model.lm_head(h[-1:])[0]  # (vocab,)
    return model.lm_head(h)  # (T, vocab)
