"""Tiny random Qwen3-family checkpoints, built with transformers (real architecture, real tokenizer).

Each builder writes a Hugging Face model directory (config.json, bf16 model.safetensors,
generation_config.json, tokenizer.json, tokenizer_config.json, chat_template.jinja) and returns its path.
The reference numbers are computed by the tests from the same directory with transformers in float32.

Usage (for the README's run command): python -m tests.support.tiny_models OUT_DIR
"""
from __future__ import annotations

import json
import os
import shutil
import sys

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures")
QWEN3_EOS = [151645, 151643]  # <|im_end|>, <|endoftext|>


def write_tokenizer(out_dir: str) -> None:
    from appliance.tools.qwen_tokenizer import write_tokenizer_files

    cache = os.path.join(os.path.expanduser(os.environ.get("KESTREL_TEST_CACHE", "~/.cache/kestrel-test")), "qwen-tokenizer")
    if not os.path.exists(os.path.join(cache, "tokenizer.json")):
        tmp = f"{cache}.tmp{os.getpid()}"
        write_tokenizer_files(tmp)
        try:
            os.replace(tmp, cache)
        except OSError:  # another process got there first
            shutil.rmtree(tmp, ignore_errors=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(os.path.join(cache, name), os.path.join(out_dir, name))


def write_generation_config(out_dir: str, **extra) -> None:
    cfg = {"eos_token_id": QWEN3_EOS, "pad_token_id": 151643, "do_sample": True,
           "temperature": 0.6, "top_k": 20, "top_p": 0.95}
    cfg.update(extra)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump(cfg, f, indent=1)


def build_qwen3(out_dir: str, *, hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 1,
                head_dim: int = 16, intermediate: int = 128, tie: bool = True, seed: int = 0,
                rope_theta: float = 1_000_000.0, max_positions: int = 4096, init_std: float = 0.2) -> str:
    """A tiny random Qwen3ForCausalLM saved in bf16. init_std is large so logits are far from uniform."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    os.makedirs(out_dir, exist_ok=True)
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=151936, hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      head_dim=head_dim, tie_word_embeddings=tie, max_position_embeddings=max_positions,
                      rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
                      initializer_range=init_std, rms_norm_eps=1e-6,
                      bos_token_id=151643, eos_token_id=151645)
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():  # norms at 1.0 would hide a missing weight; make them random too
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    model.to(torch.bfloat16).save_pretrained(out_dir, safe_serialization=True)
    write_tokenizer(out_dir)
    write_generation_config(out_dir)
    shutil.copyfile(os.path.join(FIXTURES, "qwen3", "chat_template.jinja"), os.path.join(out_dir, "chat_template.jinja"))
    return out_dir


def build_qwen3_embedding(out_dir: str, *, hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                          head_dim: int = 16, intermediate: int = 128, seed: int = 5, pooling: str = "lasttoken",
                          max_positions: int = 4096) -> str:
    """A tiny random Qwen3-Embedding as Qwen publishes it: a bare Qwen3Model (no LM head, tensors without the
    "model." prefix) in bf16, sentence-transformers' modules.json (Transformer, Pooling, Normalize) and
    1_Pooling/config.json, and a tokenizer.json whose post-processor appends <|endoftext|>."""
    import torch
    from transformers import Qwen3Config, Qwen3Model

    os.makedirs(out_dir, exist_ok=True)
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=151936, hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      head_dim=head_dim, tie_word_embeddings=False, max_position_embeddings=max_positions,
                      rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
                      initializer_range=0.2, rms_norm_eps=1e-6, bos_token_id=151643, eos_token_id=151643)
    model = Qwen3Model(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    model.to(torch.bfloat16).save_pretrained(out_dir, safe_serialization=True)
    write_tokenizer(out_dir)
    tok_path = os.path.join(out_dir, "tokenizer.json")
    with open(tok_path, encoding="utf-8") as f:
        tok = json.load(f)
    eot = {"id": "<|endoftext|>", "ids": [151643], "tokens": ["<|endoftext|>"]}
    tok["post_processor"] = {"type": "TemplateProcessing",
                             "single": [{"Sequence": {"id": "A", "type_id": 0}},
                                        {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}],
                             "pair": [{"Sequence": {"id": "A", "type_id": 0}},
                                      {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
                                      {"Sequence": {"id": "B", "type_id": 1}},
                                      {"SpecialToken": {"id": "<|endoftext|>", "type_id": 1}}],
                             "special_tokens": {"<|endoftext|>": eot}}
    with open(tok_path, "w", encoding="utf-8") as f:
        json.dump(tok, f, ensure_ascii=False)
    write_generation_config(out_dir)
    shutil.copyfile(os.path.join(FIXTURES, "qwen3", "chat_template.jinja"), os.path.join(out_dir, "chat_template.jinja"))
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    with open(os.path.join(out_dir, "modules.json"), "w") as f:
        json.dump(modules, f, indent=1)
    os.makedirs(os.path.join(out_dir, "1_Pooling"), exist_ok=True)
    os.makedirs(os.path.join(out_dir, "2_Normalize"), exist_ok=True)
    modes = {f"pooling_mode_{m}": m == pooling for m in ("cls_token", "mean_tokens", "max_tokens",
                                                         "mean_sqrt_len_tokens", "weightedmean_tokens", "lasttoken")}
    with open(os.path.join(out_dir, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": hidden, **modes, "include_prompt": True}, f, indent=1)
    return out_dir


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m tests.support.tiny_models OUT_DIR", file=sys.stderr)
        return 2
    print(build_qwen3(argv[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


def build_qwen3_moe(out_dir: str, *, hidden: int = 64, layers: int = 3, heads: int = 4, kv_heads: int = 2,
                    head_dim: int = 16, experts: int = 16, top_k: int = 4, moe_intermediate: int = 32,
                    intermediate: int = 96, norm_topk_prob: bool = True, mlp_only_layers=(), sparse_step: int = 1,
                    tie: bool = False, seed: int = 0, init_std: float = 0.2) -> str:
    """A tiny random Qwen3MoeForCausalLM (16 experts, top-4 by default) saved in bf16."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    os.makedirs(out_dir, exist_ok=True)
    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(vocab_size=151936, hidden_size=hidden, intermediate_size=intermediate,
                         moe_intermediate_size=moe_intermediate, num_experts=experts, num_experts_per_tok=top_k,
                         norm_topk_prob=norm_topk_prob, mlp_only_layers=list(mlp_only_layers),
                         decoder_sparse_step=sparse_step, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, head_dim=head_dim, tie_word_embeddings=tie,
                         max_position_embeddings=4096, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                         initializer_range=init_std, rms_norm_eps=1e-6, bos_token_id=151643, eos_token_id=151645)
    model = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):  # a spread-out router so top-k choices are not near-ties
                p.copy_(torch.randn_like(p))
    model.to(torch.bfloat16).save_pretrained(out_dir, safe_serialization=True)
    write_tokenizer(out_dir)
    write_generation_config(out_dir)
    shutil.copyfile(os.path.join(FIXTURES, "qwen3", "chat_template.jinja"), os.path.join(out_dir, "chat_template.jinja"))
    return out_dir


