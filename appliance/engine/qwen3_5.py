"""Qwen3.5 (transformers' `qwen3_5` / `qwen3_5_moe`): a hybrid decoder whose layers are either Gated DeltaNet
linear attention (a fixed-size recurrent state per layer) or gated full attention (an output gate, partial
rotary), each followed by a SwiGLU MLP or the sparse MoE block with a shared expert.

Policy: float32 activations; the cache (recurrent_cache.HybridCache) is passed in, never held. Norm weights are
used as given: the checkpoint's zero-centred RMSNorm weights (applied as 1 + w) are shifted by the loader, the
gated output norm's are not. Text positions are the same on all three M-RoPE axes, so the full-attention layers
rotate the first `rotary_dim` dims of each head with plain RoPE. Decode runs the one-token recurrence,
prefill `delta.prefill`: in numpy (native/delta_numpy.py) the chunked delta rule, `delta_chunk` tokens a chunk;
with the library (src/delta.c, `delta` chosen at load) the C token loop, which measured faster than the chunked
form at these widths (layer_runner.native_delta); the causal conv1d before it likewise in C.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from appliance.native.delta_numpy import (
    causal_conv1d,
    gated_delta_chunked,
    gated_delta_step,
    gated_rms_norm,
    l2_normalize,
)
from appliance.native.ops_numpy import grouped_attention, rms_norm

from .config import UnsupportedModelError
from .qwen3 import apply_rope, rope_cos_sin
from .recurrent_cache import MTP_HIDDEN, HybridCache, RecurrentState

FULL, LINEAR = "full_attention", "linear_attention"
_NO_SSM = np.zeros((0, 0, 0), np.float32)  # the MTP hidden state's unused second array (recurrent_cache.MTP_HIDDEN)


@dataclass(frozen=True)
class DeltaOps:
    """The delta rule's code for decode and for prefill (native/delta_numpy.py, or C: chosen at load by
    layer_runner)."""
    step: Callable  # (q, k, v, g, beta, state) -> out, the token loop (decode)
    prefill: Callable  # (q, k, v, g, beta, state, chunk) -> out
    conv: Callable = causal_conv1d  # (x, conv state, kernel) -> SiLU(causal depthwise conv), state updated


NUMPY_DELTA = DeltaOps(gated_delta_step, gated_delta_chunked)


@dataclass(frozen=True)
class Qwen35Config:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense MLP (0 for the MoE variant)
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    partial_rotary_factor: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    layer_types: tuple[str, ...]
    linear_conv_kernel_dim: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    mrope_section: tuple[int, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    mtp_layers: int = 0  # mtp_num_hidden_layers: the multi-token-prediction head's layers (qwen3_5_mtp.py)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def kv_layers(self) -> int:
        """Layers that keep keys and values (the full-attention ones)."""
        return self.layer_types.count(FULL)

    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @classmethod
    def from_dict(cls, d: dict) -> "Qwen35Config":
        """From config.json: a ...ForConditionalGeneration file nests the decoder's keys under text_config."""
        outer = d
        if "text_config" in d:
            d = {**d["text_config"], **({"tie_word_embeddings": outer["tie_word_embeddings"]}
                                        if "tie_word_embeddings" in outer else {})}
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
        if rope_type != "default":
            raise UnsupportedModelError(f"rope type {rope_type!r} is not supported")
        if d.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"activation {d.get('hidden_act')!r} is not supported")
        n_layers = int(d["num_hidden_layers"])
        types = d.get("layer_types")
        if types is None:
            interval = int(d.get("full_attention_interval", 4))
            types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(n_layers)]
        if len(types) != n_layers or any(t not in (FULL, LINEAR) for t in types):
            raise UnsupportedModelError(f"layer_types {types!r} is not a list of {FULL!r}/{LINEAR!r} per layer")
        heads, hidden = int(d["num_attention_heads"]), int(d["hidden_size"])
        nk, nv = int(d.get("linear_num_key_heads", 16)), int(d.get("linear_num_value_heads", 32))
        if nv % nk:
            raise UnsupportedModelError("linear_num_value_heads is not a multiple of linear_num_key_heads")
        moe = "num_experts" in d and int(d.get("num_experts") or 0) > 0
        return cls(
            model_type=str(outer.get("model_type", "qwen3_5")),
            vocab_size=int(d["vocab_size"]), hidden_size=hidden,
            intermediate_size=0 if moe else int(d["intermediate_size"]),
            num_hidden_layers=n_layers, num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 10000.0))),
            partial_rotary_factor=float(rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.25))),
            max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            layer_types=tuple(types),
            linear_conv_kernel_dim=int(d.get("linear_conv_kernel_dim", 4)),
            linear_key_head_dim=int(d.get("linear_key_head_dim", 128)),
            linear_value_head_dim=int(d.get("linear_value_head_dim", 128)),
            linear_num_key_heads=nk, linear_num_value_heads=nv,
            mrope_section=tuple(int(x) for x in rope.get("mrope_section", ())),
            num_experts=int(d["num_experts"]) if moe else 0,
            num_experts_per_tok=int(d.get("num_experts_per_tok", 0)) if moe else 0,
            moe_intermediate_size=int(d.get("moe_intermediate_size", 0)) if moe else 0,
            shared_expert_intermediate_size=int(d.get("shared_expert_intermediate_size", 0)) if moe else 0,
            mtp_layers=int(d.get("mtp_num_hidden_layers") or 0),
        )


