"""Hugging Face checkpoint directories -> decoder objects: dense Qwen3 / Qwen2 / Llama, Qwen3-MoE, Qwen3-VL and
Qwen3-VL-MoE (text decoder and vision tower).

Policy: checkpoint naming quirks live here, not in the model files. Architectures register a builder in
ARCHITECTURES keyed by config.json's `model_type`; a builder gets the tensors, config.json and the LoadOptions
and returns (config, model). Linear weights: BF16/F16 matrices are read in place from the mapping by the
native kernels when the library is there (no float32 copy); otherwise, and for F32, float32 DenseWeight.
Mixture-of-experts experts stay in the mapping either way (widened per use without the library).

Qwen3.5 (`qwen3_5`, `qwen3_5_moe`, and the text-only `*_text` layouts) quirks:
- A ...ForConditionalGeneration file nests the decoder's config under `text_config` and its tensors under
  `model.language_model.`; a ForCausalLM file has them at the top and under `model.`; `lm_head.weight` is at the
  top in both.
- The decoder's RMSNorm weights (input, post-attention, q/k, final) are zero-centred (applied as 1 + w): shifted
  here once; the linear-attention output norm is a plain weight. conv1d is stored (conv_dim, 1, K).
- `mtp.*` tensors (the multi-token-prediction head, `mtp_num_hidden_layers`): fc, pre_fc_norm_embedding,
  pre_fc_norm_hidden, norm at `mtp.`, its one layer as a full-attention layer at `mtp.layers.0.` (all norms
  zero-centred); read when present (qwen3_5_mtp.py), files without them load alike.
- The vision tower (`model.visual.*`, Qwen3-VL's without DeepStack: hf_vision.py) makes the model a
  qwen3_5_vl.Qwen35VLModel when config.json has a vision_config; a text-only layout (no vision_config or no
  `model.visual.*` tensors) serves text and refuses image parts (400).
- MoE: experts per expert or fused (hf_experts), the router always renormalises its top-k, plus a shared
  expert behind a sigmoid gate.
"""
from __future__ import annotations

import json
import os
from typing import Callable

import numpy as np

from appliance.native.busy_responder import GIL_BOUND

from .. import qwen3
from ..config import Qwen3Config, UnsupportedModelError
from ..quant_weights import half_weight
from ..qwen3_5 import (
    FULL,
    GatedAttention,
    GatedDeltaNet,
    Layer as HybridLayer,
    MtpHead,
    Qwen35Config,
    Qwen35Model,
    SharedExpertMoE,
)
from ..qwen3_5_vl import Qwen35VLModel
from ..qwen3_moe import ExpertLoadStats, Experts, MoEConfig, SparseMoE
from ..qwen3_vl import Qwen3VLModel
from ..safetensors import SafeTensors, SafetensorsError, to_float32
from ..weights import DenseWeight
from . import Checkpoint, LoadOptions, ModelFileError, ModelLoadError, UnsafeTemplate
from .hf_check import check_decoder
from .hf_vision import has_tensors_under, hf_vision_tower, native_available, tensor_prefix
from .names import EXPERT_PROJECTIONS, HFNames
from .phases import Phases


def read_hf_dir(path: str, options: LoadOptions, phases: Phases | None = None) -> Checkpoint:
    phases = phases if phases is not None else Phases()
    from ..chat_template import ChatTemplate, UnsafeTemplateError
    from ..tokenizer import Tokenizer

    phases.mark("imports (tokenizer and template)")

    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise ModelLoadError(f"no config.json in {path}")
    cfg_dict = read_json(cfg_path)
    model_type = cfg_dict.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ModelFileError(f"unsupported model type {model_type!r} (supported: {', '.join(sorted(ARCHITECTURES))})")
    try:
        st = SafeTensors(path)
        cfg, model = ARCHITECTURES[model_type](st, cfg_dict, options)
        phases.mark("weights")
        with GIL_BOUND.section("tokenizer"):  # tokenizer.json is parsed and built holding the GIL
            tokenizer = Tokenizer.from_dir(path)
        phases.mark("tokenizer")
        template = ChatTemplate.from_dir(path)
        phases.mark("chat template")
    except UnsafeTemplateError as e:
        raise UnsafeTemplate(f"cannot load {path}: {e}") from None
    except (SafetensorsError, UnsupportedModelError, KeyError, ValueError, TypeError, OSError) as e:
        raise ModelFileError(f"cannot load {path}: {e}") from None
    gen_cfg = read_json(os.path.join(path, "generation_config.json"))
    return Checkpoint(cfg, model, tokenizer, template, eos_ids_of(gen_cfg, cfg_dict, tokenizer), gen_cfg,
                      task_hint=embedding_hint(path, cfg_dict))


