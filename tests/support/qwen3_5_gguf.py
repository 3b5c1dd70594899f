"""Tiny random Qwen3.5 checkpoints (dense, MoE) and their GGUF files made by llama.cpp's own converter
(tests/support/llama_convert.py): the `qwen35` / `qwen35moe` files the published GGUFs are.

Decision: the checkpoints are shaped so llama.cpp itself can run the same files: 8 layers, every 4th full
attention (llama.cpp's default interval; the converter writes the layer list too), key and value heads of one
size (llama.cpp's graph assumes it), 2 key heads for 4 value heads (so the converter's value-head reorder is
exercised). The text files are converted with --no-mtp (the checkpoints have no MTP head); `with_mtp_head`
gives a copy carrying one, as the published checkpoints do.
"""
from __future__ import annotations

import os
import shutil

from tests.support import tiny_models
from tests.support.llama_convert import convert_hf

SHAPE = dict(layers=8, interval=4, linear_dims=(16, 16))


def build_files(out_dir: str, moe: bool, types: tuple[str, ...] = ("f32", "f16"), init_std: float = 0.2) -> dict[str, str]:
    """{"hf": checkpoint directory, type: GGUF path} for a dense (seed 16) or MoE (seed 17, tied) checkpoint.
    init_std: the weights' scale (0.2 gives varied outputs but amplifies an 8-bit rounding of the weights to
    whole-logit changes; 0.05 keeps a quantized file's top choices where the float model has them)."""
    os.makedirs(out_dir, exist_ok=True)
    hf = os.path.join(out_dir, "hf")
    if moe:
        tiny_models.build_qwen3_5(hf, moe=True, tie=True, seed=17, init_std=init_std, **SHAPE)
    else:
        tiny_models.build_qwen3_5(hf, seed=16, init_std=init_std, **SHAPE)
    files = {"hf": hf}
    for t in types:
        files[t] = convert_hf(hf, os.path.join(out_dir, f"{'moe' if moe else 'dense'}-{t}.gguf"), t, extra=("--no-mtp",))
    return files


def with_mtp_head(src: str, dst: str) -> str:
    """A copy of the Hugging Face checkpoint src with a multi-token-prediction head (`mtp.*`, one layer shaped
    like the decoder's last full-attention layer, random values), as Qwen3.5's published checkpoints carry."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    tensors = load_file(path)
    prefix = "model.language_model.layers."
    last = max(int(k[len(prefix):].split(".")[0]) for k in tensors if k.startswith(prefix) and ".self_attn." in k)
    gen = torch.Generator().manual_seed(5)
    for k, v in list(tensors.items()):
        if k.startswith(f"{prefix}{last}."):
            tensors["mtp.layers.0." + k[len(f"{prefix}{last}."):]] = v.clone()
    hidden = tensors["model.language_model.norm.weight"].shape[0]
    tensors["mtp.fc.weight"] = (0.1 * torch.randn((hidden, 2 * hidden), generator=gen)).to(torch.bfloat16)
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{name}.weight"] = (0.1 * torch.randn(hidden, generator=gen)).to(torch.bfloat16)
    save_file(tensors, path, metadata={"format": "pt"})
    return dst


def build_pairs(out_dir: str, moe: bool, types: tuple[str, ...] = ("f32", "f16")) -> dict[str, object]:
    """A tiny Qwen3.5 with a vision tower (tiny_vl.build_qwen3_5_vl, SHAPE's layer layout; dense seed 23, MoE seed
    24) and llama.cpp's pairs of it: {"hf": checkpoint, type: (text.gguf, mmproj.gguf)}, each pair alone in its
    directory (so the one mmproj*.gguf beside the text file is its own)."""
    from tests.support.tiny_vl import build_qwen3_5_vl

    hf = os.path.join(out_dir, "hf")
    build_qwen3_5_vl(hf, moe=moe, seed=24 if moe else 23, **SHAPE)
    kind = "moe" if moe else "dense"
    files: dict[str, object] = {"hf": hf}
    for t in types:
        d = os.path.join(out_dir, t)
        os.makedirs(d, exist_ok=True)
        files[t] = (convert_hf(hf, os.path.join(d, f"q35vl-{kind}-{t}.gguf"), t, extra=("--no-mtp",)),
                    convert_hf(hf, os.path.join(d, f"mmproj-q35vl-{kind}-{t}.gguf"), t, mmproj=True))
    return files
