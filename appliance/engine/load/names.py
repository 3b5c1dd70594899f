"""The one table of tensor names: Hugging Face checkpoint <-> GGUF (llama.cpp's names). The loaders (hf.py,
gguf.py) and `convert` all name tensors through it.

Policy: a tensor has a role ("q", "mlp_norm", ...); a layer's Hugging Face name sits under
`{prefix}layers.N.` (prefix "model." for text models, "model.language_model." etc. for Qwen3-VL's decoder),
its GGUF name under `blk.N.`. Mixture-of-experts experts are either one tensor per expert
(`mlp.experts.J.gate_proj.weight`, as published) or transformers-5's fused pair (`mlp.experts.gate_up_proj`
(E, 2I, H) with gate rows first, `mlp.experts.down_proj` (E, H, I)); GGUF stacks them per projection
(`blk.N.ffn_gate_exps.weight`, ne = [in, out, E]).
"""
from __future__ import annotations

from dataclasses import dataclass

# role -> (Hugging Face name under `{prefix}layers.N.`, GGUF name under `blk.N.`), in llama.cpp's usual order
LAYER_TENSORS = {
    "attn_norm": ("input_layernorm.weight", "attn_norm.weight"),
    "q": ("self_attn.q_proj.weight", "attn_q.weight"), "q_bias": ("self_attn.q_proj.bias", "attn_q.bias"),
    "k": ("self_attn.k_proj.weight", "attn_k.weight"), "k_bias": ("self_attn.k_proj.bias", "attn_k.bias"),
    "v": ("self_attn.v_proj.weight", "attn_v.weight"), "v_bias": ("self_attn.v_proj.bias", "attn_v.bias"),
    "o": ("self_attn.o_proj.weight", "attn_output.weight"),
    "q_norm": ("self_attn.q_norm.weight", "attn_q_norm.weight"),
    "k_norm": ("self_attn.k_norm.weight", "attn_k_norm.weight"),
    "mlp_norm": ("post_attention_layernorm.weight", "ffn_norm.weight"),
    "gate": ("mlp.gate_proj.weight", "ffn_gate.weight"), "up": ("mlp.up_proj.weight", "ffn_up.weight"),
    "down": ("mlp.down_proj.weight", "ffn_down.weight"),
    "router": ("mlp.gate.weight", "ffn_gate_inp.weight"),  # mixture-of-experts layers only
}
# role -> (Hugging Face name under the prefix, GGUF name); lm_head is never under the prefix
MODEL_TENSORS = {"embed": ("embed_tokens.weight", "token_embd.weight"), "norm": ("norm.weight", "output_norm.weight"),
                 "lm_head": ("lm_head.weight", "output.weight")}
EXPERT_PROJECTIONS = ("gate", "up", "down")
# Qwen3.5 (llama.cpp's qwen35 / qwen35moe): role -> (Hugging Face name under `{prefix}layers.N.`, GGUF name under
# `blk.N.`) for what the Qwen3 table lacks or names otherwise. The full-attention layers' q/k/v/o and q/k norms and
# the dense MLP are the Qwen3 roles above; the post-attention norm is `post_attention_norm` here, not `ffn_norm`.
# The converter stores ssm_a = -exp(A_log) and reorders the value heads (gguf_qwen35.py undoes both).
QWEN35_TENSORS = {
    "mlp_norm": ("post_attention_layernorm.weight", "post_attention_norm.weight"),
    "qkv": ("linear_attn.in_proj_qkv.weight", "attn_qkv.weight"),
    "z": ("linear_attn.in_proj_z.weight", "attn_gate.weight"),
    "b": ("linear_attn.in_proj_b.weight", "ssm_beta.weight"),
    "a": ("linear_attn.in_proj_a.weight", "ssm_alpha.weight"),
    "conv": ("linear_attn.conv1d.weight", "ssm_conv1d.weight"),
    "A": ("linear_attn.A_log", "ssm_a"),
    "dt_bias": ("linear_attn.dt_bias", "ssm_dt.bias"),
    "linear_norm": ("linear_attn.norm.weight", "ssm_norm.weight"),
    "linear_out": ("linear_attn.out_proj.weight", "ssm_out.weight"),
    "shared_gate": ("mlp.shared_expert_gate.weight", "ffn_gate_inp_shexp.weight"),
    "shared_gate_proj": ("mlp.shared_expert.gate_proj.weight", "ffn_gate_shexp.weight"),
    "shared_up": ("mlp.shared_expert.up_proj.weight", "ffn_up_shexp.weight"),
    "shared_down": ("mlp.shared_expert.down_proj.weight", "ffn_down_shexp.weight"),
}