ST_POOLING = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}


def embedding_hint(path: str, cfg_dict: dict) -> dict | None:
    """What a directory says about being an embedding model: sentence-transformers' modules.json (a Pooling
    module, whose config.json names the pooling; a Normalize module), or a bare `Qwen3Model` (no LM head:
    last-token pooling, normalised, as Qwen3-Embedding). A module we do not run (Dense) is refused."""
    modules = read_json(os.path.join(path, "modules.json"))
    if isinstance(modules, list) and modules:
        kinds = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules if isinstance(m, dict)}
        unknown = set(kinds) - {"Transformer", "Pooling", "Normalize"}
        if unknown:
            raise ModelLoadError(f"sentence-transformers module(s) {', '.join(sorted(unknown))} are not supported "
                                 f"(modules.json)")
        if "Pooling" in kinds:
            pdir = str(kinds["Pooling"].get("path") or "1_Pooling")
            pcfg = read_json(os.path.join(path, pdir, "config.json"))
            modes = [mode for key, mode in ST_POOLING.items() if pcfg.get(key)]
            others = [k for k, v in pcfg.items() if k.startswith("pooling_mode_") and v and k not in ST_POOLING]
            if len(modes) != 1 or others:
                raise ModelLoadError(f"{pdir}/config.json: pooling {', '.join(others + modes) or 'none'} is not "
                                     f"supported (one of: lasttoken, mean_tokens, cls_token)")
            return {"kind": "embedding", "pooling": modes[0], "normalize": "Normalize" in kinds,
                    "source": f"modules.json, {pdir}/config.json"}
    if "Qwen3Model" in (cfg_dict.get("architectures") or ()):
        return {"kind": "embedding", "pooling": "last", "normalize": True, "source": "config.json: Qwen3Model"}
    return None


def read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise ModelFileError(f"cannot read {path}: {e}") from None


def eos_ids_of(gen_cfg: dict, cfg: dict, tokenizer) -> set[int]:
    ids: set[int] = set()
    for src in (gen_cfg.get("eos_token_id"), cfg.get("eos_token_id")):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, list):
            ids.update(int(x) for x in src)
    if tokenizer.eos_token is not None and tokenizer.id_of(tokenizer.eos_token) is not None:
        ids.add(tokenizer.id_of(tokenizer.eos_token))
    return ids


# ---- weights --------------------------------------------------------------------------------------------

def dense_weight(st: SafeTensors, name: str):
    """A linear weight: BF16/F16 matrices read in place by the native kernels when the library is there (no
    float32 copy); otherwise, and for F32, a float32 DenseWeight."""
    raw, dtype = st.raw(name)
    if dtype in ("BF16", "F16") and raw.ndim == 2 and native_available():
        return half_weight(raw, dtype)
    return DenseWeight(to_float32(raw, dtype))


def expert_weight(raw: np.ndarray, dtype: str):
    """One expert matrix left in the mapping (a QuantWeight over its bits): the native kernels read BF16/F16 in
    place; without the library it is widened per use, never all experts at load."""
    if dtype in ("BF16", "F16"):
        return half_weight(raw, dtype)
    return DenseWeight(to_float32(raw, dtype))


# ---- text decoder (dense, MoE) --------------------------------------------------------------------------

def dense_mlp(st: SafeTensors, names: HFNames, i: int) -> qwen3.SwiGLU:
    return qwen3.SwiGLU(*(dense_weight(st, names.layer(i, role)) for role in ("gate", "up", "down")))


