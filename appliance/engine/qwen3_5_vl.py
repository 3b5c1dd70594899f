"""Qwen3.5 with images (transformers' `Qwen3_5ForConditionalGeneration` / `Qwen3_5MoeForConditionalGeneration`,
llama.cpp's qwen35 / qwen35moe text file with its mmproj): the hybrid decoder of qwen3_5.py fed with the
vision tower's image embeddings at the image-pad positions, and interleaved M-RoPE in its full-attention layers.

Policies (what differs from Qwen3-VL, qwen3_vl.py, whose image state and positions are reused as they are):
- The vision tower is Qwen3-VL's without DeepStack (no `deepstack_visual_indexes`, no DeepStack mergers): the
  final 2x2 merger's output replaces the image-pad embeddings and nothing is added after the first layers.
- M-RoPE turns only the rotary part of each full-attention head (`rotary_dim`, partial_rotary_factor), so the
  sections (e.g. 11, 11, 10) cover rotary_dim / 2 frequencies, interleaved as in Qwen3-VL. The linear-attention
  layers have no positions. Image positions are get_rope_index's, as Qwen3-VL's (qwen3_vl.mrope_positions).
- The prompt's image state lives in the cache (ImageHybridCache), never in the model; every cut of the cache
  (truncate, reset, load_prefix) drops it and the next request's prepare_images sets its own. The recurrent
  states and their snapshots are the HybridCache's: a prefix with images is reused as any other, keyed by the
  images' pixel digests (prefix_cache.image_keys).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .image_processing import ImageProcessor, PixelPatches
from .prefix_cache import ImageKey
from .qwen3_5 import Qwen35Config, Qwen35Model
from .qwen3_vl import (
    ImageState,
    checked_image_keys,
    encode_prompt_images,
    mrope_axis_of_freq,
    mrope_cos_sin,
    multimodal_inputs,
)
from .recurrent_cache import HybridCache
from .vision import VisionTower


class ImageHybridCache(HybridCache):
    """A HybridCache that also holds the prompt's image state (dropped whenever the sequence is cut)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.images: ImageState | None = None

    def truncate(self, n: int) -> None:
        super().truncate(n)
        self.images = None

    def reset(self) -> None:
        super().reset()
        self.images = None

    def load_prefix(self, k, v, n, states=None) -> None:
        super().load_prefix(k, v, n, states)
        self.images = None


@dataclass
class Qwen35VLModel:
    config: Qwen35Config  # the text decoder's
    text: Qwen35Model
    vision: VisionTower
    image_processor: ImageProcessor
    image_token_id: int
    multimodal: bool = True
    recurrent = True  # as Qwen35Model: the cache holds recurrent states
    axis_of_freq: np.ndarray = field(init=False)  # (rd/2,) 0/1/2: which position axis turns each frequency

    def __post_init__(self):
        c = self.config
        section = c.mrope_section or (c.rotary_dim // 2, 0, 0)
        if len(section) < 3 or sum(section[:3]) != c.rotary_dim // 2:
            raise ValueError(f"mrope_section {section} does not cover the rotary dimension {c.rotary_dim}")
        if self.vision.deepstack_mergers:
            raise ValueError("a Qwen3.5 vision tower has no DeepStack layers")
        if self.vision.config.out_hidden_size != c.hidden_size:
            raise ValueError(f"the vision tower's output width {self.vision.config.out_hidden_size} differs from "
                             f"the decoder's hidden size {c.hidden_size}")
        self.axis_of_freq = mrope_axis_of_freq(c.rotary_dim // 2, section)

    def new_cache(self, max_len: int, dtype=np.float32) -> ImageHybridCache:
        c = self.config
        return ImageHybridCache(c.layer_types, c.num_key_value_heads, c.head_dim, max_len, dtype,
                                (c.linear_conv_kernel_dim - 1, c.conv_dim),
                                (c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim),
                                mtp_hidden=c.hidden_size if self.text.mtp_on and self.text.mtp is not None else 0)

    def image_keys(self, prompt_ids, images: list[PixelPatches]) -> tuple[ImageKey, ...]:
        """Each image-pad run's (start, end, pixel digest), for prefix reuse; checks runs against images."""
        return checked_image_keys(prompt_ids, images, self.image_token_id)

    def prepare_images(self, cache: ImageHybridCache, prompt_ids, images: list[PixelPatches],
                       should_cancel: Callable[[], bool] = lambda: False, reuse: int = 0) -> int | None:
        """Encode the prompt's images into the cache (after the engine cut it, before prefill): the number of
        image tokens, or None if cancelled between images (qwen3_vl.encode_prompt_images)."""
        state = encode_prompt_images(self.vision, self.config.hidden_size, self.image_token_id, prompt_ids, images,
                                     should_cancel, reuse)
        if state is None:
            return None
        cache.images = state
        return len(state.embeds)

    def forward(self, tokens: np.ndarray, cache: ImageHybridCache, logits: str = "last") -> np.ndarray | None:
        """Append tokens (T,) to the sequence in cache (prompt chunks or decoded tokens)."""
        tokens = np.asarray(tokens, dtype=np.int64)
        index = cache.length + np.arange(len(tokens))  # (T,)
        h, positions, _ = multimodal_inputs(self.text.embed.rows(tokens), index, cache.images)  # no DeepStack
        c = self.config
        cos, sin = mrope_cos_sin(positions, self.axis_of_freq, c.rotary_dim, c.rope_theta)  # (T, rd/2)
        return self.text.head(self.text.forward_hidden(h, cache, cos, sin, tokens), logits)
