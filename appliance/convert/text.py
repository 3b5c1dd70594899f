"""The text side of `kestrel-appliance convert` (the package's __init__ dispatches): a dense or MoE Hugging Face
checkpoint written tensor by tensor into a GGUF file that both this engine and llama.cpp load.

Policies:
- Architectures: qwen3, qwen2, llama (dense) and qwen3_moe (experts per-expert or transformers-5 fused, stacked
  per projection as llama.cpp's qwen3moe stores them); qwen3_vl / qwen3_vl_moe go to vl.py (a text
  file plus mmproj-OUT.gguf, `--mmproj-type`), which shares this module's plan, types and writer. Tensor names come from engine/load/names.py, the table
  the loaders use too. The file carries what llama.cpp needs to run it on its own:
  architecture hyper-parameters, the byte-level BPE tokenizer (`gpt2` model, `pre` chosen from the
  tokenizer.json split regex, tokens padded to the embedding size, token types as llama.cpp's converter sets
  them (added tokens CONTROL when special or spelled <|...|>, else USER_DEFINED), merges), special ids,
  add_bos flag and the chat template.
- Tensor types: every 2-D weight gets the requested type, except rows whose length is not a multiple of
  the block size (32), which fall back to F16 as llama.cpp's converter does; 1-D tensors (norms, biases)
  stay F32. Quantization uses the `gguf` package's reference quantizers (bit-exact with ggml's).
- llama checkpoints get llama.cpp's q/k row permutation (its RoPE pairs adjacent elements); qwen2/qwen3 are
  written in Hugging Face order. The loader undoes the permutation, so a round trip is exact.
- Tensors are converted and written one at a time (the output is never held in memory; quantized a block of
  rows at a time), to OUT.tmp and renamed at the end; a progress bar goes to stderr. Bad input is a one-line error and exit status 2.
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from gguf import GGMLQuantizationType

TYPES = {"f32": "F32", "f16": "F16", "q8_0": "Q8_0", "q4_0": "Q4_0"}
FILE_TYPES = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "q8_0": "MOSTLY_Q8_0", "q4_0": "MOSTLY_Q4_0"}
ARCHITECTURES = ("qwen3", "qwen2", "llama", "qwen3_moe")
GGUF_ARCH = {"qwen3_moe": "qwen3moe"}  # Hugging Face model_type -> llama.cpp architecture name, where they differ
class ConvertError(Exception):
    """The input cannot be converted; the message is one line for the user."""


def permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k permutation for the llama architecture (rows of each head: halves -> pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def split_regex_of(tokenizer_json: dict) -> str:
    """The `tokenizer.ggml.pre` name matching a tokenizer.json pre-tokenizer (llama.cpp's names)."""
    from appliance.engine.gguf_tokenizer import LLAMA3_SPLIT, QWEN2_SPLIT

    text = json.dumps(tokenizer_json.get("pre_tokenizer"))
    for name, regex in (("qwen2", QWEN2_SPLIT), ("llama-bpe", LLAMA3_SPLIT)):
        if json.dumps(regex)[1:-1] in text:
            return name
    pre = tokenizer_json.get("pre_tokenizer") or {}
    kinds = [p.get("type") for p in pre.get("pretokenizers", [pre])]
    if kinds == ["Digits", "ByteLevel"]:
        return "smollm"
    if kinds == ["ByteLevel"]:
        return "gpt2"
    raise ConvertError(f"unrecognised pre-tokenizer {text[:120]}")


def _content(v):
    return v.get("content") if isinstance(v, dict) else v


def write_tokenizer(writer, model_dir: str, vocab_size: int, config: dict) -> None:
    """tokenizer.ggml.* and tokenizer.chat_template from a Hugging Face directory's tokenizer files."""
    import gguf

    from appliance.engine.chat_template import ChatTemplate

    with open(os.path.join(model_dir, "tokenizer.json"), encoding="utf-8") as f:
        tj = json.load(f)
    tok_cfg = {}
    if os.path.isfile(os.path.join(model_dir, "tokenizer_config.json")):
        with open(os.path.join(model_dir, "tokenizer_config.json"), encoding="utf-8") as f:
            tok_cfg = json.load(f)
    if tj["model"]["type"] != "BPE":
        raise ConvertError(f"tokenizer model {tj['model']['type']} is not supported (byte-level BPE only)")
    pre = split_regex_of(tj)
    by_id: dict[int, tuple[str, int]] = {i: (t, gguf.TokenType.NORMAL) for t, i in tj["model"]["vocab"].items()}
    for a in tj.get("added_tokens", []):  # llama.cpp's rule: an added token spelled <|...|> is CONTROL even when
        control = a["special"] or (a["content"].startswith("<|") and a["content"].endswith("|>"))  # not special
        by_id[a["id"]] = (a["content"], gguf.TokenType.CONTROL if control else gguf.TokenType.USER_DEFINED)
    n = max(vocab_size, max(by_id) + 1)
    tokens = [by_id.get(i, (f"[PAD{i}]", gguf.TokenType.UNUSED)) for i in range(n)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list([t for t, _ in tokens])
    writer.add_token_types([int(ty) for _, ty in tokens])
    writer.add_token_merges(merges)
    ids = {t: i for i, (t, _) in enumerate(tokens)}

    def special(name: str, cfg_key: str):
        content = _content(tok_cfg.get(name))
        if content is not None and content in ids:
            return ids[content]
        v = config.get(cfg_key)
        return v[0] if isinstance(v, list) else v

    for adder, name, key in ((writer.add_bos_token_id, "bos_token", "bos_token_id"),
                             (writer.add_eos_token_id, "eos_token", "eos_token_id"),
                             (writer.add_pad_token_id, "pad_token", "pad_token_id")):
        i = special(name, key)
        if i is not None:
            adder(int(i))
    writer.add_add_bos_token(bool(tok_cfg.get("add_bos_token", False)))
    sources = ChatTemplate.from_dir(model_dir).sources
    if list(sources) == ["default"]:
        writer.add_chat_template(sources["default"])
    else:
        writer.add_chat_template([{"name": k, "template": v} for k, v in sources.items()])


def write_hparams(writer, cfg, name: str, file_type: str, moe=None) -> None:
    """Architecture keys (`{arch}.*`) from a Qwen3Config, plus general.* and the file type."""
    import gguf

    writer.add_name(name)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    if moe is not None:
        writer.add_expert_count(moe.num_experts)
        writer.add_expert_used_count(moe.num_experts_per_tok)
        writer.add_expert_feed_forward_length(moe.moe_intermediate_size)
    writer.add_file_type(getattr(gguf.LlamaFileType, file_type))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


@dataclass(frozen=True)
class Source:
    """Where one GGUF tensor's values come from: one checkpoint tensor, or one per expert stacked into (E, out,
    in), or one half of a fused gate_up tensor (`half` 0: gate, 1: up): transformers-5's (E, 2I, H) (rows), or
    with `transposed` the published Qwen3-VL-MoE layout (E, H, 2I) (columns; down_proj (E, I, H) is then
    transposed whole, half None); `frame` picks one temporal frame of a Conv3d kernel (out, C, T, p, p)."""
    names: tuple[str, ...]
    stacked: bool = False
    half: int | None = None
    permute: str | None = None  # 'q' | 'k': llama.cpp's row permutation (llama architecture only)
    transposed: bool = False
    frame: int | None = None

    def shape(self, st) -> tuple[int, ...]:
        shape = tuple(st.raw(self.names[0])[0].shape)
        if self.stacked:
            return (len(self.names),) + shape
        if self.frame is not None:
            return shape[:2] + shape[3:]
        if self.transposed:
            shape = (shape[0], shape[2], shape[1])
        if self.half is not None:
            return (shape[0], shape[1] // 2) + shape[2:]
        return shape

    def load(self, st, cfg) -> np.ndarray:
        from appliance.engine.safetensors import to_float32

        if self.stacked:
            return np.stack([to_float32(*st.raw(n)) for n in self.names])  # (E, out, in)
        raw, dtype = st.raw(self.names[0])
        if self.frame is not None:
            return to_float32(np.ascontiguousarray(raw[:, :, self.frame]), dtype)  # (out, C, p, p)
        if self.transposed:  # (E, in, out) as stored; the half is cut before widening (a bf16 copy, not f32)
            if self.half is not None:
                cols = raw.shape[2] // 2
                raw = raw[:, :, self.half * cols:(self.half + 1) * cols]  # (E, H, I)
            return to_float32(np.ascontiguousarray(raw.transpose(0, 2, 1)), dtype)  # (E, out, in)
        if self.half is not None:
            rows = raw.shape[1] // 2
            return to_float32(np.ascontiguousarray(raw[:, self.half * rows:(self.half + 1) * rows]), dtype)
        w = to_float32(raw, dtype)
        if self.permute is not None and cfg.model_type == "llama":
            heads = cfg.num_attention_heads if self.permute == "q" else cfg.num_key_value_heads
            w = permute_rows(w, heads)
        return w


def expert_sources(st, hf, i: int, moe, hidden: int) -> list[tuple[str, Source]]:
    """Layer i's experts, one stacked (E, out, in) tensor per projection, from any of the three layouts: one
    tensor per expert, transformers-5's fused (E, 2I, H) / (E, H, I), or the published Qwen3-VL-MoE fused
    (E, H, 2I) / (E, I, H) (told apart by shape, the (E, 2I, H) reading first, as transformers does)."""
    from appliance.engine.load.names import EXPERT_PROJECTIONS, gguf_experts

    if hf.fused_experts(i, "gate_up") not in st:
        return [(gguf_experts(i, proj), Source(tuple(hf.expert(i, j, proj) for j in range(moe.num_experts)),
                                               stacked=True)) for proj in EXPERT_PROJECTIONS]
    gate_up, down = hf.fused_experts(i, "gate_up"), hf.fused_experts(i, "down")
    two_i = 2 * moe.moe_intermediate_size
    shape = tuple(st.raw(gate_up)[0].shape)
    if shape not in ((moe.num_experts, two_i, hidden), (moe.num_experts, hidden, two_i)):
        raise ConvertError(f"{gate_up} has shape {list(shape)}; expected {[moe.num_experts, two_i, hidden]} or "
                           f"{[moe.num_experts, hidden, two_i]}")
    t = shape != (moe.num_experts, two_i, hidden)
    return [(gguf_experts(i, "gate"), Source((gate_up,), half=0, transposed=t)),
            (gguf_experts(i, "up"), Source((gate_up,), half=1, transposed=t)),
            (gguf_experts(i, "down"), Source((down,), transposed=t))]


def tensor_plan(st, cfg, moe=None, hf=None) -> list[tuple[str, Source]]:
    """(gguf name, Source) in llama.cpp's usual order, named through the one table (engine/load/names.py), the
    decoder's Hugging Face names under `hf` (HFNames; "model." by default). A mixture-of-experts layer's
    experts become one stacked tensor per projection."""
    from appliance.engine.load.names import LAYER_TENSORS, HFNames, gguf_layer, gguf_model

    hf = hf or HFNames()
    plan = [(gguf_model("embed"), Source((hf.model("embed"),)))]
    for i in range(cfg.num_hidden_layers):
        for role in LAYER_TENSORS:
            if role != "router" and hf.layer(i, role) in st:
                plan.append((gguf_layer(i, role), Source((hf.layer(i, role),),
                                                         permute=role if role in ("q", "k") else None)))
        if moe is None or hf.layer(i, "router") not in st:
            continue
        plan.append((gguf_layer(i, "router"), Source((hf.layer(i, "router"),))))
        plan.extend(expert_sources(st, hf, i, moe, cfg.hidden_size))
    plan.append((gguf_model("norm"), Source((hf.model("norm"),))))
    if not cfg.tie_word_embeddings and hf.model("lm_head") in st:
        plan.append((gguf_model("lm_head"), Source((hf.model("lm_head"),))))
    return plan


def text_types(plan: list[tuple[str, Source]], qtype_name: str) -> list[tuple[str, Source, str]]:
    """Each tensor's type: the requested one, but expert routers F32 (as llama.cpp keeps them)."""
    return [(name, src, "F32" if name.endswith("ffn_gate_inp.weight") else qtype_name) for name, src in plan]


QUANT_CHUNK = 1 << 22  # values quantized per step: the float32 temporaries of a 2.5 GB embedding stay ~100 MB


def encode_tensor(w: np.ndarray, qtype_name: str) -> tuple[np.ndarray, GGMLQuantizationType]:
    """float32 array -> (array to write, GGMLQuantizationType). Quantized a block of rows at a time (the
    quantizers work per row, so the bytes are those of one call on the whole)."""
    import gguf

    if w.ndim == 1 or qtype_name == "F32":
        return np.ascontiguousarray(w, dtype=np.float32), gguf.GGMLQuantizationType.F32
    qtype = getattr(gguf.GGMLQuantizationType, qtype_name)
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if qtype_name == "F16" or w.shape[-1] % block:
        return w.astype(np.float16), gguf.GGMLQuantizationType.F16
    rows = w.reshape(-1, w.shape[-1])  # (rows, in)
    step = max(1, QUANT_CHUNK // w.shape[-1])
    first = gguf.quants.quantize(rows[:step], qtype)  # (step, row bytes)
    out = np.empty((rows.shape[0], first.shape[1]), np.uint8)  # (rows, row bytes)
    out[:len(first)] = first
    for r in range(step, rows.shape[0], step):
        out[r:r + step] = gguf.quants.quantize(rows[r:r + step], qtype)
    return out.reshape(w.shape[:-1] + (first.shape[1],)), qtype


def write_tensors(writer, plan: list[tuple[str, Source, str]], st, cfg, progress_stream=None) -> None:
    """The header (metadata already added to writer), the tensor infos, then each tensor converted and written
    one at a time (its float32 copy freed and its mapped checkpoint pages released before the next is read);
    closes the writer."""
    from appliance.engine.page_release import release_pages

    infos = []
    for gg_name, src, qtype_name in plan:  # shapes and sizes first: the header precedes the data
        shape = src.shape(st)
        one_row, qtype = encode_tensor(np.zeros((1, shape[-1]) if len(shape) >= 2 else shape, np.float32),
                                       qtype_name)
        byte_shape = tuple(shape[:-1]) + one_row.shape[1:] if len(shape) >= 2 else one_row.shape
        nbytes = int(np.prod(byte_shape)) * one_row.itemsize
        writer.add_tensor_info(gg_name, byte_shape, one_row.dtype, nbytes, raw_dtype=qtype)
        infos.append(nbytes)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    bar = Progress(sum(infos), progress_stream or sys.stderr)
    for (gg_name, src, qtype_name), nbytes in zip(plan, infos):
        arr, _ = encode_tensor(src.load(st, cfg), qtype_name)
        writer.write_tensor_data(arr)
        del arr
        for name in src.names:  # the checkpoint's pages of this tensor go back to the kernel (RSS stays one tensor)
            release_pages(st.raw(name)[0])
        bar.advance(nbytes, gg_name)
    writer.close()


class Progress:
    """One-line progress bar on stderr."""

    def __init__(self, total: int, stream, width: int = 30):
        self.total, self.done, self.stream, self.width, self.t0 = max(total, 1), 0, stream, width, time.time()
        self.last = 0.0

    def advance(self, n: int, label: str) -> None:
        self.done += n
        now = time.time()
        if self.done < self.total and now - self.last < 0.2:  # redraw at most 5 times a second
            return
        self.last = now
        frac = self.done / self.total
        bar = "#" * int(frac * self.width)
        self.stream.write(f"\r[{bar:<{self.width}}] {100 * frac:5.1f}% {time.time() - self.t0:6.1f}s {label[:40]:<40}")
        if self.done >= self.total:
            self.stream.write("\n")
        self.stream.flush()


def convert_text(model_dir: str, out_path: str, type_name: str, cfg_dict: dict, progress_stream=None) -> list[str]:
    """Write OUT.gguf for a dense or MoE text checkpoint (config.json already read into cfg_dict)."""
    import gguf

    from appliance.engine.config import Qwen3Config
    from appliance.engine.safetensors import SafeTensors

    cfg = Qwen3Config.from_dict(cfg_dict)
    moe = None
    if cfg.model_type == "qwen3_moe":
        from appliance.engine.qwen3_moe import MoEConfig

        moe = MoEConfig.from_dict(cfg_dict)
        if not moe.norm_topk_prob or moe.mlp_only_layers or moe.decoder_sparse_step != 1:
            raise ConvertError("llama.cpp's qwen3moe renormalises the top-k weights in every layer: only "
                               "norm_topk_prob=true with every layer sparse can be converted")
    st = SafeTensors(model_dir)
    out_dir = os.path.dirname(os.path.abspath(out_path))
    if not os.path.isdir(out_dir):
        raise ConvertError(f"output directory does not exist: {out_dir}")
    tmp = out_path + ".tmp"
    writer = gguf.GGUFWriter(tmp, GGUF_ARCH.get(cfg.model_type, cfg.model_type))
    write_hparams(writer, cfg, os.path.basename(os.path.abspath(model_dir)), FILE_TYPES[type_name], moe)
    write_tokenizer(writer, model_dir, cfg.vocab_size, cfg_dict)
    write_tensors(writer, text_types(tensor_plan(st, cfg, moe), TYPES[type_name]), st, cfg, progress_stream)
    os.replace(tmp, out_path)
    return [out_path]
