"""llama.cpp's Qwen3.5 GGUF files (`qwen35` dense, `qwen35moe`) as its own converter writes them -> the Qwen3.5
decoder of qwen3_5.py (the classes the Hugging Face loader builds). The vision tower of a Qwen3.5 pair (its
mmproj file) is gguf_vl.py's (qwen35_from_pair).

Policies:
- Configuration comes from the file's keys: `<arch>.ssm.*` (conv_kernel; state_size = the key head size;
  group_count = key heads; time_step_rank = value heads; inner_size = value heads x value head size), which
  layers are linear from `attention.recurrent_layers` or, without it, `full_attention_interval` (as llama.cpp
  reads them), the rotary part of a head from `rope.dimension_count`. Text positions are equal on all M-RoPE
  axes, so `rope.dimension_sections` changes nothing for text. A multi-token-prediction block
  (`nextn_predict_layers`: the last blocks, written by the converter unless --no-mtp) is read as the MTP head
  (qwen3_5_mtp.py): blk.{n}.nextn.eh_proj / enorm / hnorm / shared_head_norm (the converter's renames of
  fc / pre_fc_norm_embedding / pre_fc_norm_hidden / norm, its norms shifted +1 like every other) and the block's
  full-attention layer tensors under their usual names; files with or without it load alike.
- The converter's transformations are undone here, never in the forward pass: the zero-centred RMSNorm
  weights are stored shifted (+1) already and used as stored (the gated output norm, ssm_norm, is a plain
  weight in both); ssm_a holds -exp(A_log) (A_log = log(-ssm_a)); conv1d is stored squeezed (ne = [K, conv_dim],
  numpy (conv_dim, K) as the decoder wants).
- Value-head order: with fewer key heads than value heads the converter reorders the value heads from grouped
  by key head (Hugging Face: value head j reads key head j // r) to tiled (value head j reads key head j % n_k),
  in the v rows of attn_qkv and ssm_conv1d, attn_gate's rows, ssm_beta's and ssm_alpha's rows, ssm_a, ssm_dt and
  ssm_out's columns. The vectors and the conv kernel (small, float) are put back in grouped order at load; the
  matrices stay as mapped (quantized, zero-copy) and their outputs (qkv, z, b, a) or input (out) are taken
  through the permutation on each call (HeadOrder): a gather of one activation row per token, never a copy of
  a weight.
- MoE (`qwen35moe`): the routed experts are zero-copy slices of the stacked tensors (gguf_weights.expert_slices), the
  router always renormalises its top-k (llama.cpp's MoE graph for this architecture does), and the shared expert
  sits behind its sigmoid gate (ffn_gate_inp_shexp, ne [hidden] or [hidden, 1]).
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from .. import qwen3
from ..qwen3_5 import (
    FULL,
    LINEAR,
    GatedAttention,
    GatedDeltaNet,
    Layer,
    MtpHead,
    Qwen35Config,
    Qwen35Model,
    SharedExpertMoE,
)
from ..qwen3_moe import ExpertLoadStats, Experts, MoEConfig, SparseMoE
from ..weights import DenseWeight
from .gguf_check import (
    MAX_CONTEXT,
    MAX_EXPERTS,
    MAX_HEADS,
    MAX_LAYERS,
    MAX_VOCAB,
    MAX_WIDTH,
    check_tensor_set,
    f32_value,
    meta_float,
    meta_int,
    meta_list,
    meta_str,
)
from .gguf_weights import expert_slices
from .names import EXPERT_PROJECTIONS, gguf_experts, gguf_model, gguf_qwen35

QWEN35_ARCHITECTURES = ("qwen35", "qwen35moe")


def qwen35_config(meta: dict[str, Any], tensors: dict) -> Qwen35Config:
    """The decoder's configuration from the file's own keys, each typed and bounded (gguf_check.meta_int ...)."""
    arch = meta.get("general.architecture")
    if arch not in QWEN35_ARCHITECTURES:
        raise ValueError(f"{arch!r} is not a Qwen3.5 architecture")

    def key(name, default=None, hi=MAX_WIDTH, lo=1):
        return meta_int(meta, f"{arch}.{name}", default, lo, hi)

    scaling = meta_str(meta, f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", None) or "rope_freqs.weight" in tensors:
        raise ValueError(f"rope scaling {scaling if scaling != 'none' else 'rope_freqs'!r} is not supported")
    blocks = key("block_count", hi=MAX_LAYERS)
    n_layers = blocks - key("nextn_predict_layers", 0, lo=0, hi=blocks - 1)
    hidden, heads = key("embedding_length"), key("attention.head_count", hi=MAX_HEADS)
    head_dim = key("attention.key_length", max(1, hidden // heads))
    if key("attention.value_length", head_dim) != head_dim:
        raise ValueError(f"metadata key {arch}.attention.value_length differs from the key length {head_dim}")
    kv_heads = key("attention.head_count_kv", heads, hi=heads)
    if heads % kv_heads:
        raise ValueError(f"metadata key {arch}.attention.head_count_kv: {kv_heads} does not divide {heads} heads")
    rotary = key("rope.dimension_count", head_dim, hi=head_dim)
    if rotary % 2 or int(head_dim * (rotary / head_dim)) != rotary:
        raise ValueError(f"metadata key {arch}.rope.dimension_count: {rotary} rotary dims of {head_dim} not served")
    recurrent = meta_list(meta, f"{arch}.attention.recurrent_layers", bool)
    if recurrent is None:
        interval = key("full_attention_interval", 4, hi=MAX_LAYERS)
        recurrent = [(i + 1) % interval != 0 for i in range(n_layers)] + [False] * (blocks - n_layers)
    if len(recurrent) != blocks or any(recurrent[n_layers:]):
        raise ValueError(f"metadata key {arch}.attention.recurrent_layers does not give {blocks} blocks whose "
                         f"multi-token-prediction ones ({blocks - n_layers}) are full attention")
    nk, nv = key("ssm.group_count", hi=MAX_HEADS), key("ssm.time_step_rank", hi=MAX_HEADS)
    inner = key("ssm.inner_size")
    if nv % nk or inner % nv:
        raise ValueError(f"metadata keys {arch}.ssm.*: {nv} value heads of {inner} do not fit {nk} key heads")
    tokens = meta_list(meta, "tokenizer.ggml.tokens", str)
    vocab = len(tokens) if tokens else key("vocab_size", hi=MAX_VOCAB)
    moe: dict[str, int] = {}
    if arch == "qwen35moe":
        experts = key("expert_count", hi=MAX_EXPERTS)
        moe = dict(num_experts=experts, num_experts_per_tok=key("expert_used_count", hi=experts),
                   moe_intermediate_size=key("expert_feed_forward_length"),
                   shared_expert_intermediate_size=key("expert_shared_feed_forward_length"))
        scale = meta_float(meta, f"{arch}.expert_weights_scale", 1.0, -1e9, 1e9)
        if scale not in (0.0, 1.0):
            raise ValueError(f"metadata key {arch}.expert_weights_scale {scale} is not supported")
    sections = meta_list(meta, f"{arch}.rope.dimension_sections", int) or []
    return Qwen35Config(
        model_type=arch, vocab_size=vocab, hidden_size=hidden,
        intermediate_size=0 if moe else key("feed_forward_length"), num_hidden_layers=n_layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        rms_norm_eps=f32_value(meta_float(meta, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6, 0.0, 1.0)),
        rope_theta=f32_value(meta_float(meta, f"{arch}.rope.freq_base", 10000.0, 0.0, 1e12)),
        partial_rotary_factor=rotary / head_dim, max_position_embeddings=key("context_length", hi=MAX_CONTEXT),
        tie_word_embeddings=gguf_model("lm_head") not in tensors,
        layer_types=tuple(LINEAR if r else FULL for r in recurrent[:n_layers]),
        linear_conv_kernel_dim=key("ssm.conv_kernel", hi=64), linear_key_head_dim=key("ssm.state_size"),
        linear_value_head_dim=inner // nv, linear_num_key_heads=nk, linear_num_value_heads=nv,
        mtp_layers=blocks - n_layers,
        mrope_section=tuple(s for s in sections[:3]), **moe)


def expected_shapes(cfg: Qwen35Config) -> dict[str, tuple[int, ...]]:
    """Every tensor the decoder reads: GGUF name -> GGUF shape (ne0, the row length, first)."""
    H, hd = cfg.hidden_size, cfg.head_dim
    q, kv, nv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd, cfg.linear_num_value_heads
    want: dict[str, tuple[int, ...]] = {gguf_model("embed"): (H, cfg.vocab_size), gguf_model("norm"): (H,)}
    if not cfg.tie_word_embeddings:
        want[gguf_model("lm_head")] = (H, cfg.vocab_size)
    for i, kind in enumerate(cfg.layer_types):
        layer: dict[str, tuple[int, ...]] = {"attn_norm": (H,), "mlp_norm": (H,)}
        if kind == FULL:
            layer.update(q=(H, 2 * q), k=(H, kv), v=(H, kv), o=(q, H), q_norm=(hd,), k_norm=(hd,))
        else:
            layer.update(qkv=(H, cfg.conv_dim), z=(H, cfg.value_dim), b=(H, nv), a=(H, nv),
                         conv=(cfg.linear_conv_kernel_dim, cfg.conv_dim), A=(nv,), dt_bias=(nv,),
                         linear_norm=(cfg.linear_value_head_dim,), linear_out=(cfg.value_dim, H))
        if cfg.num_experts:
            E, I, S = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
            layer.update(router=(H, E), shared_gate=(H,), shared_gate_proj=(H, S), shared_up=(H, S),
                         shared_down=(S, H))
            want.update({gguf_experts(i, "gate"): (H, I, E), gguf_experts(i, "up"): (H, I, E),
                         gguf_experts(i, "down"): (I, H, E)})
        else:
            layer.update(gate=(H, cfg.intermediate_size), up=(H, cfg.intermediate_size),
                         down=(cfg.intermediate_size, H))
        want.update({gguf_qwen35(i, role): shape for role, shape in layer.items()})
    return want


def grouped_heads(nk: int, nv: int, width: int) -> np.ndarray:
    """Index of the file's element for each Hugging Face element of a value-head axis (`width` per head):
    hf = file[grouped_heads(...)]. The file's head v*nk + g is Hugging Face's head g*r + v (r = nv / nk)."""
    heads = np.arange(nv).reshape(nv // nk, nk).T.reshape(nv)  # (nv,): file head of HF head g*r + v
    return (heads[:, None] * width + np.arange(width)).reshape(-1)  # (nv*width,)


class HeadOrder:
    """A linear weight whose output (or input) is in the file's value-head order, used in Hugging Face order:
    out_order gathers the output columns, in_order the input's (x_file = x_hf[:, in_order])."""

    def __init__(self, weight, out_order: np.ndarray | None = None, in_order: np.ndarray | None = None):
        self.weight, self.out_order, self.in_order = weight, out_order, in_order
        self.shape = weight.shape  # (out, in)

    def __repr__(self) -> str:
        return f"HeadOrder({self.weight!r})"

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if self.in_order is not None:
            x = x[:, self.in_order]  # (T, in) in the file's order
        y = self.weight(x)  # (T, out)
        return y if self.out_order is None else np.ascontiguousarray(y[:, self.out_order])


