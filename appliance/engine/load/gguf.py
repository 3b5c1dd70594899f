"""GGUF files (llama.cpp's container) -> decoder objects: qwen3, qwen2, llama, qwen3moe, qwen3vl and qwen3vlmoe
architectures (qwen3vl/qwen3vlmoe: the Qwen3 / Qwen3-MoE decoder, with its mmproj vision projector when there is
one: gguf_vl.py); qwen35 / qwen35moe (Qwen3.5's hybrid decoder) are gguf_qwen35.py's, with their mmproj pair too.

Policies:
- The file is memory-mapped (gguf_file.GGUFFile, GGUFReader's view of it) and the weights stay in their stored form:
  quantized (and F16/BF16) matrices are wrapped in QuantWeight over the mapped bytes; F32 matrices are
  zero-copy DenseWeight views; only the small 1-D tensors (norms, biases) are read as float32 arrays.
- Configuration, tokenizer, chat template and stop ids all come from the file's own metadata (llama.cpp key
  names); nothing is looked up beside the file.
- Checkpoint quirks stay here: llama.cpp's converter permutes the llama architecture's q/k rows so ggml's
  interleaved RoPE applies; we put those rows back in Hugging Face order (a reorder of the quantized rows,
  done once at load) so the decoder's rotate-half RoPE stays the only RoPE. Qwen2/Qwen3 files are stored
  in Hugging Face order already.
- What we cannot compute exactly is refused with a one-line ModelLoadError: other architectures, RoPE
  scaling, partial rotary dimensions, non-BPE tokenizers; a weight of a type the kernels do not serve (IQ1/IQ2/
  IQ3 grids, TQ, MXFP4, ...) is an UnsupportedTensorType naming the tensor and its type (at load, when
  the weight is wrapped; nothing is computed first).
- Mixture of experts (`qwen3moe`, `qwen3vlmoe`): `blk.N.ffn_{gate,up,down}_exps.weight` hold all experts of a
  layer in one tensor (ne = [in, out, E]); each expert is a zero-copy slice of the mapped block data wrapped in
  QuantWeight (never rearranged into a copy), so decode reads only the routed experts' bytes and resident memory
  follows the experts in use. A layer is sparse when it has a router (`ffn_gate_inp`), dense otherwise.
  llama.cpp always renormalises the top-k weights for qwen3moe and qwen3vlmoe, so the file's MoE config says
  norm_topk_prob=True unless the file states `expert_weights_norm`.
"""
from __future__ import annotations

import logging
from typing import Any

import numpy as np

from appliance.native.busy_responder import GIL_BOUND

from .. import qwen3
from ..config import Qwen3Config
from ..qwen3_moe import ExpertLoadStats, Experts, MoEConfig, SparseMoE
from ..weights import DenseWeight
from . import Checkpoint, LoadOptions, MismatchedPair, ModelFileError, UnsafeTemplate, UnsupportedTensorType
from .gguf_check import (
    MAX_CONTEXT,
    MAX_EXPERTS,
    MAX_HEADS,
    MAX_LAYERS,
    MAX_VOCAB,
    MAX_WIDTH,
    check_tensors,
    f32_value,
    meta_float,
    meta_int,
    meta_list,
    meta_str,
)
from .gguf_file import GGUFFile
from .gguf_qwen35 import QWEN35_ARCHITECTURES, build_qwen35, qwen35_config
from .gguf_vl import (
    NO_MMPROJ_HINT,
    VL_ARCHITECTURES,
    MmprojFile,
    find_mmproj,
    qwen3_vl_from_pair,
    qwen35_from_pair,
)
from .gguf_weights import GGUFModelFile, expert_slices
from .names import EXPERT_PROJECTIONS, gguf_experts, gguf_layer, gguf_model
from .phases import Phases

log = logging.getLogger("appliance.load")
SUPPORTED_ARCHITECTURES = ("qwen3", "qwen2", "llama", "qwen3moe", "qwen3vl", "qwen3vlmoe")
MOE_ARCHITECTURES = ("qwen3moe", "qwen3vlmoe")
# GGUF general.sampling.* -> generation_config.json names (what LoadedModel.default_sampling holds)
SAMPLING_KEYS = {"temp": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                 "penalty_repeat": "repetition_penalty"}


def open_gguf(path: str) -> GGUFFile:
    """The file's metadata and tensors over a read-only mapping (gguf_file.GGUFFile)."""
    return GGUFFile(path)


def read_metadata(reader) -> dict[str, Any]:
    """All key/value fields of a GGUFFile (or GGUFReader) as Python values (strings decoded, arrays as lists)."""
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        meta[key] = field.contents()
    return meta


