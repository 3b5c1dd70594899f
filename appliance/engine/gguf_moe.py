"""Qwen3-MoE from GGUF (llama.cpp's `qwen3moe` architecture): stacked expert tensors sliced per expert.

Policy: `blk.N.ffn_{gate,up,down}_exps.weight` hold all experts of a layer in one tensor (ne = [in, out, E]);
each expert is a zero-copy slice of the mapped block data wrapped in QuantWeight (never rearranged into a copy),
so decode reads only the routed experts' bytes and resident memory follows the experts in use. A layer is sparse when it has a router (`ffn_gate_inp`), dense otherwise. llama.cpp
always renormalises the top-k weights for qwen3moe, so the file's MoE config says norm_topk_prob=True unless
the file states `expert_weights_norm`.
"""
from __future__ import annotations

import numpy as np

from .qwen3 import SwiGLU
from .qwen3_moe import ExpertLoadStats, MoEConfig, SparseMoE
from .weights import DenseWeight


def moe_config_from_metadata(meta: dict, arch: str) -> MoEConfig:
    def key(name):
        v = meta.get(f"{arch}.{name}")
        if v is None:
            raise ValueError(f"metadata key {arch}.{name} is missing")
        return int(v)

    return MoEConfig(num_experts=key("expert_count"), num_experts_per_tok=key("expert_used_count"),
                     moe_intermediate_size=key("expert_feed_forward_length"),
                     norm_topk_prob=bool(meta.get(f"{arch}.expert_weights_norm", True)))


def expert_slices(tensor) -> list:
    """One (out, in) weight per expert of a stacked GGUF tensor, sharing the mapped bytes."""
    from .quant_weights import QuantWeight

    n_in, n_out, n_exp = (int(n) for n in tensor.shape)  # GGUF order: ne0 (row length) first
    data = tensor.data  # (E, out, in) float32 or (E, out, row_bytes) uint8
    if tensor.tensor_type.name == "F32":
        return [DenseWeight(np.asarray(data[e], dtype=np.float32).reshape(n_out, n_in)) for e in range(n_exp)]
    raw = data.view(np.uint8).reshape(n_exp, n_out, -1)
    return [QuantWeight(tensor.tensor_type, (n_out, n_in), raw[e], repack=False) for e in range(n_exp)]


def moe_mlp(f, layer: int, stats: ExpertLoadStats, moe: MoEConfig):
    """The MLP of layer `layer`: SparseMoE if the layer has a router, None to let the caller build a dense one."""
    p = f"blk.{layer}."
    if p + "ffn_gate_inp.weight" not in f:
        return None
    router = f.matrix(p + "ffn_gate_inp.weight")
    router = router.w if isinstance(router, DenseWeight) else router.dequantize()  # (E, hidden) float32
    gates, ups, downs = (expert_slices(f.tensors[p + f"ffn_{k}_exps.weight"]) for k in ("gate", "up", "down"))
    experts = [SwiGLU(g, u, d) for g, u, d in zip(gates, ups, downs)]
    return SparseMoE(layer, router, experts, moe, stats)