def build_decoder(st: SafeTensors, cfg: Qwen3Config, mlp_for_layer: Callable[[int], Callable],
                  names: HFNames = HFNames()) -> qwen3.Qwen3Model:
    def opt(i, role):
        name = names.layer(i, role)
        return st.float32(name) if name in st else None

    layers = []
    for i in range(cfg.num_hidden_layers):
        q, k, v, o = (dense_weight(st, names.layer(i, role)) for role in ("q", "k", "v", "o"))
        attn = qwen3.Attention(
            q, k, v, o, q_norm=opt(i, "q_norm"), k_norm=opt(i, "k_norm"),
            q_bias=opt(i, "q_bias"), k_bias=opt(i, "k_bias"), v_bias=opt(i, "v_bias"))
        layers.append(qwen3.Layer(st.float32(names.layer(i, "attn_norm")), attn,
                                  st.float32(names.layer(i, "mlp_norm")), mlp_for_layer(i)))
    embed = dense_weight(st, names.model("embed"))
    untied = not cfg.tie_word_embeddings and names.model("lm_head") in st
    lm_head = dense_weight(st, names.model("lm_head")) if untied else embed
    return qwen3.Qwen3Model(cfg, embed, layers, st.float32(names.model("norm")), lm_head)


def build_qwen3(st: SafeTensors, cfg_dict: dict, options: LoadOptions = LoadOptions()):
    cfg = Qwen3Config.from_dict(cfg_dict)
    # a bare Qwen3Model (Qwen3-Embedding) is saved without the "model." prefix and without an LM head
    names = HFNames("model." if any(k.startswith("model.") for k in st.keys()) else "")
    check_decoder(st, cfg, names)
    return cfg, build_decoder(st, cfg, lambda i: dense_mlp(st, names, i), names)


def hf_experts(st: SafeTensors, names: HFNames, i: int, n: int) -> Experts:
    """Layer i's n experts from per-expert tensors or transformers-5's fused pair (see names.py)."""
    if names.fused_experts(i, "gate_up") in st:
        gu, gu_dt = st.raw(names.fused_experts(i, "gate_up"))  # (E, 2I, H): gate rows, then up rows
        dn, dn_dt = st.raw(names.fused_experts(i, "down"))  # (E, H, I)
        half = gu.shape[1] // 2
        return Experts([expert_weight(gu[j, :half], gu_dt) for j in range(n)],  # row slices stay contiguous
                       [expert_weight(gu[j, half:], gu_dt) for j in range(n)],
                       [expert_weight(dn[j], dn_dt) for j in range(n)])
    return Experts(*([expert_weight(*st.raw(names.expert(i, j, proj))) for j in range(n)]
                     for proj in EXPERT_PROJECTIONS))


def build_qwen3_moe(st: SafeTensors, cfg_dict: dict, options: LoadOptions = LoadOptions()):
    cfg = Qwen3Config.from_dict(cfg_dict)
    moe = MoEConfig.from_dict(cfg_dict)
    stats = ExpertLoadStats()
    names = HFNames()
    check_decoder(st, cfg, names, moe)

    def mlp_for_layer(i: int):
        if not moe.is_sparse(i):
            return dense_mlp(st, names, i)
        router = st.float32(names.layer(i, "router"))  # (E, hidden)
        return SparseMoE(i, router, hf_experts(st, names, i, moe.num_experts), moe, stats)

    model = build_decoder(st, cfg, mlp_for_layer)
    model.expert_stats = stats
    model.moe_config = moe
    return cfg, model


# ---- Qwen3-VL (text decoder + vision tower: hf_vision.py) ------------------------------------------------

def vl_experts(st: SafeTensors, names: HFNames, i: int, moe: MoEConfig, hidden: int) -> Experts:
    """Layer i's experts of a Qwen3-VL-MoE checkpoint, fused in one of two layouts: transformers-5's own
    (gate_up_proj (E, 2I, H), down_proj (E, H, I): hf_experts reads it in place) or the published one, transposed
    (gate_up_proj (E, H, 2I) with gate columns first, down_proj (E, I, H)), which transformers transposes at load
    when the shape says so; we do the same, each expert's (out, in) matrix a copy in the stored dtype, once."""
    n, two_i = moe.num_experts, 2 * moe.moe_intermediate_size
    gu, gu_dt = st.raw(names.fused_experts(i, "gate_up"))
    if gu.shape == (n, two_i, hidden):
        return hf_experts(st, names, i, n)
    if gu.shape != (n, hidden, two_i):
        raise ValueError(f"{names.fused_experts(i, 'gate_up')} has shape {gu.shape}; expected "
                         f"{(n, two_i, hidden)} or {(n, hidden, two_i)}")
    dn, dn_dt = st.raw(names.fused_experts(i, "down"))  # (E, I, H)
    half = two_i // 2

    def t(a: np.ndarray, dt: str):
        return expert_weight(np.ascontiguousarray(a.T), dt)  # (out, in)

    return Experts([t(gu[j, :, :half], gu_dt) for j in range(n)], [t(gu[j, :, half:], gu_dt) for j in range(n)],
                   [t(dn[j], dn_dt) for j in range(n)])