@dataclass
class GatedDeltaNet:
    """A linear-attention layer: fused q/k/v projection, z gate, b (beta) and a (decay) projections."""
    qkv: Callable  # (T, hidden) -> (T, conv_dim)
    z: Callable  # -> (T, value_dim)
    b: Callable  # -> (T, nv)
    a: Callable  # -> (T, nv)
    conv: np.ndarray  # (conv_dim, K)
    A_log: np.ndarray  # (nv,)
    dt_bias: np.ndarray  # (nv,)
    norm: np.ndarray  # (dv,) the gated RMSNorm's weight
    out: Callable  # (T, value_dim) -> (T, hidden)


@dataclass
class GatedAttention:
    """A full-attention layer: q_proj gives each head's query and its output gate side by side."""
    q: Callable  # (T, hidden) -> (T, H*2*hd)
    k: Callable
    v: Callable
    o: Callable
    q_norm: np.ndarray  # (hd,) shifted (1 + w)
    k_norm: np.ndarray


class SharedExpertMoE:
    """The routed experts (qwen3_moe.SparseMoE, top-k renormalised) plus a shared SwiGLU expert scaled by
    sigmoid(x . shared_gate)."""

    def __init__(self, routed: Callable, shared: Callable, shared_gate: np.ndarray):
        self.routed, self.shared, self.shared_gate = routed, shared, shared_gate  # shared_gate (1, hidden)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        gate = 1.0 / (1.0 + np.exp(-(x @ self.shared_gate.T)))  # (T, 1)
        return self.routed(x) + gate * self.shared(x)  # (T, hidden)


@dataclass
class Layer:
    attn_norm: np.ndarray  # (hidden,) shifted (1 + w)
    mixer: GatedDeltaNet | GatedAttention
    mlp_norm: np.ndarray
    mlp: Callable


