"""The vision tower of a Hugging Face checkpoint (`model.visual.*`): Qwen3-VL's, with its DeepStack mergers, and
Qwen3.5's, the same tower without them; plus the image processor from preprocessor_config.json beside it.

Policy: the tower's tensors are checked against config.json's vision_config before any is built
(vision_check.py: one line naming the tensor). Matrices stay in the mapping in their stored form when the native
kernels are there (stored_weight). Qwen3.5 quirk: its vision tower has no DeepStack; a `deepstack_visual_indexes`
left in a Qwen3.5 vision_config is ignored, as transformers ignores it (`deepstack=False`).
"""
from __future__ import annotations

import numpy as np

from ..image_processing import ImageProcessor
from ..quant_weights import half_weight
from ..safetensors import SafeTensors, to_float32
from ..vision import Linear, PatchMerger, VisionBlock, VisionConfig, VisionTower, vision_ops
from ..weights import DenseWeight
from . import LoadOptions
from .vision_check import check_vision_config, check_vision_tensors, hf_vision_shapes


def native_available() -> bool:
    from appliance.native import kernels
    return kernels.available()


def tensor_prefix(st: SafeTensors, *candidates: str) -> str:
    """The first of `candidates` some tensor name starts with (KeyError when none does)."""
    for p in candidates:
        if any(k.startswith(p) for k in st.keys()):
            return p
    raise KeyError(f"no tensors under {' or '.join(candidates)}")


def has_tensors_under(st: SafeTensors, *candidates: str) -> bool:
    return any(k.startswith(p) for k in st.keys() for p in candidates)


def stored_weight(raw: np.ndarray, dtype: str):
    """A vision matrix (out, in) as stored: BF16/F16/F32 read in place from the mapping by the C kernels when the
    library is there, else a float32 DenseWeight."""
    if native_available() and dtype in ("BF16", "F16", "F32") and raw.ndim == 2 and raw.flags.c_contiguous:
        return half_weight(raw, dtype)
    return DenseWeight(np.ascontiguousarray(to_float32(raw, dtype)))


def vision_linear(st: SafeTensors, name: str) -> Linear:
    return Linear(stored_weight(*st.raw(name + ".weight")), st.float32(name + ".bias"))


def build_vision(st: SafeTensors, cfg: VisionConfig, prefix: str) -> VisionTower:
    def norm(name):
        return st.float32(name + ".weight"), st.float32(name + ".bias")

    def merger(name, post):
        return PatchMerger(norm(name + ".norm"), vision_linear(st, name + ".linear_fc1"),
                           vision_linear(st, name + ".linear_fc2"), post)

    w, dt = st.raw(prefix + "patch_embed.proj.weight")  # (hidden, C, tp, p, p)
    patch = Linear(stored_weight(w.reshape(cfg.hidden_size, -1), dt),  # (hidden, C*tp*p*p): the kernel flattened
                   st.float32(prefix + "patch_embed.proj.bias"))
    blocks = [VisionBlock(norm(f"{prefix}blocks.{i}.norm1"), vision_linear(st, f"{prefix}blocks.{i}.attn.qkv"),
                          vision_linear(st, f"{prefix}blocks.{i}.attn.proj"), norm(f"{prefix}blocks.{i}.norm2"),
                          vision_linear(st, f"{prefix}blocks.{i}.mlp.linear_fc1"),
                          vision_linear(st, f"{prefix}blocks.{i}.mlp.linear_fc2")) for i in range(cfg.depth)]
    deep = [merger(f"{prefix}deepstack_merger_list.{j}", True) for j in range(len(cfg.deepstack_visual_indexes))]
    return VisionTower(cfg, patch, st.float32(prefix + "pos_embed.weight"), blocks, merger(prefix + "merger", False),
                       deep, vision_ops(native_available()))


def hf_vision_tower(st: SafeTensors, vision_config: dict, options: LoadOptions, text_hidden: int,
                    deepstack: bool = True) -> tuple[VisionTower, ImageProcessor]:
    """The checked tower under `model.visual.` (or `visual.`) and the directory's image processor (capped by
    options.image_max_pixels). deepstack=False: a Qwen3.5 tower (no DeepStack mergers whatever the config lists)."""
    vcfg = VisionConfig.from_dict(vision_config if deepstack else {**vision_config, "deepstack_visual_indexes": []})
    prefix = tensor_prefix(st, "model.visual.", "visual.")
    where = f"{st.model_dir}: the vision tower"
    check_vision_config(where, vcfg)
    check_vision_tensors(where, lambda name: tuple(st.info(name)[0]) if name in st else None,
                         hf_vision_shapes(vcfg, prefix), "config.json's vision_config")
    vision = build_vision(st, vcfg, prefix)
    if vcfg.out_hidden_size != text_hidden:
        raise ValueError("vision out_hidden_size differs from the decoder's hidden_size")
    processor = ImageProcessor.from_dir(st.model_dir, options.image_max_pixels)
    if processor.patch_size != vcfg.patch_size or processor.merge_size != vcfg.spatial_merge_size \
            or processor.temporal_patch_size != vcfg.temporal_patch_size:
        raise ValueError("preprocessor_config.json does not match the vision tower's patch sizes")
    return vision, processor
