"""The shapes of an mmproj file's vision tower against its own metadata, checked before any of it is built.

Policy: every tensor the Qwen3-VL tower reads (gguf_vl.build_vision_tower) must be present with the shape its
hyper-parameters give (embedding_length, feed_forward_length, patch_size, spatial_merge_size, projection_dim, the
patch kernel's channels, the DeepStack layers), the width must split into heads of an even size (vision RoPE)
and the position table must be a square grid (it is interpolated over one). Anything else is refused at load
with one line naming the file and the tensor (a ModelFileError: exit status 2), never left to a broadcasting
error inside the first image's forward. Tensors the tower does not read are not looked at (mtmd ignores them).
"""
from __future__ import annotations

import math

from ..vision import VisionConfig
from . import ModelFileError
from .names import VISION_BLOCK_TENSORS, VISION_PATCH, VISION_POS, gguf_merger, gguf_vision_block


def vision_shapes(cfg: VisionConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the tower reads: GGUF name -> numpy shape (rows first; the file lists ne0 first)."""
    h, inner, out = cfg.hidden_size, cfg.intermediate_size, cfg.out_hidden_size
    merged = h * cfg.spatial_merge_size ** 2
    kernel = (h, cfg.in_channels, cfg.patch_size, cfg.patch_size)
    want: dict[str, tuple[int, ...]] = {VISION_PATCH + ".weight": kernel, VISION_PATCH + ".weight.1": kernel,
                                        VISION_PATCH + ".bias": (h,), VISION_POS: (cfg.num_position_embeddings, h)}
    block = {"norm1": (h, None), "qkv": (3 * h, h), "proj": (h, h), "norm2": (h, None), "fc1": (inner, h),
             "fc2": (h, inner)}
    for i in range(cfg.depth):
        for role in VISION_BLOCK_TENSORS:
            rows, cols = block[role]
            name = gguf_vision_block(i, role)
            want[name + ".weight"] = (rows,) if cols is None else (rows, cols)
            want[name + ".bias"] = (rows,)
    for layer in (None, *cfg.deepstack_visual_indexes):
        norm = h if layer is None else merged   # the final merger normalises each patch, DeepStack's the merged vector
        for role, (rows, cols) in (("norm", (norm, None)), ("fc1", (merged, merged)), ("fc2", (out, merged))):
            name = gguf_merger(role, layer)
            want[name + ".weight"] = (rows,) if cols is None else (rows, cols)
            want[name + ".bias"] = (rows,)
    return want


def check_vision_tensors(path: str, tensors: dict, cfg: VisionConfig) -> None:
    """ModelFileError (one line, naming `path` and the tensor or key) unless the tower's tensors fit `cfg`."""
    def refuse(what: str) -> ModelFileError:
        return ModelFileError(f"the mmproj file {path}: {what}")

    if cfg.depth < 1 or cfg.hidden_size < 1 or cfg.num_heads < 1 or cfg.patch_size < 1 or cfg.spatial_merge_size < 1:
        raise refuse(f"vision hyper-parameters out of range (block_count {cfg.depth}, embedding_length "
                     f"{cfg.hidden_size}, head_count {cfg.num_heads}, patch_size {cfg.patch_size}, "
                     f"spatial_merge_size {cfg.spatial_merge_size})")
    if cfg.hidden_size % cfg.num_heads or (cfg.hidden_size // cfg.num_heads) % 2:
        raise refuse(f"embedding_length {cfg.hidden_size} does not split into {cfg.num_heads} heads of an even size")
    late = [i for i in cfg.deepstack_visual_indexes if i >= cfg.depth]
    if late:
        raise refuse(f"DeepStack layer {late[0]} is past the {cfg.depth} vision layers")
    side = math.isqrt(cfg.num_position_embeddings)
    if side * side != cfg.num_position_embeddings:
        raise refuse(f"tensor {VISION_POS} has {cfg.num_position_embeddings} positions, not a square grid")
    for name, shape in vision_shapes(cfg).items():
        t = tensors.get(name)
        if t is None:
            raise refuse(f"tensor {name} is missing")
        got = tuple(int(n) for n in reversed(t.shape))
        if got != shape:
            raise refuse(f"tensor {name} has shape {list(got)}; the vision metadata gives {list(shape)}")
