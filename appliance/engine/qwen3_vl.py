"""Qwen3-VL: the Qwen3 decoder fed with image embeddings, interleaved multimodal RoPE and DeepStack.

Policies:
- A prompt with images carries one run of image-pad tokens per image (expand_image_pads), as the reference
  processor expands them. `prepare_images(cache, prompt_ids, images)` runs the vision tower once, before the
  prefill, and leaves in the cache (MRopeCache) what the prefill chunks need: per prompt position its
  three M-RoPE position ids and, at image-pad positions, the row of the image features that replaces the
  token embedding and whose DeepStack features are added after the first decoder layers. Per-sequence state
  lives in the cache, never in the model, and `truncate()` drops it (the next request sets its own).
- Positions follow the reference's get_rope_index: text runs count up on all three axes; an image's tokens
  get (t, row, col) offset by the position where the image starts, and the text after it resumes at that
  start + max(rows, cols). Past the prompt (decode) every axis is `index + delta`, delta = max position + 1
  - prompt length. A prompt without images has delta 0 and equal axes: plain 1D RoPE.
- Interleaved M-RoPE: rotary frequency k turns with the row axis when k % 3 == 1 and k < 3*sections[1], the
  column axis when k % 3 == 2 and k < 3*sections[2], else with the temporal/text axis.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from . import qwen3
from .config import Qwen3Config
from .image_processing import ImageError, ImageProcessor, PixelPatches
from .kv_cache import KVCache
from .prefix_cache import ImageKey, image_keys
from .vision import VisionTower


@dataclass
class ImageState:
    """What prefill needs about the images of the prompt in the cache."""
    positions: np.ndarray  # (3, prompt_len) int64: temporal/text, row, column position ids
    feature_row: np.ndarray  # (prompt_len,) int64: row of embeds for image-pad positions, -1 elsewhere
    embeds: np.ndarray  # (image_tokens, hidden)
    deepstack: list[np.ndarray]  # per DeepStack layer: (image_tokens, hidden)
    delta: int  # decode position = cache index + delta


class MRopeCache(KVCache):
    """A KVCache that also holds the prompt's image state (dropped by truncate/reset)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.images: ImageState | None = None

    def truncate(self, n: int) -> None:
        super().truncate(n)
        self.images = None  # the next request's prepare_images sets its own


def checked_image_keys(prompt_ids, images: list[PixelPatches], image_token_id: int) -> tuple[ImageKey, ...]:
    """Each image-pad run's (start, end, pixel digest), for prefix reuse, after checking the runs against the
    images (one run of each image's token count per image)."""
    runs = image_pad_runs(np.asarray(prompt_ids, dtype=np.int64), image_token_id)
    if len(runs) != len(images):
        raise ImageError(f"the prompt has {len(runs)} image placeholders for {len(images)} images")
    for (start, end), img in zip(runs, images):
        if end - start != img.num_tokens:
            raise ImageError(f"an image needs {img.num_tokens} image tokens; the prompt has {end - start}")
    return image_keys(runs, images)