def build_qwen3_vl_moe(st: SafeTensors, cfg_dict: dict, options: LoadOptions = LoadOptions()):
    """Qwen3VLMoeForConditionalGeneration (Qwen3-VL-30B-A3B): the MoE block under the Qwen3-VL text side. Its
    router always renormalises the top-k weights (the config does not say norm_topk_prob)."""
    moe = MoEConfig.from_dict({**cfg_dict["text_config"], "norm_topk_prob": True})
    stats = ExpertLoadStats()

    def mlp(names: HFNames):
        def mlp_for_layer(i: int):
            if not moe.is_sparse(i):
                return dense_mlp(st, names, i)
            experts = vl_experts(st, names, i, moe, int(cfg_dict["text_config"]["hidden_size"]))
            return SparseMoE(i, st.float32(names.layer(i, "router")), experts, moe, stats)
        return mlp_for_layer

    cfg, model = build_qwen3_vl(st, cfg_dict, options, mlp)
    model.text.expert_stats, model.text.moe_config = stats, moe
    return cfg, model


def build_qwen3_vl(st: SafeTensors, cfg_dict: dict, options: LoadOptions = LoadOptions(), mlp=None):
    """A Hugging Face Qwen3VLForConditionalGeneration directory's tensors and config.json (the image
    processor's settings come from preprocessor_config.json beside them, capped by options.image_max_pixels).
    `mlp(names) -> mlp_for_layer` builds the text side's MLPs (dense SwiGLU by default; MoE for qwen3_vl_moe)."""
    text_d = dict(cfg_dict["text_config"])
    if "tie_word_embeddings" in cfg_dict:
        text_d["tie_word_embeddings"] = cfg_dict["tie_word_embeddings"]
    rope = text_d.get("rope_parameters") or text_d.get("rope_scaling") or {}
    t_sec, h_sec, w_sec = (int(x) for x in rope.get("mrope_section", (24, 20, 20)))
    section = (t_sec, h_sec, w_sec)
    cfg = Qwen3Config.from_dict({**text_d, "model_type": "qwen3"})
    if sum(section) != cfg.head_dim // 2:
        raise ValueError(f"mrope_section {section} does not cover head_dim {cfg.head_dim}")
    names = HFNames(tensor_prefix(st, "model.language_model.", "language_model.model.", "model."))
    if mlp is None:  # the MoE text side's experts are checked as they are read (hf_experts)
        check_decoder(st, cfg, names)
    text = build_decoder(st, cfg, mlp(names) if mlp else (lambda i: dense_mlp(st, names, i)), names)
    vision, processor = hf_vision_tower(st, cfg_dict["vision_config"], options, cfg.hidden_size)
    model = Qwen3VLModel(cfg, text, vision, processor, section, int(cfg_dict.get("image_token_id", 151655)))
    return cfg, model