def build_qwen35(cfg: Qwen35Config, f, meta: dict[str, Any]) -> Qwen35Model:
    """The decoder over the GGUF tensors of `f` (gguf_weights.GGUFModelFile), once the tensor set and its shapes are
    checked against the config (before any tensor is wrapped)."""
    mtp = tuple(f"blk.{i}." for i in range(cfg.num_hidden_layers, meta_int(meta, f"{cfg.model_type}.block_count")))
    check_tensor_set(f.tensors, expected_shapes(cfg), unread=mtp)
    nk, nv, dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_value_head_dim
    v_rows = grouped_heads(nk, nv, dv)  # (value_dim,)
    channels = np.concatenate([np.arange(2 * cfg.key_dim), 2 * cfg.key_dim + v_rows])  # (conv_dim,)
    heads = grouped_heads(nk, nv, 1)  # (nv,)
    reorder = nk != nv
    stats = ExpertLoadStats()
    moe = MoEConfig(cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                    norm_topk_prob=True) if cfg.num_experts else None

    def w(i: int, role: str):
        return f.matrix(gguf_qwen35(i, role))

    def vec(i: int, role: str) -> np.ndarray:
        return f.vector(gguf_qwen35(i, role))

    def ordered(i: int, role: str, out_order: np.ndarray) -> Callable:
        return HeadOrder(w(i, role), out_order=out_order) if reorder else w(i, role)

    def mlp(i: int) -> Callable:
        if moe is None:
            return qwen3.SwiGLU(w(i, "gate"), w(i, "up"), w(i, "down"))
        router = w(i, "router")
        router = router.w if isinstance(router, DenseWeight) else router.dequantize()  # (E, hidden) float32
        gates, ups, downs = (expert_slices(f.tensors[gguf_experts(i, p)]) for p in EXPERT_PROJECTIONS)
        routed = SparseMoE(i, router, Experts(gates, ups, downs), moe, stats)
        shared = qwen3.SwiGLU(w(i, "shared_gate_proj"), w(i, "shared_up"), w(i, "shared_down"))
        return SharedExpertMoE(routed, shared, vec(i, "shared_gate")[None, :])  # gate (1, hidden)

    layers = []
    for i, kind in enumerate(cfg.layer_types):
        mixer: GatedAttention | GatedDeltaNet
        if kind == FULL:
            mixer = GatedAttention(w(i, "q"), w(i, "k"), w(i, "v"), w(i, "o"), q_norm=vec(i, "q_norm"),
                                   k_norm=vec(i, "k_norm"))
        else:
            a = vec(i, "A")[heads]  # (nv,) -exp(A_log)
            if not np.all(a < 0):
                raise ValueError(f"tensor {gguf_qwen35(i, 'A')} holds a value >= 0; the converter stores -exp(A_log)")
            conv = f.tensors[gguf_qwen35(i, "conv")]
            if conv.tensor_type.name not in ("F32", "F16"):
                raise ValueError(f"tensor {conv.name} has type {conv.tensor_type.name}; expected F32 or F16")
            kernel = np.asarray(conv.data, dtype=np.float32).reshape(cfg.conv_dim, cfg.linear_conv_kernel_dim)
            out = w(i, "linear_out")
            mixer = GatedDeltaNet(
                qkv=ordered(i, "qkv", channels), z=ordered(i, "z", v_rows), b=ordered(i, "b", heads),
                a=ordered(i, "a", heads), conv=np.ascontiguousarray(kernel[channels]),  # (conv_dim, K)
                A_log=np.log(-a).astype(np.float32), dt_bias=vec(i, "dt_bias")[heads],
                norm=vec(i, "linear_norm"),
                out=HeadOrder(out, in_order=np.argsort(v_rows)) if reorder else out)
        layers.append(Layer(vec(i, "attn_norm"), mixer, vec(i, "mlp_norm"), mlp(i)))
    embed = f.matrix(gguf_model("embed"))
    lm_head = embed if cfg.tie_word_embeddings else f.matrix(gguf_model("lm_head"))
    model = Qwen35Model(cfg, embed, layers, f.vector(gguf_model("norm")), lm_head)
    n = cfg.num_hidden_layers
    if cfg.mtp_layers == 1 and f"blk.{n}.nextn.eh_proj.weight" in f.tensors:
        head_norm = f"blk.{n}.nextn.shared_head_norm.weight"  # absent: the model's output norm (as llama.cpp)
        head_layer = Layer(vec(n, "attn_norm"), GatedAttention(w(n, "q"), w(n, "k"), w(n, "v"), w(n, "o"),
                           q_norm=vec(n, "q_norm"), k_norm=vec(n, "k_norm")), vec(n, "mlp_norm"), mlp(n))
        model.mtp = MtpHead(f.matrix(f"blk.{n}.nextn.eh_proj.weight"), f.vector(f"blk.{n}.nextn.enorm.weight"),
                            f.vector(f"blk.{n}.nextn.hnorm.weight"), head_layer,
                            f.vector(head_norm if head_norm in f.tensors else gguf_model("norm")))
    if moe is not None:
        model.expert_stats = stats  # type: ignore[attr-defined]
        model.moe_config = moe  # type: ignore[attr-defined]
    return model
