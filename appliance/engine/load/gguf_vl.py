"""llama.cpp's Qwen3-VL and Qwen3.5 pairs: a text GGUF (`general.architecture = qwen3vl`, or `qwen3vlmoe` for
Qwen3-VL-MoE: the text side's MLPs are then gguf.py's MoE blocks; `qwen35` / `qwen35moe`: gguf_qwen35.py's hybrid
decoder) plus its vision projector, an mmproj GGUF (`general.architecture = clip`, `clip.projector_type =
qwen3vl_merger` for both: llama.cpp's converter writes Qwen3.5's tower as Qwen3-VL's without DeepStack layers),
onto qwen3_vl.Qwen3VLModel / qwen3_5_vl.Qwen35VLModel over vision.VisionTower.

Policies:
- The pair: `--mmproj PATH`, else exactly one `mmproj*.gguf` beside the model (used, and logged); none: the text
  model serves text and the start-up log says images need `--mmproj`; image parts are then refused with a 400
  naming the flag (LoadedModel.images_hint). Two or more candidates and no flag: the log names them, none is
  guessed.
- Everything comes from the two files' own metadata: M-RoPE sections (`qwen3vl.rope.dimension_sections`, the
  fourth section is 0; Qwen3.5's cover the rotary part of a head), DeepStack layers (`qwen3vl.n_deepstack_layers` on the text side,
  `clip.vision.is_deepstack_layers` on the vision side), vision widths, patch size, spatial merge, image
  mean/std. A pair that does not fit (projection width != text width, DeepStack counts differ: a Qwen3-VL
  projector with a Qwen3.5 text model or the reverse, another projector) is a MismatchedPair: one line, exit status 2; so is a tower whose tensors do not fit its own metadata
  (vision_check.py), or a key or value the tower cannot be built from.
- What the file does not hold follows llama.cpp's mtmd for this projector: vision RoPE theta 10000, image token
  bounds 8..4096 merged tokens (`clip.vision.image_min_pixels` / `image_max_pixels` when present), and
  `clip.use_gelu` is the vision MLP's tanh GELU (ggml_gelu; Hugging Face's gelu_pytorch_tanh). The image pad
  token is the tokenizer's `<|image_pad|>`, the one the chat template writes.
- Checkpoint quirks (llama.cpp's converter): the Conv3d patch kernel is stored as two Conv2d kernels, one per
  temporal frame (`v.patch_embd.weight`, `.weight.1`); they are stacked back into the (hidden, C*2*p*p) matrix
  once, at load (a float32 copy of a small matrix). The merger's fc1/fc2 are `mm.0` / `mm.2`, its LayerNorm
  `v.post_ln`; DeepStack mergers are named by the vision layer they follow (`v.deepstack.L.*`). q/k/v stay
  fused as in Hugging Face, in Hugging Face row order.
- Weights stay in their stored form: the vision matrices are QuantWeights over the mapped bytes (F16, BF16, Q8_0
  and every type the text side serves go through the same native kernels), F32 ones zero-copy views.
"""
from __future__ import annotations

import glob
import logging
import os
from typing import Any

import numpy as np

from appliance.native.dequant_numpy import dequantize
from appliance.native.qtypes import QType, row_bytes

from ..image_processing import ImageProcessor
from ..vision import Linear, PatchMerger, VisionBlock, VisionConfig, VisionTower, vision_ops
from ..weights import DenseWeight
from . import LoadOptions, MismatchedPair, ModelFileError, ModelLoadError
from .names import VISION_BLOCK_TENSORS, VISION_PATCH, VISION_POS, gguf_merger, gguf_vision_block
from .vision_check import check_vision_config, check_vision_tensors, gguf_vision_shapes

log = logging.getLogger("appliance.load")
VL_ARCHITECTURES = ("qwen3vl", "qwen3vlmoe")
PROJECTOR = "qwen3vl_merger"
VISION_ROPE_THETA = 10000.0  # mtmd's qwen3vl graph (the file does not say)
MIN_IMAGE_TOKENS, MAX_IMAGE_TOKENS = 8, 4096  # mtmd's bounds for the Qwen-VL projectors (merged tokens)
IMAGE_PAD = "<|image_pad|>"
NO_MMPROJ_HINT = ("this is the text model of a Qwen3-VL pair served without its vision projector; start the "
                  "server with --mmproj mmproj.gguf to send images")


def find_mmproj(model_path: str, given: str | None) -> str | None:
    """The projector to use: `given`, else the only mmproj*.gguf beside the model (logged), else None."""
    if given:
        if not os.path.isfile(given):
            raise ModelLoadError(f"--mmproj {given}: no such file")
        return os.path.abspath(given)
    found = sorted(glob.glob(os.path.join(os.path.dirname(model_path), "mmproj*.gguf")))
    if len(found) == 1:
        log.info("vision projector: %s (the one mmproj*.gguf beside the model; --mmproj chooses another)", found[0])
        return found[0]
    if found:
        log.warning("%d mmproj*.gguf files beside the model (%s): none used; choose one with --mmproj",
                    len(found), ", ".join(os.path.basename(p) for p in found))
    return None