def build_qwen3_5(st: SafeTensors, cfg_dict: dict, options: LoadOptions = LoadOptions()):
    """Qwen3.5 dense or MoE (hybrid linear / full attention); its quirks are listed at the top of this module."""
    cfg = Qwen35Config.from_dict(cfg_dict)
    p = tensor_prefix(st, "model.language_model.", "model.")
    names = HFNames(p)

    def norm(name: str) -> np.ndarray:
        return (st.float32(name) + np.float32(1.0)).astype(np.float32)

    moe = None
    stats = ExpertLoadStats()
    if cfg.num_experts:
        moe = MoEConfig(cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, norm_topk_prob=True)

    def mlp(i: int, names: HFNames = names, stats_layer: int | None = None):
        if moe is None:
            return qwen3.SwiGLU(*(dense_weight(st, names.layer(i, r)) for r in ("gate", "up", "down")))
        q = names.qwen35
        routed = SparseMoE(i if stats_layer is None else stats_layer, st.float32(q(i, "router")),
                           hf_experts(st, names, i, moe.num_experts), moe, stats)
        shared = qwen3.SwiGLU(*(dense_weight(st, q(i, r)) for r in ("shared_gate_proj", "shared_up", "shared_down")))
        return SharedExpertMoE(routed, shared, st.float32(q(i, "shared_gate")))

    def attention(i: int, names: HFNames = names) -> GatedAttention:
        q, k, v, o = (dense_weight(st, names.layer(i, r)) for r in ("q", "k", "v", "o"))
        return GatedAttention(q, k, v, o, q_norm=norm(names.layer(i, "q_norm")), k_norm=norm(names.layer(i, "k_norm")))

    layers = []
    for i, kind in enumerate(cfg.layer_types):
        if kind == FULL:
            mixer: GatedAttention | GatedDeltaNet = attention(i)
        else:
            n = names.qwen35
            conv = st.float32(n(i, "conv"))
            mixer = GatedDeltaNet(
                qkv=dense_weight(st, n(i, "qkv")), z=dense_weight(st, n(i, "z")),
                b=dense_weight(st, n(i, "b")), a=dense_weight(st, n(i, "a")),
                conv=np.ascontiguousarray(conv.reshape(conv.shape[0], conv.shape[-1])),  # (conv_dim, K)
                A_log=st.float32(n(i, "A")), dt_bias=st.float32(n(i, "dt_bias")),
                norm=st.float32(n(i, "linear_norm")), out=dense_weight(st, n(i, "linear_out")))
            if mixer.conv.shape != (cfg.conv_dim, cfg.linear_conv_kernel_dim):
                raise ValueError(f"layer {i}: conv1d weight {conv.shape} does not match the config")
        layers.append(HybridLayer(norm(names.layer(i, "attn_norm")), mixer, norm(names.layer(i, "mlp_norm")), mlp(i)))
    embed = dense_weight(st, names.model("embed"))
    untied = not cfg.tie_word_embeddings and names.model("lm_head") in st
    lm_head = dense_weight(st, names.model("lm_head")) if untied else embed
    model = Qwen35Model(cfg, embed, layers, norm(names.model("norm")), lm_head)
    if cfg.mtp_layers and "mtp.fc.weight" in st:
        if cfg.mtp_layers != 1:
            raise UnsupportedModelError(f"mtp_num_hidden_layers {cfg.mtp_layers}: one MTP layer is served")
        m = HFNames("mtp.")
        head_layer = HybridLayer(norm(m.layer(0, "attn_norm")), attention(0, m), norm(m.layer(0, "mlp_norm")),
                                 mlp(0, m, stats_layer=cfg.num_hidden_layers))
        model.mtp = MtpHead(dense_weight(st, "mtp.fc.weight"), norm("mtp.pre_fc_norm_embedding.weight"),
                            norm("mtp.pre_fc_norm_hidden.weight"), head_layer, norm("mtp.norm.weight"))
    if moe is not None:
        model.expert_stats = stats  # type: ignore[attr-defined]
        model.moe_config = moe  # type: ignore[attr-defined]
    if "vision_config" in cfg_dict and has_tensors_under(st, "model.visual.", "visual."):
        vision, processor = hf_vision_tower(st, cfg_dict["vision_config"], options, cfg.hidden_size, deepstack=False)
        return cfg, Qwen35VLModel(cfg, model, vision, processor, int(cfg_dict.get("image_token_id", 248056)))
    return cfg, model


# model_type -> builder(SafeTensors, config dict, LoadOptions) -> (config, model)
ARCHITECTURES: dict[str, Callable] = {"qwen3": build_qwen3, "qwen2": build_qwen3, "llama": build_qwen3,
                                      "qwen3_moe": build_qwen3_moe, "qwen3_vl": build_qwen3_vl,
                                      "qwen3_5": build_qwen3_5, "qwen3_5_moe": build_qwen3_5,
                                      "qwen3_5_text": build_qwen3_5, "qwen3_5_moe_text": build_qwen3_5,
                                      "qwen3_vl_moe": build_qwen3_vl_moe}
