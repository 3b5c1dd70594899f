"""Qwen3-MoE: the sparse mixture-of-experts MLP block (the loaders in load/ build it from checkpoints).

Policy: a token's router softmax runs over all experts (float32), the top `num_experts_per_tok` are kept and,
with `norm_topk_prob`, renormalised. Only the selected experts are computed: decode reads num_experts_per_tok
experts per layer; prefill groups the chunk's tokens by expert so each selected expert's weights are read once
per chunk. Expert weights stay memory-mapped (BF16/F16 widened per use, quantized ones read in place), and
ExpertLoadStats records which experts a request read. A layer's experts are one `Experts` object (the three
stacked matrices as per-expert weights); with the C library all routed experts of a call run in one native call
(native/src/moe.c: routing, grouping per expert, threaded across experts and rows), otherwise the numpy loop
below, its twin. Layers listed in `mlp_only_layers`, or not on the
`decoder_sparse_step`, use the dense SwiGLU MLP.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from appliance.native.ops_numpy import route

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
    def from_dict(cls, d: dict[str, Any]) -> "MoEConfig":
        return cls(num_experts=int(d["num_experts"] if "num_experts" in d else d["num_local_experts"]), num_experts_per_tok=int(d["num_experts_per_tok"]),
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


class Experts:
    """The experts of one MoE layer: gate/up (inter, hidden) and down (hidden, inter) weights per expert, left
    in the file's mapping. Indexing gives expert e as a SwiGLU over its three weights."""

    def __init__(self, gates: Sequence, ups: Sequence, downs: Sequence):
        if not len(gates) == len(ups) == len(downs):
            raise ValueError("gate, up and down need one weight per expert each")
        self.gates, self.ups, self.downs = list(gates), list(ups), list(downs)
        self._swiglus = [SwiGLU(g, u, d) for g, u, d in zip(self.gates, self.ups, self.downs)]

    def __len__(self) -> int:
        return len(self._swiglus)

    def __getitem__(self, e):
        return self._swiglus[e]

    def __iter__(self):
        return iter(self._swiglus)

    def native(self, router: np.ndarray, top_k: int, norm_topk: bool):
        """The routed experts bound for one native call (kernels.MoEFFN), or None when the library is missing
        or a matrix is not one the C side reads in place (the numpy loop serves then)."""
        from appliance.native import kernels
        if not kernels.available():
            return None
        kinds = []
        for mats in (self.gates, self.ups, self.downs):
            served = [w.native_spec() for w in mats]
            if any(s is None or int(s[0]) & kernels.X8 for s in served) or len({int(s[0]) for s in served}) != 1:
                return None
            kinds.append((int(served[0][0]), [s[1] for s in served]))
        try:
            return kernels.MoEFFN(router, top_k, norm_topk, *kinds)
        except ValueError:
            return None


class SparseMoE:
    def __init__(self, layer: int, router: np.ndarray, experts: Experts, cfg: MoEConfig,
                 stats: ExpertLoadStats, release_pages: bool = False):
        if not isinstance(experts, Experts):
            raise TypeError("experts must be an Experts object")
        self.layer, self.router, self.experts, self.cfg, self.stats = layer, router, experts, cfg, stats
        self.release_pages = release_pages  # madvise an expert's weight pages away after each use
        # chosen once at load: one native call per forward for all routed experts, or the numpy loop
        self.native = experts.native(router, cfg.num_experts_per_tok, cfg.norm_topk_prob)

    def record(self, counts: np.ndarray, tokens: int) -> None:
        """Account one call whose experts got `counts` (E,) tokens (the native path's counts)."""
        used = np.nonzero(counts)[0]
        self.stats.touched.update((self.layer, int(e)) for e in used)
        self.stats.expert_calls += len(used)
        self.stats.routed_tokens += tokens
        if self.release_pages:
            for e in used:
                release_expert(self.experts[e])

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if self.native is not None:
            out = self.native(x)  # (T, hidden)
            self.record(self.native.counts, x.shape[0])
            return out
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
