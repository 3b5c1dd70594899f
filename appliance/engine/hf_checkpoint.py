"""Hugging Face tensor names -> decoder objects (dense Qwen3 / Qwen2 / Llama).

Policy: checkpoint naming quirks live here, not in the forward pass. A builder for another MLP kind (the
mixture-of-experts block) passes its own `mlp_for_layer`; attention and norms are shared.
"""
from __future__ import annotations

from typing import Callable

from . import qwen3
from .config import Qwen3Config
from .safetensors import SafeTensors, to_float32
from .weights import DenseWeight


def dense_weight(st: SafeTensors, name: str):
    """A linear weight: BF16/F16 matrices are read in place from the mapping by the native kernels when the
    library is there (no float32 copy); otherwise, and for F32, a float32 DenseWeight."""
    raw, dtype = st.raw(name)
    if dtype in ("BF16", "F16") and raw.ndim == 2 and native_available():
        from .quant_weights import half_weight
        return half_weight(raw, dtype)
    return DenseWeight(to_float32(raw, dtype))


def native_available() -> bool:
    from appliance.native import kernels
    return kernels.available()


def dense_mlp(st: SafeTensors, prefix: str) -> qwen3.SwiGLU:
    """prefix: e.g. 'model.layers.3.mlp.'"""
    return qwen3.SwiGLU(dense_weight(st, prefix + "gate_proj.weight"), dense_weight(st, prefix + "up_proj.weight"),
                        dense_weight(st, prefix + "down_proj.weight"))


def build_decoder(st: SafeTensors, cfg: Qwen3Config, mlp_for_layer: Callable[[int, str], Callable],
                  prefix: str = "model.") -> qwen3.Qwen3Model:
    def opt(name):
        return st.float32(name) if name in st else None

    layers = []
    for i in range(cfg.num_hidden_layers):
        p = f"{prefix}layers.{i}."
        a = p + "self_attn."
        attn = qwen3.Attention(
            q=dense_weight(st, a + "q_proj.weight"), k=dense_weight(st, a + "k_proj.weight"),
            v=dense_weight(st, a + "v_proj.weight"), o=dense_weight(st, a + "o_proj.weight"),
            q_norm=opt(a + "q_norm.weight"), k_norm=opt(a + "k_norm.weight"),
            q_bias=opt(a + "q_proj.bias"), k_bias=opt(a + "k_proj.bias"), v_bias=opt(a + "v_proj.bias"))
        layers.append(qwen3.Layer(st.float32(p + "input_layernorm.weight"), attn,
                                  st.float32(p + "post_attention_layernorm.weight"), mlp_for_layer(i, p + "mlp.")))
    embed = dense_weight(st, prefix + "embed_tokens.weight")
    lm_head = embed if cfg.tie_word_embeddings or "lm_head.weight" not in st else dense_weight(st, "lm_head.weight")
    return qwen3.Qwen3Model(cfg, embed, layers, st.float32(prefix + "norm.weight"), lm_head)


def build_qwen3(st: SafeTensors, cfg_dict: dict) -> tuple[Qwen3Config, qwen3.Qwen3Model]:
    cfg = Qwen3Config.from_dict(cfg_dict)
    return cfg, build_decoder(st, cfg, lambda i, p: dense_mlp(st, p))