@dataclass
class Qwen35Model:
    config: Qwen35Config
    embed: Any  # .rows(ids) -> (T, hidden)
    layers: list[Layer]
    norm: np.ndarray  # shifted (1 + w)
    lm_head: Callable
    delta_chunk: int = 64  # tokens per chunk of the chunked delta rule (prefill)
    runner: object = None  # no native whole-decoder runner for this architecture (layer_runner)
    delta: DeltaOps = NUMPY_DELTA  # the delta rule's code, chosen at load (layer_runner.choose_runner)
    recurrent = True  # the engine cannot cut this model's cache anywhere (recurrent_cache.HybridCache)
    mtp: MtpHead | None = None  # the checkpoint's multi-token-prediction head, if it has one and it is read
    mtp_on: bool = False  # new caches keep the head's keys and hidden state (--spec mtp), and forward feeds it

    def new_cache(self, max_len: int, dtype=np.float32) -> HybridCache:
        c = self.config
        return HybridCache(c.layer_types, c.num_key_value_heads, c.head_dim, max_len, dtype,
                           (c.linear_conv_kernel_dim - 1, c.conv_dim),
                           (c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim),
                           mtp_hidden=c.hidden_size if self.mtp_on and self.mtp is not None else 0)

    def forward(self, tokens: np.ndarray, cache: HybridCache, logits: str = "last") -> np.ndarray | None:
        """Append tokens (T,) to the sequence in cache. logits: 'last' -> (vocab,), 'all' -> (T, vocab), 'none'."""
        c = self.config
        positions = cache.length + np.arange(len(tokens))
        cos, sin = rope_cos_sin(positions, c.rotary_dim, c.rope_theta)  # (T, rd/2)
        h = self.forward_hidden(self.embed.rows(np.asarray(tokens)), cache, cos, sin, tokens)  # (T, hidden)
        return self.head(h, logits)

    def forward_hidden(self, h: np.ndarray, cache: HybridCache, cos: np.ndarray, sin: np.ndarray,
                       tokens: np.ndarray | None = None) -> np.ndarray:
        """Input embeddings h (T, hidden) of tokens (T,) through every layer at rotary angles cos, sin (T, rd/2) ->
        the final norm's output (T, hidden); the cache grows by T. The MTP head (a cache that keeps it) needs the
        token ids."""
        c = self.config
        T = h.shape[0]
        cache.check_room(T)
        for i, layer in enumerate(self.layers):
            x = rms_norm(h, layer.attn_norm, c.rms_norm_eps)
            if isinstance(layer.mixer, GatedDeltaNet):
                steps: list | None = [] if cache.keep_steps else None
                h = h + linear_attention(c, layer.mixer, x, cache.state[i], self.delta, self.delta_chunk, steps)
                if steps is not None:
                    cache.keep_step(i, steps)
            else:
                h = h + gated_attention(c, layer.mixer, x, cache, i, cos, sin)
            h = h + layer.mlp(rms_norm(h, layer.mlp_norm, c.rms_norm_eps))
        h = rms_norm(h, self.norm, c.rms_norm_eps)  # (T, hidden)
        if cache.mtp_layer is not None and self.mtp is not None and tokens is not None:  # the head's keys, next input
            catch_up(self, tokens, h, cache, cos, sin)
            if cache.keep_steps:
                cache.keep_step(MTP_HIDDEN, [RecurrentState(h[t:t + 1].copy(), _NO_SSM) for t in range(T)])
            cache.state[MTP_HIDDEN].conv[0] = h[-1]
        cache.commit(T)
        return h

    def head(self, h: np.ndarray, logits: str) -> np.ndarray | None:
        if logits == "none":
            return None
        if logits == "last":
            return self.lm_head(h[-1:])[0]  # (vocab,)
        return self.lm_head(h)  # (T, vocab)


def linear_attention(c: Qwen35Config, m: GatedDeltaNet, x: np.ndarray, state: RecurrentState, ops: DeltaOps,
                     chunk: int, steps: list[RecurrentState] | None = None) -> np.ndarray:
    """steps: a list to receive the state after each position (a verify forward: the token loop runs, as in
    decode, and HybridCache keeps the states so a rejected draft's tail can be cut off)."""
    T = x.shape[0]
    nk, nv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    qkv = m.qkv(x)  # (T, conv_dim)
    conv_in = np.concatenate([state.conv, qkv], axis=0) if steps is not None else None  # (K-1+T, conv_dim)
    mixed = ops.conv(qkv, state.conv, m.conv)  # (T, conv_dim)
    q = mixed[:, :c.key_dim].reshape(T, nk, dk)
    k = mixed[:, c.key_dim:2 * c.key_dim].reshape(T, nk, dk)
    v = np.ascontiguousarray(mixed[:, 2 * c.key_dim:].reshape(T, nv, dv))
    rep = nv // nk  # each key head serves `rep` consecutive value heads
    q = np.repeat(l2_normalize(q), rep, axis=1) * np.float32(dk ** -0.5)  # (T, nv, dk)
    k = np.repeat(l2_normalize(k), rep, axis=1)  # (T, nv, dk)
    beta = 1.0 / (1.0 + np.exp(-m.b(x)))  # (T, nv)
    g = -np.exp(m.A_log) * np.logaddexp(0.0, m.a(x) + m.dt_bias)  # (T, nv) log decay: -A * softplus(a + dt)
    g, beta = g.astype(np.float32), beta.astype(np.float32)
    if steps is not None:
        assert conv_in is not None
        km1 = state.conv.shape[0]
        o = np.empty_like(v)  # (T, nv, dv)
        for t in range(T):
            o[t:t + 1] = ops.step(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], state.ssm)
            steps.append(RecurrentState(conv_in[t + 1:t + 1 + km1].copy(), state.ssm.copy()))
    elif T == 1:
        o = ops.step(q, k, v, g, beta, state.ssm)  # (T, nv, dv)
    else:
        o = ops.prefill(q, k, v, g, beta, state.ssm, chunk)
    o = gated_rms_norm(o, m.z(x).reshape(T, nv, dv), m.norm, c.rms_norm_eps)  # (T, nv, dv)
    return m.out(o.reshape(T, nv * dv).astype(np.float32))  # (T, hidden)