@dataclass(frozen=True)
class HFNames:
    """Hugging Face tensor names of one decoder (its prefix)."""
    prefix: str = "model."

    def layer(self, i: int, role: str) -> str:
        return f"{self.prefix}layers.{i}.{LAYER_TENSORS[role][0]}"

    def model(self, role: str) -> str:
        return MODEL_TENSORS[role][0] if role == "lm_head" else self.prefix + MODEL_TENSORS[role][0]

    def qwen35(self, i: int, role: str) -> str:
        """A Qwen3.5 layer tensor: its own roles (QWEN35_TENSORS) first, then the Qwen3 ones."""
        table = QWEN35_TENSORS if role in QWEN35_TENSORS else LAYER_TENSORS
        return f"{self.prefix}layers.{i}.{table[role][0]}"

    def expert(self, i: int, j: int, proj: str) -> str:
        """Expert j's own tensor (the published per-expert layout)."""
        return f"{self.prefix}layers.{i}.mlp.experts.{j}.{proj}_proj.weight"

    def fused_experts(self, i: int, which: str) -> str:
        """transformers-5's fused tensors: which = 'gate_up' (E, 2I, H) or 'down' (E, H, I)."""
        return f"{self.prefix}layers.{i}.mlp.experts.{which}_proj"


def gguf_layer(i: int, role: str) -> str:
    return f"blk.{i}.{LAYER_TENSORS[role][1]}"


def gguf_qwen35(i: int, role: str) -> str:
    """A Qwen3.5 layer tensor's GGUF name: its own roles (QWEN35_TENSORS) first, then the Qwen3 ones."""
    return f"blk.{i}.{QWEN35_TENSORS[role][1]}" if role in QWEN35_TENSORS else gguf_layer(i, role)


def gguf_model(role: str) -> str:
    return MODEL_TENSORS[role][1]


def gguf_experts(i: int, proj: str) -> str:
    """All experts of layer i for one projection ('gate', 'up', 'down'), stacked."""
    return f"blk.{i}.ffn_{proj}_exps.weight"


# ---- Qwen3-VL's vision tower: Hugging Face (under `model.visual.`) <-> llama.cpp's mmproj file (clip) -----------
# role -> (Hugging Face name under `blocks.N.`, GGUF name under `v.blk.N.`); each has .weight and .bias
VISION_BLOCK_TENSORS = {"norm1": ("norm1", "ln1"), "qkv": ("attn.qkv", "attn_qkv"), "proj": ("attn.proj", "attn_out"),
                        "norm2": ("norm2", "ln2"), "fc1": ("mlp.linear_fc1", "ffn_up"),
                        "fc2": ("mlp.linear_fc2", "ffn_down")}
# the final merger: role -> (Hugging Face name under `merger.`, GGUF name); the DeepStack mergers
# (`deepstack_merger_list.J.` <-> `v.deepstack.L.`, L the vision layer J follows) keep the same roles
MERGER_TENSORS = {"norm": ("norm", "v.post_ln"), "fc1": ("linear_fc1", "mm.0"), "fc2": ("linear_fc2", "mm.2")}
DEEPSTACK_TENSORS = {"norm": "norm", "fc1": "fc1", "fc2": "fc2"}
# llama.cpp splits the Conv3d patch kernel (hidden, C, 2, p, p) into two Conv2d kernels along time:
# v.patch_embd.weight is frame 0's (hidden, C, p, p), v.patch_embd.weight.1 frame 1's; one bias
VISION_PATCH, VISION_POS = "v.patch_embd", "v.position_embd.weight"


def gguf_vision_block(i: int, role: str) -> str:
    return f"v.blk.{i}.{VISION_BLOCK_TENSORS[role][1]}"


def gguf_merger(role: str, layer: int | None = None) -> str:
    """The final merger's tensor (layer None) or the DeepStack merger after vision layer `layer`."""
    return MERGER_TENSORS[role][1] if layer is None else f"v.deepstack.{layer}.{DEEPSTACK_TENSORS[role]}"
