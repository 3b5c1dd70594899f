"""Tiny random Qwen3-VL checkpoints, built with transformers (real architecture, real tokenizer).

The directory has what a Qwen/Qwen3-VL-*-Instruct download has: config.json with text_config and
vision_config (DeepStack layers listed), bf16 model.safetensors, preprocessor_config.json,
generation_config.json, tokenizer.json / tokenizer_config.json and the Qwen3-VL chat template. The vision
tower keeps the real patch size (16), merge size (2) and temporal patch size (2), so preprocessing is the real
one; only the widths are small. The pixel bounds are small too (few tokens per image).

Usage: python -m tests.support.tiny_vl OUT_DIR
"""
from __future__ import annotations

import json
import os
import shutil
import sys

from tests.support.tiny_models import FIXTURES, write_generation_config, write_tokenizer

IMAGE_TOKEN_ID = 151655
TINY_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, decoder_sparse_step=1)


def build_qwen3_vl(out_dir: str, *, hidden: int = 64, layers: int = 3, heads: int = 4, kv_heads: int = 2,
                   head_dim: int = 32, intermediate: int = 128, mrope_section=(6, 5, 5),
                   vision_hidden: int = 32, vision_heads: int = 2, vision_depth: int = 4, vision_intermediate: int = 64,
                   deepstack=(0, 2), num_position_embeddings: int = 64, tie: bool = True, seed: int = 0,
                   min_pixels: int = 32 * 32 * 4, max_pixels: int = 32 * 32 * 64, init_std: float = 0.2,
                   moe: dict | None = None) -> str:
    """A tiny random Qwen3VLForConditionalGeneration saved in bf16. init_std is large so logits are far from
    uniform; norms are random so a missing weight would show. `moe` (num_experts, num_experts_per_tok,
    moe_intermediate_size, decoder_sparse_step...) makes it a Qwen3VLMoeForConditionalGeneration instead
    (Qwen3-VL-30B-A3B's architecture; its experts saved fused, as published)."""
    import torch
    from transformers import (
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
        Qwen3VLMoeConfig,
        Qwen3VLMoeForConditionalGeneration,
    )

    os.makedirs(out_dir, exist_ok=True)
    torch.manual_seed(seed)
    text = dict(vocab_size=151936, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                max_position_embeddings=4096, rms_norm_eps=1e-6, initializer_range=init_std,
                rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0,
                                 "mrope_section": list(mrope_section), "mrope_interleaved": True},
                tie_word_embeddings=tie, bos_token_id=151643, eos_token_id=151645)
    vision = dict(depth=vision_depth, hidden_size=vision_hidden, intermediate_size=vision_intermediate,
                  num_heads=vision_heads, in_channels=3, patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                  out_hidden_size=hidden, num_position_embeddings=num_position_embeddings,
                  deepstack_visual_indexes=list(deepstack), hidden_act="gelu_pytorch_tanh", initializer_range=init_std)
    if moe is not None:
        cfg = Qwen3VLMoeConfig(text_config={**text, **moe}, vision_config=vision, tie_word_embeddings=tie)
        model = Qwen3VLMoeForConditionalGeneration(cfg)
    else:
        cfg = Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=tie)
        model = Qwen3VLForConditionalGeneration(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("norm1.weight") or name.endswith("norm2.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif name.endswith("pos_embed.weight"):
                p.copy_(0.5 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):  # a router: decided choices, not near-ties
                p.copy_(1.0 * torch.randn_like(p))
    model.to(torch.bfloat16).save_pretrained(out_dir, safe_serialization=True)
    write_tokenizer(out_dir)
    write_generation_config(out_dir)
    shutil.copyfile(os.path.join(FIXTURES, "qwen3_vl", "chat_template.jinja"),
                    os.path.join(out_dir, "chat_template.jinja"))
    write_preprocessor_config(out_dir, min_pixels, max_pixels)
    return out_dir


def write_preprocessor_config(out_dir: str, min_pixels: int, max_pixels: int) -> None:
    """Qwen3-VL's preprocessor_config.json (patch 16, merge 2, mean/std 0.5) with the given pixel bounds."""
    cfg = {"size": {"longest_edge": max_pixels, "shortest_edge": min_pixels}, "patch_size": 16,
           "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
           "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "do_convert_rgb": True,
           "resample": 3, "processor_class": "Qwen3VLProcessor", "image_processor_type": "Qwen2VLImageProcessor"}
    with open(os.path.join(out_dir, "preprocessor_config.json"), "w") as f:
        json.dump(cfg, f, indent=1)


def reference_processor(model_dir: str):
    """transformers' Qwen3VLProcessor for the directory (PIL image backend, the real tokenizer)."""
    from transformers import AutoTokenizer, Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    with open(os.path.join(model_dir, "preprocessor_config.json")) as f:
        pp = json.load(f)
    image_processor = Qwen2VLImageProcessorPil(size=pp["size"], patch_size=pp["patch_size"],
                                               temporal_patch_size=pp["temporal_patch_size"],
                                               merge_size=pp["merge_size"], image_mean=pp["image_mean"],
                                               image_std=pp["image_std"])
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with open(os.path.join(model_dir, "chat_template.jinja")) as f:
        template = f.read()

    class ImageOnlyProcessor(Qwen3VLProcessor):  # no video processor: that one needs torchvision
        def check_argument_for_proper_class(self, name, arg):
            if name != "video_processor":
                return super().check_argument_for_proper_class(name, arg)

    return ImageOnlyProcessor(image_processor=image_processor, tokenizer=tokenizer, video_processor=None,
                              chat_template=template)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m tests.support.tiny_vl OUT_DIR", file=sys.stderr)
        return 2
    print(build_qwen3_vl(argv[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


def build_qwen3_5_vl(out_dir: str, *, moe: bool = False, seed: int = 21, **shape) -> str:
    """A tiny random Qwen3.5 (dense or MoE) with a two-block vision tower whose norms, biases and position table
    are random too, the Qwen3-VL chat template (image parts) and preprocessor_config.json: what a Qwen/Qwen3.5-*
    download has, small. `shape`: more tiny_models.build_qwen3_5 settings (the GGUF pairs' layer layout)."""
    from tests.support.tiny_models import build_qwen3_5

    build_qwen3_5(out_dir, moe=moe, seed=seed, vision=dict(depth=2, initializer_range=0.2), vision_seed=seed + 100,
                  **shape)
    shutil.copyfile(os.path.join(FIXTURES, "qwen3_vl", "chat_template.jinja"),
                    os.path.join(out_dir, "chat_template.jinja"))
    write_preprocessor_config(out_dir, 32 * 32 * 4, 32 * 32 * 64)
    return out_dir


def cached_qwen3_5_vl(tmp_path_factory, moe: bool = False) -> str:
    """build_qwen3_5_vl's dense (seed 21) or MoE (seed 22, 4 layers) checkpoint, built once per test session."""
    d = tmp_path_factory.getbasetemp() / f"tiny-qwen3_5-vl{'-moe' if moe else ''}"
    if not (d / "config.json").exists():
        if moe:
            build_qwen3_5_vl(str(d) + ".tmp", moe=True, seed=22, layers=4, interval=2)
        else:
            build_qwen3_5_vl(str(d) + ".tmp")
        os.replace(str(d) + ".tmp", str(d))
    return str(d)


def cached_qwen3_vl(tmp_path_factory) -> str:
    """The default tiny checkpoint, built once per test session and shared by the Qwen3-VL test modules."""
    d = tmp_path_factory.getbasetemp() / "tiny-qwen3-vl"
    if not (d / "config.json").exists():
        build_qwen3_vl(str(d) + ".tmp", seed=3)
        os.replace(str(d) + ".tmp", str(d))
    return str(d)


def cached_qwen3_vl_moe(tmp_path_factory) -> str:
    """A tiny random Qwen3-VL-MoE (TINY_MOE: every layer sparse, H != 2I), built once per test session."""
    d = tmp_path_factory.getbasetemp() / "tiny-qwen3-vl-moe"
    if not (d / "config.json").exists():
        build_qwen3_vl(str(d) + ".tmp", seed=6, moe=TINY_MOE)
        os.replace(str(d) + ".tmp", str(d))
    return str(d)


def published_layout(src: str, dst: str) -> str:
    """A copy of the checkpoint with the experts as the published Qwen3-VL-MoE files hold them: gate_up_proj
    (E, H, 2I), down_proj (E, I, H) (transformers transposes them back at load)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    for name in list(tensors):
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            tensors[name] = tensors[name].transpose(1, 2).contiguous()
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


def image_bytes(width: int, height: int, fmt: str = "PNG", mode: str = "RGB", seed: int = 0, **save) -> bytes:
    """A random but not noise-only picture (gradients plus noise) encoded as fmt."""
    import io

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([255 * x / max(width - 1, 1), 255 * y / max(height - 1, 1), 128 + 0 * x], axis=-1)
    a = np.clip(base + rng.normal(0, 40, (height, width, 3)), 0, 255).astype(np.uint8)
    img = Image.fromarray(a, "RGB")
    if mode == "RGBA":
        alpha = (rng.random((height, width)) * 255).astype(np.uint8)
        img = Image.fromarray(np.dstack([a, alpha]), "RGBA")
    elif mode != "RGB":
        img = img.convert(mode)
    buf = io.BytesIO()
    img.save(buf, fmt, **save)
    return buf.getvalue()


def png_with_size(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height (the pixel data is a few bytes)."""
    import struct
    import zlib

    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b"")
