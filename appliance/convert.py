"""`kestrel-appliance convert HF_DIR OUT.gguf --type q8_0|q4_0|f16|f32`: quantize a Hugging Face checkpoint once,
on any machine, into a GGUF file that both this engine and llama.cpp load.

Policies:
- Architectures: qwen3, qwen2, llama (dense) and qwen3_moe (experts per-expert or transformers-5 fused, stacked
  per projection as llama.cpp's qwen3moe stores them). Tensor names come from engine/load/names.py, the table
  the loaders use too. The file carries what llama.cpp needs to run it on its own:
  architecture hyper-parameters, the byte-level BPE tokenizer (`gpt2` model, `pre` chosen from the
  tokenizer.json split regex, tokens padded to the embedding size, token types, merges), special ids,
  add_bos flag and the chat template.
- Tensor types: every 2-D weight gets the requested type, except rows whose length is not a multiple of
  the block size (32), which fall back to F16 as llama.cpp's converter does; 1-D tensors (norms, biases)
  stay F32. Quantization uses the `gguf` package's reference quantizers (bit-exact with ggml's).
- llama checkpoints get llama.cpp's q/k row permutation (its RoPE pairs adjacent elements); qwen2/qwen3 are
  written in Hugging Face order. The loader undoes the permutation, so a round trip is exact.
- Tensors are converted and written one at a time (the output is never held in memory), to OUT.tmp and
  renamed at the end; a progress bar goes to stderr. Bad input is a one-line error and exit status 2.
"""
from __future__ import annotations