def gated_attention(c: Qwen35Config, a: GatedAttention, x: np.ndarray, cache: HybridCache, layer: int,
                    cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    T = x.shape[0]
    H, KV, hd, rd = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rotary_dim
    qg = a.q(x).reshape(T, H, 2 * hd)
    q, gate = qg[:, :, :hd], qg[:, :, hd:].reshape(T, H * hd)  # (T, H, hd), (T, H*hd)
    q = rms_norm(q, a.q_norm, c.rms_norm_eps).transpose(1, 0, 2)  # (H, T, hd)
    k = rms_norm(a.k(x).reshape(T, KV, hd), a.k_norm, c.rms_norm_eps).transpose(1, 0, 2)  # (KV, T, hd)
    v = a.v(x).reshape(T, KV, hd).transpose(1, 0, 2)  # (KV, T, hd)
    q = np.concatenate([apply_rope(q[..., :rd], cos, sin), q[..., rd:]], axis=-1).astype(np.float32)
    k = np.concatenate([apply_rope(k[..., :rd], cos, sin), k[..., rd:]], axis=-1).astype(np.float32)
    keys, values = cache.update(layer, k, v)  # (KV, S, hd)
    keys, values = keys.astype(np.float32), values.astype(np.float32)
    if T > 1 and getattr(cache, "keep_steps", False):
        # a verify forward: each position as decode runs it (the same BLAS shapes and sums; a batched, masked row
        # rounds differently, and a seeded sample near a boundary would differ from plain decoding's)
        S = keys.shape[1]
        out = np.concatenate([grouped_attention(np.ascontiguousarray(q[:, t:t + 1]), keys[:, :S - T + t + 1],
                                                values[:, :S - T + t + 1]) for t in range(T)], axis=1)  # (H, T, hd)
    else:
        out = grouped_attention(np.ascontiguousarray(q), keys, values)  # (H, T, hd)
    out = out.transpose(1, 0, 2).reshape(T, H * hd) * (1.0 / (1.0 + np.exp(-gate)))  # (T, H*hd)
    return a.o(out.astype(np.float32))  # (T, hidden)


@dataclass
class MtpHead:
    """The multi-token-prediction head (its maths and policies: qwen3_5_mtp.py, which drafts from it)."""
    fc: Callable  # (T, 2*hidden) -> (T, hidden)  (eh_proj in GGUF)
    embed_norm: np.ndarray  # (hidden,) shifted (1 + w)  (pre_fc_norm_embedding / enorm)
    hidden_norm: np.ndarray  # (hidden,) shifted  (pre_fc_norm_hidden / hnorm)
    layer: Layer  # a full-attention layer (GatedAttention mixer), dense or MoE MLP
    norm: np.ndarray  # (hidden,) shifted  (mtp.norm / shared_head.norm)

    def run(self, c: Qwen35Config, embed, tokens: np.ndarray, h_prev: np.ndarray, kv, slot: int,
            cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        """tokens (T,) paired with h_prev (T, hidden), keys/values written through kv.update(slot, ...) ->
        the head's normed hidden states (T, hidden)."""
        eps = c.rms_norm_eps
        e = rms_norm(embed.rows(np.asarray(tokens)), self.embed_norm, eps)  # (T, hidden)
        x = self.fc(np.concatenate([e, rms_norm(h_prev, self.hidden_norm, eps)], axis=1).astype(np.float32))
        layer = self.layer
        x = x + gated_attention(c, layer.mixer, rms_norm(x, layer.attn_norm, eps), kv, slot, cos, sin)  # type: ignore[arg-type]
        x = x + layer.mlp(rms_norm(x, layer.mlp_norm, eps))
        return rms_norm(x, self.norm, eps)  # (T, hidden)


def catch_up(model: Qwen35Model, tokens: np.ndarray, h_out: np.ndarray, cache: HybridCache,
             cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """The head over a forward's positions (before the cache commits them): token t paired with the normed
    hidden state before it (the cache's last one, then this forward's). h_out (T, hidden); returns the
    hidden state to pair each position's successor with, i.e. h_out itself."""
    assert model.mtp is not None and cache.mtp_layer is not None
    prev = np.concatenate([cache.state[MTP_HIDDEN].conv, h_out[:-1]], axis=0)  # (T, hidden)
    model.mtp.run(model.config, model.embed, tokens, prev, cache, cache.mtp_layer, cos, sin)
    return h_out