def unpermute_rows(n_rows: int, n_head: int) -> np.ndarray:
    """Row order that turns llama.cpp's permuted q/k rows (pairs interleaved per head) back into Hugging
    Face order (first halves, then second halves): hf = gguf[unpermute_rows(...)]."""
    hd = n_rows // n_head
    idx = np.arange(n_rows).reshape(n_head, hd // 2, 2)  # gguf row of (head, pair p, half s)
    return idx.transpose(0, 2, 1).reshape(n_rows)  # hf row h*hd + s*hd/2 + p <- gguf row h*hd + 2p + s


def config_from_metadata(meta: dict[str, Any], f: GGUFModelFile) -> Qwen3Config:
    """The decoder's configuration from the file's own keys, each typed and bounded (gguf_check.meta_int ...)."""
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {arch!r} (supported: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES + QWEN35_ARCHITECTURES)})")

    def key(name, default=None, hi=MAX_WIDTH):
        return meta_int(meta, f"{arch}.{name}", default, 1, hi)

    scaling = meta_str(meta, f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", None) or "rope_freqs.weight" in f:
        raise ValueError(f"rope scaling {scaling if scaling != 'none' else 'llama3 (rope_freqs)'!r} is not supported")
    hidden, heads = key("embedding_length"), key("attention.head_count", hi=MAX_HEADS)
    head_dim = key("attention.key_length", max(1, hidden // heads), hi=MAX_WIDTH)
    if key("attention.value_length", head_dim) != head_dim:
        raise ValueError(f"metadata key {arch}.attention.value_length differs from the key length {head_dim}")
    if head_dim % 2:
        raise ValueError(f"metadata key {arch}.attention.key_length: head size {head_dim} is odd (RoPE pairs)")
    if key("rope.dimension_count", head_dim) != head_dim:
        raise ValueError("partial rotary embeddings are not supported")
    kv_heads = key("attention.head_count_kv", heads, hi=heads)
    if heads % kv_heads:
        raise ValueError(f"metadata key {arch}.attention.head_count_kv: {kv_heads} does not divide {heads} heads")
    tokens = meta_list(meta, "tokenizer.ggml.tokens", str)
    vocab = len(tokens) if tokens else key("vocab_size", hi=MAX_VOCAB)
    if key("vocab_size", vocab, hi=MAX_VOCAB) != vocab:
        raise ValueError(f"metadata key {arch}.vocab_size differs from the {vocab} tokens of tokenizer.ggml.tokens")
    return Qwen3Config(
        model_type=arch, vocab_size=vocab, hidden_size=hidden,
        intermediate_size=key("feed_forward_length"), num_hidden_layers=key("block_count", hi=MAX_LAYERS),
        num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, rms_norm_eps=f32_value(meta_float(meta, f"{arch}.attention.layer_norm_rms_epsilon",
                                                             1e-6, 0.0, 1.0)),
        rope_theta=f32_value(meta_float(meta, f"{arch}.rope.freq_base", 10000.0, 0.0, 1e12)),
        max_position_embeddings=key("context_length", hi=MAX_CONTEXT),
        tie_word_embeddings=gguf_model("lm_head") not in f,
        qk_norm=gguf_layer(0, "q_norm") in f, attention_bias=gguf_layer(0, "q_bias") in f)


def build_model(cfg: Qwen3Config, f: GGUFModelFile, meta: dict[str, Any] | None = None) -> qwen3.Qwen3Model:
    """The decoder over GGUF tensor names (blk.N.attn_q.weight, ...), once the tensor set and its shapes are
    checked against the config (gguf_check.check_tensors: before any tensor is wrapped)."""
    moe = moe_config_from_metadata(meta or {}, cfg.model_type) if cfg.model_type in MOE_ARCHITECTURES else None
    rank = (meta or {}).get(f"{cfg.model_type}.pooling_type") == GGUF_POOLING_RANK  # a reranker's yes/no head
    check_tensors(f.tensors, cfg, moe, frozenset({"cls.output.weight"}) if rank else frozenset())
    stats = ExpertLoadStats()
    permuted = cfg.model_type == "llama"
    q_order = unpermute_rows(cfg.num_attention_heads * cfg.head_dim, cfg.num_attention_heads) if permuted else None
    k_order = unpermute_rows(cfg.num_key_value_heads * cfg.head_dim, cfg.num_key_value_heads) if permuted else None

    def opt(i, role, order=None):
        name = gguf_layer(i, role)
        if name not in f:
            return None
        v = f.vector(name)
        return v if order is None else v[order]

    layers = []
    for i in range(cfg.num_hidden_layers):
        attn = qwen3.Attention(
            q=f.matrix(gguf_layer(i, "q"), q_order), k=f.matrix(gguf_layer(i, "k"), k_order),
            v=f.matrix(gguf_layer(i, "v")), o=f.matrix(gguf_layer(i, "o")),
            q_norm=opt(i, "q_norm"), k_norm=opt(i, "k_norm"),
            q_bias=opt(i, "q_bias", q_order), k_bias=opt(i, "k_bias", k_order), v_bias=opt(i, "v_bias"))
        mlp = moe_mlp(f, i, stats, moe) if moe is not None else None
        if mlp is None:
            mlp = qwen3.SwiGLU(*(f.matrix(gguf_layer(i, role)) for role in ("gate", "up", "down")))
        layers.append(qwen3.Layer(f.vector(gguf_layer(i, "attn_norm")), attn, f.vector(gguf_layer(i, "mlp_norm")), mlp))
    embed = f.matrix(gguf_model("embed"))
    lm_head = embed if cfg.tie_word_embeddings else f.matrix(gguf_model("lm_head"))
    model = qwen3.Qwen3Model(cfg, embed, layers, f.vector(gguf_model("norm")), lm_head)
    if moe is not None:
        model.expert_stats, model.moe_config = stats, moe
    return model


# ---- mixture of experts ---------------------------------------------------------------------------------

def moe_config_from_metadata(meta: dict, arch: str) -> MoEConfig:
    n = meta_int(meta, f"{arch}.expert_count", None, 1, MAX_EXPERTS)
    return MoEConfig(num_experts=n, num_experts_per_tok=meta_int(meta, f"{arch}.expert_used_count", None, 1, n),
                     moe_intermediate_size=meta_int(meta, f"{arch}.expert_feed_forward_length", None, 1, MAX_WIDTH),
                     norm_topk_prob=bool(meta.get(f"{arch}.expert_weights_norm", True)))


def moe_mlp(f, layer: int, stats: ExpertLoadStats, moe: MoEConfig):
    """The MLP of layer `layer`: SparseMoE if the layer has a router, None to let the caller build a dense one."""
    if gguf_layer(layer, "router") not in f:
        return None
    router = f.matrix(gguf_layer(layer, "router"))
    router = router.w if isinstance(router, DenseWeight) else router.dequantize()  # (E, hidden) float32
    gates, ups, downs = (expert_slices(f.tensors[gguf_experts(layer, proj)]) for proj in EXPERT_PROJECTIONS)
    return SparseMoE(layer, router, Experts(gates, ups, downs), moe, stats)


def model_from_file(meta: dict[str, Any], f: GGUFModelFile):
    """(config, decoder) of the file's architecture: Qwen3.5's hybrid decoder or the Qwen3 family's."""
    if meta.get("general.architecture") in QWEN35_ARCHITECTURES:
        q35 = qwen35_config(meta, f.tensors)
        return q35, build_qwen35(q35, f, meta)
    cfg = config_from_metadata(meta, f)
    return cfg, build_model(cfg, f, meta)


def default_sampling(meta: dict[str, Any]) -> dict:
    out = {}
    for k, name in SAMPLING_KEYS.items():
        if f"general.sampling.{k}" in meta:
            out[name] = meta[f"general.sampling.{k}"]
    return out


def read_gguf(path: str, options: LoadOptions, phases: Phases | None = None) -> Checkpoint:
    """A .gguf file's model, tokenizer, template, stop ids and sampling defaults (see load.load_model);
    its parts are marked in `phases`."""
    phases = phases if phases is not None else Phases()
    from ..chat_template import ChatTemplate, ChatTemplateError, UnsafeTemplateError
    from ..gguf_tokenizer import build_tokenizer, chat_templates, eog_ids

    phases.mark("imports (tokenizer and template)")
    try:
        reader = open_gguf(path)
    except (ValueError, OSError, IndexError, KeyError) as e:  # not a GGUF, truncated, unknown type...
        raise ModelFileError(f"cannot read GGUF file {path}: {e}") from None
    try:
        meta = read_metadata(reader)
        phases.mark("model file")
        f = GGUFModelFile(reader)
        cfg, model = model_from_file(meta, f)
        phases.mark("weights")
        with GIL_BOUND.section("tokenizer"):  # the tokenizers library holds the GIL while it builds the BPE
            tokenizer = build_tokenizer(meta)
        phases.mark("tokenizer")
        task_hint = pooling_hint(meta, f)
        source = chat_templates(meta)
        if source is None and task_hint is not None:  # an embedding file need not carry one (/apply-template only)
            source = PLAIN_TEMPLATE
        if source is None or not isinstance(source, (str, dict)):
            raise ValueError("no chat template in the metadata (tokenizer.chat_template)")
        template = ChatTemplate(source, tokenizer.special_tokens)
        phases.mark("chat template")
        eos = eog_ids(meta)
        model, hint = with_vision(path, cfg, model, meta, tokenizer, options)
        phases.mark("vision projector")
    except (UnsupportedTensorType, MismatchedPair) as e:
        raise type(e)(f"cannot load {path}: {e}") from None
    except UnsafeTemplateError as e:
        raise UnsafeTemplate(f"cannot load {path}: {e}") from None
    except (KeyError, ValueError, ChatTemplateError) as e:
        raise ModelFileError(f"cannot load {path}: {e}") from None
    return Checkpoint(cfg, model, tokenizer, template, eos, default_sampling(meta), images_hint=hint,
                      task_hint=task_hint)


def with_vision(path: str, cfg, text, meta: dict[str, Any], tokenizer, options: LoadOptions):
    """(model, images_hint): a qwen3vl or qwen35 text model with its mmproj pair (gguf_vl.py), or the text model
    alone (and the hint a refused image part gets); other architectures refuse --mmproj."""
    if cfg.model_type not in VL_ARCHITECTURES + QWEN35_ARCHITECTURES:
        if options.mmproj:
            raise ValueError(f"--mmproj goes with a Qwen3-VL or Qwen3.5 text model; this one is {cfg.model_type!r}")
        return text, ""
    qwen35 = cfg.model_type in QWEN35_ARCHITECTURES
    mmproj = find_mmproj(path, options.mmproj)
    if mmproj is None:
        log.warning("%s is the text model of a %s pair and no vision projector is loaded: text only; image parts "
                    "are refused until the server starts with --mmproj mmproj.gguf", path,
                    "Qwen3.5" if qwen35 else "Qwen3-VL")
        return text, NO_MMPROJ_HINT.replace("Qwen3-VL", "Qwen3.5") if qwen35 else NO_MMPROJ_HINT
    pair = qwen35_from_pair if qwen35 else qwen3_vl_from_pair
    return pair(cfg, text, meta, tokenizer, open_mmproj(mmproj), options), ""


def open_mmproj(path: str) -> MmprojFile:
    """A vision projector file (clip GGUF) over its own read-only mapping."""
    try:
        reader = open_gguf(path)
    except (ValueError, OSError, IndexError, KeyError) as e:
        raise ModelFileError(f"cannot read the mmproj file {path}: {e}") from None
    return MmprojFile(path, read_metadata(reader), GGUFModelFile(reader))


# llama.cpp's enum llama_pooling_type as `<arch>.pooling_type` stores it
GGUF_POOLING = {1: "mean", 2: "cls", 3: "last"}
GGUF_POOLING_RANK = 4
PLAIN_TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"


def special_affixes(meta: dict[str, Any]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The BOS / EOS llama.cpp's tokenizer adds to a text (tokenizer.ggml.add_bos_token / add_eos_token; the
    converter writes add_eos_token for Qwen3-Embedding, whose tokenizer appends <|endoftext|>)."""
    def flag(name: str) -> tuple[int, ...]:
        tid = meta.get(f"tokenizer.ggml.{name}_token_id")
        return (int(tid),) if meta.get(f"tokenizer.ggml.add_{name}_token") and tid is not None else ()
    return flag("bos"), flag("eos")


def pooling_hint(meta: dict[str, Any], f: GGUFModelFile) -> dict | None:
    """`<arch>.pooling_type` as llama.cpp's converter writes it: MEAN/CLS/LAST an embedding model (llama.cpp
    normalises pooled embeddings), RANK a reranker whose `cls.output.weight` holds the "yes" and "no" rows of
    the LM head (Qwen3-Reranker). NONE or absent: a generative model."""
    arch = meta.get("general.architecture")
    kind = meta.get(f"{arch}.pooling_type")
    if kind is None or int(kind) == 0:
        return None
    src = f"{arch}.pooling_type {int(kind)}"
    if int(kind) in GGUF_POOLING:
        return {"kind": "embedding", "pooling": GGUF_POOLING[int(kind)], "normalize": True, "source": src,
                "affixes": special_affixes(meta)}
    if int(kind) == GGUF_POOLING_RANK:
        if "cls.output.weight" not in f or "cls.weight" in f:
            raise ValueError("a reranker (pooling_type RANK) is served with a 2-row cls.output.weight head only")
        head = f.matrix("cls.output.weight")
        rows = head.rows(np.arange(head.shape[0]))  # (2, hidden): "yes", "no"
        if rows.shape[0] != 2:
            raise ValueError(f"cls.output.weight has {rows.shape[0]} rows; a yes/no reranker has 2")
        labels = [str(x) for x in (meta.get(f"{arch}.classifier.output_labels") or ("yes", "no"))]
        if sorted(labels) != ["no", "yes"]:
            raise ValueError(f"classifier labels {labels} are not a yes/no reranker's")
        order = [labels.index("yes"), labels.index("no")]
        return {"kind": "rerank", "head": np.ascontiguousarray(rows[order], dtype=np.float32), "source": src}
    raise ValueError(f"pooling type {int(kind)} is not supported")
