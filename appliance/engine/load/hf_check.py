"""What a Hugging Face decoder needs of its safetensors, checked before any tensor is wrapped into a weight
(hf.py calls check_decoder before building the layers).

Policies:
- The hyper-parameters are in range first (check_config: positive sizes, heads divisible by KV heads, an even
  head size, a finite positive epsilon and RoPE base), so no shape below is computed from a zero or a
  negative.
- Every tensor the decoder reads is present with the numpy shape (out, in) the config gives, and its dtype is a
  float type we serve (F32, F16, BF16); optional groups (q/k norms, q/k/v biases) are in every layer or in none.
  Tensors no part of the decoder reads are left alone (a Qwen3-VL checkpoint also holds its vision tower, which
  its own builder reads whole); the container's checks (bounds, overlap, alignment) are safetensors.py's.
"""
from __future__ import annotations

import math

from .names import EXPERT_PROJECTIONS, HFNames

FLOAT_DTYPES = ("F32", "F16", "BF16")
MAX_SIZE = 1 << 24


def check_config(cfg) -> None:
    """ValueError unless a Qwen3Config's sizes are ones a decoder can be built from."""
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "max_position_embeddings"):
        v = getattr(cfg, name)
        if not 0 < v <= MAX_SIZE:
            raise ValueError(f"config {name} = {v} is out of range 1..{MAX_SIZE}")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ValueError(f"config num_key_value_heads = {cfg.num_key_value_heads} does not divide "
                         f"num_attention_heads = {cfg.num_attention_heads}")
    if cfg.head_dim % 2:
        raise ValueError(f"config head_dim = {cfg.head_dim} is odd (RoPE rotates pairs)")
    if not (math.isfinite(cfg.rms_norm_eps) and 0 < cfg.rms_norm_eps < 1):
        raise ValueError(f"config rms_norm_eps = {cfg.rms_norm_eps} is not in (0, 1)")
    if not (math.isfinite(cfg.rope_theta) and cfg.rope_theta > 0):
        raise ValueError(f"config rope_theta = {cfg.rope_theta} is not a positive number")


def check_moe_config(moe, cfg) -> None:
    if not (0 < moe.num_experts <= MAX_SIZE and 0 < moe.num_experts_per_tok <= moe.num_experts
            and 0 < moe.moe_intermediate_size <= MAX_SIZE and moe.decoder_sparse_step > 0):
        raise ValueError(f"MoE config out of range: {moe}")


def decoder_shapes(st, cfg, names: HFNames, moe=None) -> dict[str, tuple[int, ...]]:
    """Every tensor the decoder reads: Hugging Face name -> numpy shape."""
    H, V, hd, inter = cfg.hidden_size, cfg.vocab_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    want: dict[str, tuple[int, ...]] = {names.model("embed"): (V, H), names.model("norm"): (H,)}
    if not cfg.tie_word_embeddings and names.model("lm_head") in st:
        want[names.model("lm_head")] = (V, H)
    qk_norm, bias = names.layer(0, "q_norm") in st, names.layer(0, "q_bias") in st
    for i in range(cfg.num_hidden_layers):
        layer = {"attn_norm": (H,), "q": (q, H), "k": (kv, H), "v": (kv, H), "o": (H, q), "mlp_norm": (H,)}
        if qk_norm:
            layer.update(q_norm=(hd,), k_norm=(hd,))
        if bias:
            layer.update(q_bias=(q,), k_bias=(kv,), v_bias=(kv,))
        if moe is not None and moe.is_sparse(i):
            E, I = moe.num_experts, moe.moe_intermediate_size
            layer["router"] = (E, H)
            if names.fused_experts(i, "gate_up") in st:
                want.update({names.fused_experts(i, "gate_up"): (E, 2 * I, H), names.fused_experts(i, "down"): (E, H, I)})
            else:
                for j in range(E):
                    want.update({names.expert(i, j, p): (H, I) if p == "down" else (I, H) for p in EXPERT_PROJECTIONS})
        else:
            layer.update(gate=(inter, H), up=(inter, H), down=(H, inter))
        want.update({names.layer(i, role): shape for role, shape in layer.items()})
    return want


def check_decoder(st, cfg, names: HFNames = HFNames(), moe=None) -> None:
    """ValueError naming the tensor unless every decoder tensor is present, of its shape and a float dtype."""
    check_config(cfg)
    if moe is not None:
        check_moe_config(moe, cfg)
    for name, shape in decoder_shapes(st, cfg, names, moe).items():
        if name not in st:
            raise ValueError(f"tensor {name} is missing")
        got, dtype = st.info(name)
        if tuple(got) != shape:
            raise ValueError(f"tensor {name} has shape {list(got)}; config.json gives {list(shape)}")
        if dtype not in FLOAT_DTYPES:
            raise ValueError(f"tensor {name} has dtype {dtype}; weights must be F32, F16 or BF16")