def thinking_copy(model_dir: str, out_dir: str) -> str:
    """A copy of a tiny Qwen3 checkpoint (files symlinked) whose chat template opens `<think>` in the generation
    prompt, as thinking-only Qwen3 templates do: what the model writes is reasoning unless enable_thinking is false."""
    os.makedirs(out_dir, exist_ok=True)
    for name in os.listdir(model_dir):
        if name != "chat_template.jinja":
            os.symlink(os.path.join(model_dir, name), os.path.join(out_dir, name))
    with open(os.path.join(model_dir, "chat_template.jinja"), encoding="utf-8") as f:
        template = f.read()
    opened = template.replace("{{- '<|im_start|>assistant\\n' }}\n    {%- if enable_thinking",
                              "{{- '<|im_start|>assistant\\n<think>\\n' }}\n    {%- if enable_thinking")
    assert opened != template, "the chat template changed: the generation prompt was not found"
    with open(os.path.join(out_dir, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(opened)
    return out_dir


def fuse_experts(src_dir: str, out_dir: str) -> str:
    """A copy of a Qwen3-MoE checkpoint with its experts in transformers-5's fused in-memory layout:
    `mlp.experts.gate_up_proj` (E, 2I, H) (gate rows first) and `mlp.experts.down_proj` (E, H, I), bits unchanged."""
    import re

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src_dir, out_dir)
    tensors = load_file(os.path.join(src_dir, "model.safetensors"))
    out, experts = {}, {}
    for name, t in tensors.items():
        m = re.match(r"(.*\.mlp\.experts\.)(\d+)\.(gate|up|down)_proj\.weight$", name)
        if m:
            experts.setdefault(m.group(1), {}).setdefault(m.group(3), {})[int(m.group(2))] = t
        else:
            out[name] = t
    for prefix, by_proj in experts.items():
        stack = {p: torch.stack([by_proj[p][j] for j in range(len(by_proj[p]))]) for p in by_proj}
        out[prefix + "gate_up_proj"] = torch.cat([stack["gate"], stack["up"]], dim=1).contiguous()
        out[prefix + "down_proj"] = stack["down"].contiguous()
    save_file(out, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def build_qwen3_5(out_dir: str, *, moe: bool = False, hidden: int = 64, layers: int = 6, interval: int = 3,
                  heads: int = 4, kv_heads: int = 2, head_dim: int = 16, intermediate: int = 96, tie: bool = False,
                  seed: int = 0, init_std: float = 0.2, experts: int = 8, top_k: int = 2,
                  linear_dims: tuple[int, int] = (8, 12), mtp: bool = False,
                  linear_heads: tuple[int, int] = (2, 4), vision: dict | None = None,
                  vision_seed: int | None = None) -> str:
    """A tiny random Qwen3.5 (Qwen3_5ForConditionalGeneration / Qwen3_5MoeForConditionalGeneration: the published
    layout, `model.language_model.*` plus a one-block vision tower) saved in bf16: `layers` layers, every
    `interval`-th full attention (gated, partial rotary), the rest Gated DeltaNet with 2 key heads serving 4 value
    heads (key / value head sizes `linear_dims`; llama.cpp serves equal ones only). moe: 8 routed experts (top-2) and a
    shared expert in every layer. mtp: a multi-token-prediction head too (add_mtp_head). `vision` overrides the
    vision tower's settings; vision_seed: its LayerNorms, biases and position table drawn at random too (from their
    own generator, so the decoder's weights stay the seed's)."""
    import torch
    import transformers

    os.makedirs(out_dir, exist_ok=True)
    torch.manual_seed(seed)
    text = dict(vocab_size=151936, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=kv_heads, head_dim=head_dim, linear_conv_kernel_dim=4, linear_key_head_dim=linear_dims[0],
                linear_value_head_dim=linear_dims[1], linear_num_key_heads=linear_heads[0],
                linear_num_value_heads=linear_heads[1],
                full_attention_interval=interval, max_position_embeddings=4096, tie_word_embeddings=tie,
                rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5,
                                 "mrope_section": [2, 1, 1], "mrope_interleaved": True},
                initializer_range=init_std, rms_norm_eps=1e-6, bos_token_id=151643, eos_token_id=151645)
    if moe:
        text.update(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=32,
                    shared_expert_intermediate_size=48)
    else:
        text.update(intermediate_size=intermediate)
    vision = {**dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16, spatial_merge_size=2,
                  temporal_patch_size=2, out_hidden_size=hidden, num_position_embeddings=64), **(vision or {})}
    kind = "Qwen3_5Moe" if moe else "Qwen3_5"
    cfg = getattr(transformers, kind + "Config")(
        text_config=text, vision_config=vision, image_token_id=151655, video_token_id=151656,
        vision_start_token_id=151652, vision_end_token_id=151653, tie_word_embeddings=tie)
    model = getattr(transformers, kind + "ForConditionalGeneration")(cfg)
    with torch.no_grad():  # zero-centred norms at 0 (and the gated norm at 1) would hide a missing weight
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") and "visual" not in name:
                p.copy_((1.0 if "linear_attn.norm" in name else 0.0) + 0.3 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):  # a spread-out router so top-k choices are not near-ties
                p.copy_(torch.randn_like(p))
        gen = torch.Generator().manual_seed(vision_seed) if vision_seed is not None else None
        for name, p in model.named_parameters():
            if gen is None or "visual" not in name:
                continue
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith(("norm.weight", "norm1.weight", "norm2.weight")):
                p.copy_(1.0 + 0.3 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.1 * noise)
            elif name.endswith("pos_embed.weight"):
                p.copy_(0.5 * noise)
    model.to(torch.bfloat16).save_pretrained(out_dir, safe_serialization=True)
    write_tokenizer(out_dir)
    write_generation_config(out_dir)
    shutil.copyfile(os.path.join(FIXTURES, "qwen3", "chat_template.jinja"), os.path.join(out_dir, "chat_template.jinja"))
    if mtp:
        add_mtp_head(out_dir, seed=seed + 1000)
    return out_dir


