"""The shapes of a Qwen3-VL vision tower's tensors against its own configuration, checked before any of it is
built: an mmproj GGUF against its `clip.vision.*` metadata (gguf_vl.py), a Hugging Face checkpoint's
`model.visual.*` against config.json's vision_config (hf.py).

Policy: every tensor the tower reads must be present with the shape its hyper-parameters give (hidden size,
MLP width, patch size and temporal frames, spatial merge, the projection width, the patch kernel's channels,
the DeepStack layers), the width must split into heads of an even size (vision RoPE) and the position table
must be a square grid (it is interpolated over one). Anything else is refused at load with one line naming
the file and the tensor (a ModelFileError: exit status 2), never left to a broadcasting error inside the
first image's forward. Tensors the tower does not read are not looked at (mtmd and transformers ignore them).
"""
from __future__ import annotations

import math
from typing import Callable

from ..vision import VisionConfig
from . import ModelFileError
from .names import (
    DEEPSTACK_TENSORS,
    MERGER_TENSORS,
    VISION_BLOCK_TENSORS,
    VISION_PATCH,
    VISION_POS,
    gguf_merger,
    gguf_vision_block,
)


def tower_shapes(cfg: VisionConfig) -> dict[tuple, tuple[int, ...]]:
    """Every tensor the tower reads but the patch kernel, by role -> numpy shape (rows first): ("pos",),
    ("block", i, role, "weight" | "bias"), ("merger", layer or None, role, "weight" | "bias")."""
    h, inner, out = cfg.hidden_size, cfg.intermediate_size, cfg.out_hidden_size
    merged = h * cfg.spatial_merge_size ** 2
    want: dict[tuple, tuple[int, ...]] = {("pos",): (cfg.num_position_embeddings, h)}
    block = {"norm1": (h,), "qkv": (3 * h, h), "proj": (h, h), "norm2": (h,), "fc1": (inner, h), "fc2": (h, inner)}
    for i in range(cfg.depth):
        for role, shape in block.items():
            want[("block", i, role, "weight")], want[("block", i, role, "bias")] = shape, shape[:1]
    for layer in (None, *cfg.deepstack_visual_indexes):
        norm = h if layer is None else merged   # the final merger normalises each patch, DeepStack's the merged vector
        for role, shape in (("norm", (norm,)), ("fc1", (merged, merged)), ("fc2", (out, merged))):
            want[("merger", layer, role, "weight")], want[("merger", layer, role, "bias")] = shape, shape[:1]
    return want


def gguf_vision_shapes(cfg: VisionConfig) -> dict[str, tuple[int, ...]]:
    """GGUF (mmproj) name -> numpy shape: the Conv3d patch kernel is two Conv2d ones, one per frame."""
    kernel = (cfg.hidden_size, cfg.in_channels, cfg.patch_size, cfg.patch_size)
    want = {VISION_PATCH + ".weight": kernel, VISION_PATCH + ".weight.1": kernel, VISION_PATCH + ".bias":
            (cfg.hidden_size,)}
    for key, shape in tower_shapes(cfg).items():
        if key[0] == "pos":
            want[VISION_POS] = shape
        elif key[0] == "block":
            want[f"{gguf_vision_block(key[1], key[2])}.{key[3]}"] = shape
        else:
            want[f"{gguf_merger(key[2], key[1])}.{key[3]}"] = shape
    return want


def hf_vision_shapes(cfg: VisionConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    """Hugging Face name (under `prefix`, e.g. "model.visual.") -> shape; DeepStack mergers are numbered in order."""
    p = cfg.patch_size
    want = {prefix + "patch_embed.proj.weight": (cfg.hidden_size, cfg.in_channels, cfg.temporal_patch_size, p, p),
            prefix + "patch_embed.proj.bias": (cfg.hidden_size,)}
    hf_roles = {role: names[0] for role, names in MERGER_TENSORS.items()}
    deep = {layer: j for j, layer in enumerate(cfg.deepstack_visual_indexes)}
    for key, shape in tower_shapes(cfg).items():
        if key[0] == "pos":
            want[prefix + "pos_embed.weight"] = shape
        elif key[0] == "block":
            want[f"{prefix}blocks.{key[1]}.{VISION_BLOCK_TENSORS[key[2]][0]}.{key[3]}"] = shape
        elif key[1] is None:
            want[f"{prefix}merger.{hf_roles[key[2]]}.{key[3]}"] = shape
        else:
            want[f"{prefix}deepstack_merger_list.{deep[key[1]]}.{hf_roles[key[2]]}.{key[3]}"] = shape
    assert set(DEEPSTACK_TENSORS) == set(MERGER_TENSORS)
    return want


def check_vision_config(path: str, cfg: VisionConfig) -> None:
    """ModelFileError unless the hyper-parameters themselves are usable (sizes, heads, DeepStack layers, grid)."""
    if min(cfg.depth, cfg.hidden_size, cfg.num_heads, cfg.patch_size, cfg.spatial_merge_size, cfg.in_channels) < 1:
        raise ModelFileError(f"{path}: vision hyper-parameters out of range (layers {cfg.depth}, hidden "
                             f"{cfg.hidden_size}, heads {cfg.num_heads}, patch {cfg.patch_size}, merge "
                             f"{cfg.spatial_merge_size}, channels {cfg.in_channels})")
    if cfg.hidden_size % cfg.num_heads or (cfg.hidden_size // cfg.num_heads) % 2:
        raise ModelFileError(f"{path}: vision width {cfg.hidden_size} does not split into {cfg.num_heads} heads "
                             "of an even size")
    late = [i for i in cfg.deepstack_visual_indexes if not 0 <= i < cfg.depth]
    if late:
        raise ModelFileError(f"{path}: DeepStack layer {late[0]} is not one of the {cfg.depth} vision layers")
    side = math.isqrt(max(0, cfg.num_position_embeddings))
    if side < 1 or side * side != cfg.num_position_embeddings:
        raise ModelFileError(f"{path}: the position table has {cfg.num_position_embeddings} positions, not a "
                             "square grid")


def check_vision_tensors(path: str, shape_of: Callable[[str], tuple[int, ...] | None],
                         want: dict[str, tuple[int, ...]], given_by: str) -> None:
    """ModelFileError (one line, naming `path` and the tensor) unless each tensor of `want` has its shape;
    shape_of(name): the stored numpy shape, None when the file has no such tensor."""
    for name, shape in want.items():
        got = shape_of(name)
        if got is None:
            raise ModelFileError(f"{path}: tensor {name} is missing")
        if tuple(got) != shape:
            raise ModelFileError(f"{path}: tensor {name} has shape {list(got)}; {given_by} gives {list(shape)}")