import argparse
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
    for a in tj.get("added_tokens", []):
        by_id[a["id"]] = (a["content"], gguf.TokenType.CONTROL if a["special"] else gguf.TokenType.USER_DEFINED)
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
    in), or one half of transformers-5's fused gate_up tensor (E, 2I, H) (`half` 0: gate rows, 1: up rows)."""
    names: tuple[str, ...]
    stacked: bool = False
    half: int | None = None
    permute: str | None = None  # 'q' | 'k': llama.cpp's row permutation (llama architecture only)

    def shape(self, st) -> tuple[int, ...]:
        shape = tuple(st.raw(self.names[0])[0].shape)
        if self.stacked:
            return (len(self.names),) + shape
        if self.half is not None:
            return (shape[0], shape[1] // 2) + shape[2:]
        return shape

    def load(self, st, cfg) -> np.ndarray:
        from appliance.engine.safetensors import to_float32

        if self.stacked:
            return np.stack([to_float32(*st.raw(n)) for n in self.names])  # (E, out, in)
        w = to_float32(*st.raw(self.names[0]))
        if self.half is not None:
            rows = w.shape[1] // 2
            return np.ascontiguousarray(w[:, self.half * rows:(self.half + 1) * rows])  # (E, I, H)
        if self.permute is not None and cfg.model_type == "llama":
            heads = cfg.num_attention_heads if self.permute == "q" else cfg.num_key_value_heads
            w = permute_rows(w, heads)
        return w


def tensor_plan(st, cfg, moe=None) -> list[tuple[str, Source]]:
    """(gguf name, Source) in llama.cpp's usual order, named through the one table (engine/load/names.py). A
    mixture-of-experts layer's experts become one stacked tensor per projection."""
    from appliance.engine.load.names import (
        EXPERT_PROJECTIONS,
        LAYER_TENSORS,
        HFNames,
        gguf_experts,
        gguf_layer,
        gguf_model,
    )

    hf = HFNames()
    plan = [(gguf_model("embed"), Source((hf.model("embed"),)))]
    for i in range(cfg.num_hidden_layers):
        for role in LAYER_TENSORS:
            if role != "router" and hf.layer(i, role) in st:
                plan.append((gguf_layer(i, role), Source((hf.layer(i, role),),
                                                         permute=role if role in ("q", "k") else None)))
        if moe is None or hf.layer(i, "router") not in st:
            continue
        plan.append((gguf_layer(i, "router"), Source((hf.layer(i, "router"),))))
        fused = hf.fused_experts(i, "gate_up") in st
        for half, proj in enumerate(EXPERT_PROJECTIONS):
            if fused:
                src = (Source((hf.fused_experts(i, "down"),)) if proj == "down"
                       else Source((hf.fused_experts(i, "gate_up"),), half=half))
            else:
                src = Source(tuple(hf.expert(i, j, proj) for j in range(moe.num_experts)), stacked=True)
            plan.append((gguf_experts(i, proj), src))
    plan.append((gguf_model("norm"), Source((hf.model("norm"),))))
    if not cfg.tie_word_embeddings and hf.model("lm_head") in st:
        plan.append((gguf_model("lm_head"), Source((hf.model("lm_head"),))))
    return plan


def encode_tensor(w: np.ndarray, qtype_name: str, router: bool = False) -> tuple[np.ndarray, GGMLQuantizationType]:
    """float32 array -> (array to write, GGMLQuantizationType)."""
    import gguf

    if w.ndim == 1 or qtype_name == "F32" or router:  # llama.cpp keeps expert routers in F32 too
        return np.ascontiguousarray(w, dtype=np.float32), gguf.GGMLQuantizationType.F32
    qtype = getattr(gguf.GGMLQuantizationType, qtype_name)
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if qtype_name == "F16" or w.shape[-1] % block:
        return w.astype(np.float16), gguf.GGMLQuantizationType.F16
    return gguf.quants.quantize(w, qtype), qtype


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


def convert(model_dir: str, out_path: str, type_name: str, progress_stream=None) -> str:
    import gguf

    from appliance.engine.config import Qwen3Config
    from appliance.engine.safetensors import SafeTensors

    if type_name not in TYPES:
        raise ConvertError(f"unknown type {type_name!r} (choose from {', '.join(TYPES)})")
    cfg_path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(cfg_path):
        raise ConvertError(f"no config.json in {model_dir}")
    with open(cfg_path, encoding="utf-8") as f:
        cfg_dict = json.load(f)
    if cfg_dict.get("model_type") not in ARCHITECTURES:
        raise ConvertError(f"unsupported model type {cfg_dict.get('model_type')!r} (supported: {', '.join(ARCHITECTURES)})")
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
    plan = tensor_plan(st, cfg, moe)
    infos = []
    for gg_name, src in plan:  # shapes and sizes first: the header precedes the data
        router = gg_name.endswith("ffn_gate_inp.weight")
        shape = src.shape(st)
        one_row, qtype = encode_tensor(np.zeros((1, shape[-1]) if len(shape) >= 2 else shape, np.float32),
                                       TYPES[type_name], router)
        byte_shape = tuple(shape[:-1]) + one_row.shape[1:] if len(shape) >= 2 else one_row.shape
        nbytes = int(np.prod(byte_shape)) * one_row.itemsize
        writer.add_tensor_info(gg_name, byte_shape, one_row.dtype, nbytes, raw_dtype=qtype)
        infos.append(nbytes)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    bar = Progress(sum(infos), progress_stream or sys.stderr)
    for (gg_name, src), nbytes in zip(plan, infos):
        arr, _ = encode_tensor(src.load(st, cfg), TYPES[type_name], gg_name.endswith("ffn_gate_inp.weight"))
        writer.write_tensor_data(arr)
        bar.advance(nbytes, gg_name)
    writer.close()
    os.replace(tmp, out_path)
    return out_path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kestrel-appliance convert",
                                description="Convert a Hugging Face checkpoint directory to a GGUF file.")
    p.add_argument("model_dir", metavar="HF_DIR")
    p.add_argument("out", metavar="OUT.gguf")
    p.add_argument("--type", default="q8_0", choices=sorted(TYPES), help="weight type of the matrices")
    args = p.parse_args(argv)
    try:
        path = convert(args.model_dir, args.out, args.type)
    except (ConvertError, OSError, ValueError, KeyError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"kestrel-appliance convert: error: {msg}", file=sys.stderr)
        try:
            os.remove(args.out + ".tmp")
        except OSError:
            pass
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