def add_mtp_head(out_dir: str, seed: int = 0) -> None:
    """The published checkpoints' `mtp.*` head (transformers has no module for it and drops it on save), written
    into the safetensors with random values: fc (hidden, 2 hidden), pre_fc_norm_embedding / _hidden and norm
    (zero-centred), and `mtp.layers.0.*` shaped as the last full-attention layer (MoE in MoE checkpoints), its
    tensors that layer's plus noise; config.json's text_config gets mtp_num_hidden_layers = 1."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    path = os.path.join(out_dir, "model.safetensors")
    tensors = load_file(path)
    with open(os.path.join(out_dir, "config.json")) as f:
        cfg = json.load(f)
    text = cfg["text_config"]
    hidden = text["hidden_size"]
    full = max(i for i, kind in enumerate(text["layer_types"]) if kind == "full_attention")
    g = torch.Generator().manual_seed(seed)
    src = f"model.language_model.layers.{full}."
    for name, t in list(tensors.items()):
        if name.startswith(src):
            noise = 0.2 * torch.randn(t.shape, generator=g)
            tensors["mtp.layers.0." + name[len(src):]] = (t.float() + noise).to(t.dtype).contiguous()
    tensors["mtp.fc.weight"] = (torch.randn((hidden, 2 * hidden), generator=g) * 0.15).to(torch.bfloat16)
    for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{n}.weight"] = (0.3 * torch.randn((hidden,), generator=g)).to(torch.bfloat16)
    save_file(tensors, path, metadata={"format": "pt"})
    text["mtp_num_hidden_layers"] = 1
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)


def make_bigram_with_mtp(model_dir: str, out_dir: str) -> str:
    """A copy of a tiny Qwen3.5 with an MTP head whose drafts are right by construction: every layer's output
    projections (attention o_proj / linear out_proj, the MLP's and experts' down_proj) are zero, so the final
    hidden state is norm(embed(x)) and the next token a function of the current one; the head's layer is zeroed
    the same way, its fc passes the normed embedding half through (identity, the hidden half zero) and its norm
    is the model's, so it drafts exactly that function of the token it is given (a chain of drafts is accepted
    as long as the head is fed the right token at the right place)."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out_dir, dirs_exist_ok=True)
    path = os.path.join(out_dir, "model.safetensors")
    t = load_file(path)
    for name in t:
        if ".layers." in name and any(p in name for p in ("o_proj", "out_proj", "down_proj")):
            t[name] = torch.zeros_like(t[name])
    hidden = t["mtp.fc.weight"].shape[0]
    t["mtp.fc.weight"] = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1).to(t["mtp.fc.weight"].dtype)
    t["mtp.pre_fc_norm_embedding.weight"] = torch.zeros_like(t["mtp.pre_fc_norm_embedding.weight"])
    t["mtp.norm.weight"] = t["model.language_model.norm.weight"].clone()
    save_file(t, path, metadata={"format": "pt"})
    return out_dir
