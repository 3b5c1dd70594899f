"""Qwen3-MoE: the sparse mixture-of-experts MLP block (the loaders in load/ build it from checkpoints).

Policy: a token's router softmax runs over all experts (float32), the top `num_experts_per_tok` are kept and,
with `norm_topk_prob`, renormalised. Only the selected experts are computed: decode reads num_experts_per_tok
experts per layer; prefill groups the chunk's tokens by expert so each selected expert's weights are read once
per chunk. Expert weights stay memory-mapped (BF16/F16 widened per use, quantized ones read in place), and
ExpertLoadStats records which experts a request read. Layers listed in `mlp_only_layers`, or not on the
`decoder_sparse_step`, use the dense SwiGLU MLP.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from .page_release import release_pages
from .qwen3 import SwiGLU


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    @classmethod
    def from_dict(cls, d: dict) -> "MoEConfig":
        return cls(num_experts=int(d.get("num_experts", d.get("num_local_experts"))), num_experts_per_tok=int(d["num_experts_per_tok"]),
                   moe_intermediate_size=int(d["moe_intermediate_size"]),
                   norm_topk_prob=bool(d.get("norm_topk_prob", False)),
                   decoder_sparse_step=int(d.get("decoder_sparse_step", 1) or 1),
                   mlp_only_layers=tuple(int(i) for i in d.get("mlp_only_layers") or ()))

    def is_sparse(self, layer: int) -> bool:
        return (layer not in self.mlp_only_layers and self.num_experts > 0
                and (layer + 1) % self.decoder_sparse_step == 0)


@dataclass
class ExpertLoadStats:
    """Which experts were read since the last reset (the benchmark resets it per request)."""
    touched: set[tuple[int, int]] = field(default_factory=set)  # (layer, expert)
    expert_calls: int = 0  # expert MLP evaluations (each reads that expert's weights once)
    routed_tokens: int = 0

    def reset(self) -> None:
        self.touched.clear()
        self.expert_calls = self.routed_tokens = 0

    @property
    def distinct_experts(self) -> int:
        return len(self.touched)


def route(x: np.ndarray, router: np.ndarray, top_k: int, normalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """Top-k experts per token and their weights: (T, k) ids and (T, k) float32 weights."""
    logits = x @ router.T  # (T, E)
    probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    top = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]  # (T, k)
    w = np.take_along_axis(probs, top, axis=-1)  # (T, k)
    if normalize:
        w = w / w.sum(axis=-1, keepdims=True)
    return top, w.astype(np.float32)


class SparseMoE:
    def __init__(self, layer: int, router: np.ndarray, experts: Sequence[Callable], cfg: MoEConfig,
                 stats: ExpertLoadStats, release_pages: bool = False):
        self.layer, self.router, self.experts, self.cfg, self.stats = layer, router, experts, cfg, stats
        self.release_pages = release_pages  # madvise an expert's weight pages away after each use

    def __call__(self, x: np.ndarray) -> np.ndarray:
        top, w = route(x, self.router, self.cfg.num_experts_per_tok, self.cfg.norm_topk_prob)  # (T, k)
        out = np.zeros_like(x)  # (T, hidden)
        for e in np.unique(top):
            rows, slot = np.nonzero(top == e)  # tokens routed to expert e
            out[rows] += self.experts[e](x[rows]) * w[rows, slot][:, None]
            self.stats.touched.add((self.layer, int(e)))
            self.stats.expert_calls += 1
            if self.release_pages:
                release_expert(self.experts[e])
        self.stats.routed_tokens += x.shape[0]
        return out


def release_expert(expert: SwiGLU) -> int:
    """Release the mapped pages of one expert's three matrices; returns bytes released."""
    total = 0
    for w in (expert.gate, expert.up, expert.down):
        raw = getattr(w, "raw", None)
        if raw is None:
            raw = getattr(w, "w", None)
        if raw is not None:
            total += release_pages(raw)
    return total


def set_release_pages(model, on: bool) -> None:
    """Turn page release on or off for every sparse block of a model (no-op for a model without any)."""
    for layer in getattr(model, "layers", ()):
        if isinstance(layer.mlp, SparseMoE):
            layer.mlp.release_pages = on
