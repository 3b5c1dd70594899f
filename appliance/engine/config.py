"""Decoder configuration read from a checkpoint's own config.json keys.

Policy: one frozen dataclass covers the dense decoders we run (qwen3, qwen2, llama); the differences are
flags (`qk_norm`, `attention_bias`), never branches on model names in the forward pass. Unsupported
features (rope scaling types other than default, sliding-window layers) are refused with a clear error
rather than computed wrongly.
"""
from __future__ import annotations

from dataclasses import dataclass


class UnsupportedModelError(ValueError):
    """The checkpoint is of a kind this engine does not run."""


@dataclass(frozen=True)
class Qwen3Config:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qk_norm: bool = True
    attention_bias: bool = False

    @property
    def n_rep(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_dict(cls, d: dict) -> "Qwen3Config":
        model_type = d.get("model_type", "qwen3")
        heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
        if rope_type != "default":
            raise UnsupportedModelError(f"rope type {rope_type!r} is not supported")
        theta = d.get("rope_theta", rope.get("rope_theta", 10000.0))
        if d.get("use_sliding_window"):
            raise UnsupportedModelError("sliding-window attention is not supported")
        if d.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"activation {d.get('hidden_act')!r} is not supported")
        return cls(
            model_type=model_type,
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qk_norm=model_type.startswith("qwen3"),
            attention_bias=bool(d.get("attention_bias", model_type == "qwen2")),
        )