class MmprojFile:
    """An mmproj GGUF's metadata and tensors (gguf.open_mmproj reads it with the text loader's GGUFModelFile)."""

    def __init__(self, path: str, meta: dict[str, Any], f):
        self.path = path
        self.meta = meta
        self.f = f

    def key(self, name: str, default: Any = None) -> Any:
        v = self.meta.get(f"clip.vision.{name}", default)
        if v is None:
            raise ValueError(f"metadata key clip.vision.{name} is missing")
        return v

    def floats(self, name: str) -> np.ndarray:
        """A tensor of any stored type as float32, in numpy shape (GGUF lists ne0 first)."""
        t = self.f.tensors[name]
        shape = tuple(int(n) for n in reversed(t.shape))
        qtype = QType(int(t.tensor_type))
        raw = np.asarray(t.data).view(np.uint8).reshape(-1, row_bytes(qtype, shape[-1]))  # (rows, row_bytes)
        return dequantize(qtype, raw).reshape(shape).astype(np.float32, copy=False)

    def linear(self, name: str) -> Linear:
        return Linear(self.f.matrix(name + ".weight"), self.f.vector(name + ".bias"))

    def norm(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        return self.f.vector(name + ".weight"), self.f.vector(name + ".bias")


def vision_config(m: MmprojFile, text_kind: str = "Qwen3-VL") -> VisionConfig:
    if m.meta.get("general.architecture") != "clip" or not m.meta.get("clip.has_vision_encoder", False):
        raise MismatchedPair(f"{m.path} is not a vision projector (general.architecture "
                             f"{m.meta.get('general.architecture')!r})")
    proj = m.meta.get("clip.projector_type", m.meta.get("clip.vision.projector_type"))
    if proj != PROJECTOR:
        raise MismatchedPair(f"{m.path} has projector type {proj!r}; a {text_kind} text model needs {PROJECTOR!r}")
    if m.meta.get("clip.use_silu") or not m.meta.get("clip.use_gelu", True):
        raise ValueError("only the GELU vision MLP of Qwen3-VL is supported")
    eps = float(m.key("attention.layer_norm_epsilon", 1e-6))
    if abs(eps - 1e-6) > 1e-9:
        raise ValueError(f"vision LayerNorm epsilon {eps:g} is not supported (Qwen3-VL's is 1e-06)")
    depth = int(m.key("block_count"))
    flags = [bool(x) for x in m.key("is_deepstack_layers", [False] * depth)]
    patch = m.f.tensors[VISION_PATCH + ".weight"]
    hidden = int(m.key("embedding_length"))
    return VisionConfig(depth=depth, hidden_size=hidden, intermediate_size=int(m.key("feed_forward_length")),
                        num_heads=int(m.key("attention.head_count")), in_channels=int(patch.shape[2]),
                        patch_size=int(m.key("patch_size")),
                        temporal_patch_size=2 if VISION_PATCH + ".weight.1" in m.f else 1,
                        spatial_merge_size=int(m.key("spatial_merge_size", 2)),
                        out_hidden_size=int(m.key("projection_dim")),
                        num_position_embeddings=int(m.f.tensors[VISION_POS].shape[1]),
                        deepstack_visual_indexes=tuple(i for i, on in enumerate(flags) if on),
                        rope_theta=VISION_ROPE_THETA, hidden_act="gelu_pytorch_tanh")


def image_processor(m: MmprojFile, cfg: VisionConfig, max_pixels: int | None) -> ImageProcessor:
    per_token = (cfg.patch_size * cfg.spatial_merge_size) ** 2
    lo = int(m.key("image_min_pixels", MIN_IMAGE_TOKENS * per_token))
    hi = int(m.key("image_max_pixels", MAX_IMAGE_TOKENS * per_token))
    if max_pixels is not None:
        hi = min(hi, max_pixels)
    return ImageProcessor(patch_size=cfg.patch_size, temporal_patch_size=2, merge_size=cfg.spatial_merge_size,
                          min_pixels=lo, max_pixels=max(hi, lo),
                          image_mean=tuple(float(x) for x in m.key("image_mean")),
                          image_std=tuple(float(x) for x in m.key("image_std")))


def build_vision_tower(m: MmprojFile, cfg: VisionConfig, native: bool) -> VisionTower:
    if cfg.temporal_patch_size != 2:
        raise ValueError("the patch embedding must have two temporal frames (v.patch_embd.weight and .weight.1)")
    frames = [m.floats(VISION_PATCH + ".weight"), m.floats(VISION_PATCH + ".weight.1")]  # each (hidden, C, p, p)
    kernel = np.stack(frames, axis=2).reshape(cfg.hidden_size, -1)  # (hidden, C*2*p*p): HF's Conv3d flattened
    patch = Linear(DenseWeight(np.ascontiguousarray(kernel)), m.f.vector(VISION_PATCH + ".bias"))

    def block(i: int) -> VisionBlock:
        parts = {role: gguf_vision_block(i, role) for role in VISION_BLOCK_TENSORS}
        return VisionBlock(m.norm(parts["norm1"]), m.linear(parts["qkv"]), m.linear(parts["proj"]),
                           m.norm(parts["norm2"]), m.linear(parts["fc1"]), m.linear(parts["fc2"]))

    def merger(layer: int | None) -> PatchMerger:
        return PatchMerger(m.norm(gguf_merger("norm", layer)), m.linear(gguf_merger("fc1", layer)),
                           m.linear(gguf_merger("fc2", layer)), postshuffle_norm=layer is not None)

    pos = m.floats(VISION_POS)  # (num_position_embeddings, hidden)
    return VisionTower(cfg, patch, pos, [block(i) for i in range(cfg.depth)], merger(None),
                       [merger(i) for i in cfg.deepstack_visual_indexes], vision_ops(native))


def pair_vision(m: MmprojFile, text_hidden: int, n_deep: int, options: LoadOptions, text_kind: str
                ) -> tuple[VisionTower, ImageProcessor]:
    """The mmproj file's checked vision tower and image processor, for a text model of width text_hidden that
    expects n_deep DeepStack layers (a MismatchedPair otherwise; text_kind names it in the message)."""
    from appliance.native import kernels

    mmproj = m.path
    try:
        vcfg = vision_config(m, text_kind)
        if vcfg.out_hidden_size != text_hidden:
            raise MismatchedPair(f"the mmproj file {mmproj} projects to width {vcfg.out_hidden_size}, the text "
                                 f"model's embedding width is {text_hidden}: not a pair")
        if n_deep != len(vcfg.deepstack_visual_indexes):
            raise MismatchedPair(f"the mmproj file {mmproj} has {len(vcfg.deepstack_visual_indexes)} DeepStack "
                                 f"layers, the {text_kind} text model expects {n_deep}: not a pair")
        where = f"the mmproj file {mmproj}"
        check_vision_config(where, vcfg)
        check_vision_tensors(where, lambda name: tuple(int(n) for n in reversed(m.f.tensors[name].shape))
                             if name in m.f.tensors else None, gguf_vision_shapes(vcfg), "the vision metadata")
        return build_vision_tower(m, vcfg, kernels.available()), image_processor(m, vcfg, options.image_max_pixels)
    except ModelFileError:
        raise
    except KeyError as e:
        raise ModelFileError(f"cannot load the mmproj file {mmproj}: tensor {e} is missing") from None
    except (TypeError, ValueError) as e:
        raise ModelFileError(f"cannot load the mmproj file {mmproj}: {e}") from None


def image_pad_id(tokenizer) -> int:
    pad = tokenizer.id_of(IMAGE_PAD)
    if pad is None:
        raise ValueError(f"the tokenizer has no {IMAGE_PAD} token")
    return int(pad)


def qwen3_vl_from_pair(text_cfg, text, meta: dict[str, Any], tokenizer, m: MmprojFile, options: LoadOptions):
    """The text decoder of a qwen3vl GGUF and its mmproj file -> Qwen3VLModel."""
    from ..qwen3_vl import Qwen3VLModel

    arch = meta["general.architecture"]
    sections = [int(x) for x in meta.get(f"{arch}.rope.dimension_sections", ())]
    if len(sections) < 3 or any(sections[3:]) or sum(sections[:3]) != text_cfg.head_dim // 2:
        raise ValueError(f"{arch}.rope.dimension_sections {sections} do not cover head_dim {text_cfg.head_dim}")
    vision, processor = pair_vision(m, text_cfg.hidden_size, int(meta.get(f"{arch}.n_deepstack_layers", 0)),
                                    options, "Qwen3-VL")
    return Qwen3VLModel(text_cfg, text, vision, processor, (sections[0], sections[1], sections[2]),
                        image_pad_id(tokenizer))


def qwen35_from_pair(text_cfg, text, meta: dict[str, Any], tokenizer, m: MmprojFile, options: LoadOptions):
    """The decoder of a qwen35 / qwen35moe GGUF (gguf_qwen35.py) and its mmproj file -> Qwen35VLModel. The
    converter writes Qwen3.5's projector as Qwen3-VL's (`qwen3vl_merger`) without DeepStack layers; the M-RoPE
    sections (`rope.dimension_sections`) cover the rotary part of a head."""
    from ..qwen3_5_vl import Qwen35VLModel

    arch = meta["general.architecture"]
    sections = list(text_cfg.mrope_section)
    if len(sections) < 3 or sum(sections[:3]) != text_cfg.rotary_dim // 2:
        raise ValueError(f"{arch}.rope.dimension_sections {sections} do not cover the {text_cfg.rotary_dim} "
                         f"rotary dims")
    vision, processor = pair_vision(m, text_cfg.hidden_size, 0, options, "Qwen3.5")
    return Qwen35VLModel(text_cfg, text, vision, processor, image_pad_id(tokenizer))