@dataclass
class Qwen3VLModel:
    config: Qwen3Config  # the text decoder's
    text: qwen3.Qwen3Model
    vision: VisionTower
    image_processor: ImageProcessor
    mrope_section: tuple[int, int, int]
    image_token_id: int
    multimodal: bool = True
    axis_of_freq: np.ndarray = field(init=False)  # (hd/2,) 0/1/2: which position axis turns each frequency

    def __post_init__(self):
        self.axis_of_freq = mrope_axis_of_freq(self.config.head_dim // 2, self.mrope_section)

    def new_cache(self, max_len: int, dtype=np.float32) -> MRopeCache:
        c = self.config
        return MRopeCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, max_len, dtype)

    def image_keys(self, prompt_ids, images: list[PixelPatches]) -> tuple[ImageKey, ...]:
        """Each image-pad run's (start, end, pixel digest), for prefix reuse; checks runs against images."""
        return checked_image_keys(prompt_ids, images, self.image_token_id)

    def prepare_images(self, cache: MRopeCache, prompt_ids, images: list[PixelPatches],
                       should_cancel: Callable[[], bool] = lambda: False, reuse: int = 0) -> int | None:
        """Encode the prompt's images into the cache (call after truncate, before prefill). Returns the number
        of image tokens, or None if cancelled between images. Images wholly inside the first `reuse` positions
        (already in the cache) are not encoded: their feature rows are never read."""
        state = encode_prompt_images(self.vision, self.config.hidden_size, self.image_token_id, prompt_ids, images,
                                     should_cancel, reuse)
        if state is None:
            return None
        cache.images = state
        return len(state.embeds)

    def rope(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """positions (3, T) -> interleaved M-RoPE cos, sin (T, hd/2)."""
        return mrope_cos_sin(positions, self.axis_of_freq, self.config.head_dim, self.config.rope_theta)

    def forward(self, tokens: np.ndarray, cache: MRopeCache, logits: str = "last") -> np.ndarray | None:
        """Append tokens (T,) to the sequence in cache (prompt chunks or decoded tokens)."""
        tokens = np.asarray(tokens, dtype=np.int64)
        start = cache.length
        index = start + np.arange(len(tokens))
        h, positions, after_layer = multimodal_inputs(self.text.embed.rows(tokens), index, cache.images)
        cos, sin = self.rope(positions)
        h = qwen3.forward_hidden(self.text, h, cache, cos, sin, after_layer)
        if logits == "none":
            return None
        if logits == "last":
            return self.text.lm_head(h[-1:])[0]  # (vocab,)
        return self.text.lm_head(h)  # (T, vocab)


def mrope_axis_of_freq(n_freq: int, section) -> np.ndarray:
    """(n_freq,) 0/1/2: the position axis (temporal/text, row, column) each rotary frequency turns with."""
    k = np.arange(n_freq)
    return np.where((k % 3 == 1) & (k < 3 * section[1]), 1, np.where((k % 3 == 2) & (k < 3 * section[2]), 2, 0))


def mrope_cos_sin(positions: np.ndarray, axis_of_freq: np.ndarray, rotary_dim: int, theta: float
                  ) -> tuple[np.ndarray, np.ndarray]:
    """positions (3, T) -> interleaved M-RoPE cos, sin (T, rotary_dim/2)."""
    inv_freq = 1.0 / (theta ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim))  # (rd/2,)
    pos = positions[axis_of_freq].T.astype(np.float64)  # (T, rd/2): the axis each frequency follows
    ang = pos * inv_freq[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def encode_prompt_images(vision: VisionTower, hidden: int, image_token_id: int, prompt_ids,
                         images: list[PixelPatches], should_cancel: Callable[[], bool] = lambda: False,
                         reuse: int = 0) -> ImageState | None:
    """The prompt's ImageState: its image-pad runs checked against the images, each image outside the first
    `reuse` positions encoded by the tower (zeros of the right size for the others: never read), M-RoPE
    positions. None if cancelled between images."""
    ids = np.asarray(prompt_ids, dtype=np.int64)
    runs = image_pad_runs(ids, image_token_id)
    if len(runs) != len(images):
        raise ImageError(f"the prompt has {len(runs)} image placeholders for {len(images)} images")
    n_deep = len(vision.deepstack_mergers)
    embeds, deepstack = [], []
    for (start, end), img in zip(runs, images):
        if end - start != img.num_tokens:
            raise ImageError(f"an image needs {img.num_tokens} image tokens; the prompt has {end - start}")
        if end <= reuse:  # in the reused prefix: placeholders of the right size
            zeros = np.zeros((end - start, hidden), np.float32)  # (image_tokens, hidden)
            embeds.append(zeros)
            deepstack.append([zeros] * n_deep)
            continue
        if should_cancel():
            return None
        out = vision.encode(img.pixel_values, img.grid_thw)
        embeds.append(out.embeds)
        deepstack.append(out.deepstack)
    feature_row = np.full(len(ids), -1, dtype=np.int64)
    n = 0
    for start, end in runs:
        feature_row[start:end] = np.arange(n, n + end - start)
        n += end - start
    positions = mrope_positions(len(ids), runs, [img.grid_thw for img in images],
                                vision.config.spatial_merge_size)  # (3, prompt_len)
    return ImageState(
        positions=positions, feature_row=feature_row,
        embeds=np.concatenate(embeds) if embeds else np.zeros((0, hidden), np.float32),
        deepstack=[np.concatenate([d[i] for d in deepstack]) for i in range(n_deep)] if deepstack else [],
        delta=int(positions.max()) + 1 - len(ids) if len(ids) else 0)


def multimodal_inputs(h: np.ndarray, index: np.ndarray, state: ImageState | None
                      ) -> tuple[np.ndarray, np.ndarray, Callable[[int, np.ndarray], np.ndarray] | None]:
    """A chunk's token embeddings h (T, hidden) at cache positions index (T,) -> the embeddings with image
    features at image-pad positions, their (3, T) M-RoPE positions, and the DeepStack injection after layer i
    (None when the chunk has no image rows)."""
    T = len(index)
    if state is None:
        return h, np.broadcast_to(index, (3, T)), None
    n_prompt = state.positions.shape[1]
    positions = np.broadcast_to(index + state.delta, (3, T)).copy()  # (3, T)
    in_prompt = index < n_prompt
    positions[:, in_prompt] = state.positions[:, index[in_prompt]]
    rows = np.full(T, -1, dtype=np.int64)
    rows[in_prompt] = state.feature_row[index[in_prompt]]
    at = np.nonzero(rows >= 0)[0]
    if not len(at):
        return h, positions, None
    h = h.copy()
    h[at] = state.embeds[rows[at]]
    deep = state.deepstack

    def after_layer(i: int, x: np.ndarray) -> np.ndarray:
        if i < len(deep):
            x[at] += deep[i][rows[at]]
        return x
    return h, positions, after_layer if deep else None


def image_pad_runs(ids: np.ndarray, image_token_id: int) -> list[tuple[int, int]]:
    """[start, end) of each maximal run of image-pad tokens."""
    is_pad = np.concatenate([[False], ids == image_token_id, [False]])
    edges = np.nonzero(is_pad[1:] != is_pad[:-1])[0]
    return [(int(a), int(b)) for a, b in zip(edges[0::2], edges[1::2])]


def mrope_positions(n: int, runs: list[tuple[int, int]], grids: list[tuple[int, int, int]], merge: int) -> np.ndarray:
    """The reference's get_rope_index for one sequence of n tokens: (3, n) position ids."""
    pos = np.zeros((3, n), dtype=np.int64)
    current, prev = 0, 0
    for (start, end), (t, h, w) in zip(runs, grids):
        pos[:, prev:start] = current + np.arange(start - prev)  # text before the image
        current += start - prev
        lh, lw = h // merge, w // merge
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(lh), np.arange(lw), indexing="ij")
        pos[:, start:end] = np.stack([tt.reshape(-1), hh.reshape(-1), ww.reshape(-1)]) + current
        current += max(h, w) // merge
        prev = end
    pos[:, prev:] = current + np.arange(n - prev)
    return pos


def expand_image_pads(ids: list[int], image_token_id: int, counts: list[int]) -> list[int]:
    """One image-pad token per image (as the chat template writes it) -> counts[i] of them for image i."""
    out: list[int] = []
    it = iter(counts)
    for t in ids:
        if t == image_token_id:
            try:
                out.extend([t] * next(it))
            except StopIteration:
                raise ImageError("the prompt has more image placeholders than images") from None
        else:
            out.append(t)
    if next(it, None) is not None:
        raise ImageError("the prompt has fewer image placeholders than images")
    return out
