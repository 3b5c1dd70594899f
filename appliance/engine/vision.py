"""The Qwen3-VL vision tower: preprocessed pixel patches -> image embeddings for the decoder, plus the
DeepStack features of the listed vision layers.

Policies:
- One image at a time: attention inside the tower is bidirectional over one image's patches, so encoding
  images separately is exactly the reference's packed (cu_seqlens) attention; the outputs are concatenated.
- Patches arrive in merge-block order (image_processing.patchify), so the 2x2 merger is a reshape of
  consecutive rows. The 3D patch convolution (kernel = stride = patch) is a matmul over flattened patches.
- Weights are the same linear-weight objects as the decoder's (weights.py), so faster kernels drop in.
- LayerNorm, the tanh GELU and attention come from a VisionOps chosen once at load: the C library's
  (native/src/vision.c: blocked, multi-threaded attention with f32 accumulation) when it is there, else the
  numpy functions below, which are their twins.
- Attention runs head by head over blocks of queries: the scores stay cache-sized (numpy's elementwise
  passes are single-threaded and memory-bound) and an image of thousands of patches never materialises a
  (heads, N, N) matrix.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from .qwen3 import apply_rope

ATTN_BLOCK_ELEMS = 2**20  # score elements per attention block (one head: 4 MB of float32)


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int
    num_position_embeddings: int
    deepstack_visual_indexes: tuple[int, ...]
    rope_theta: float = 10000.0
    hidden_act: str = "gelu_pytorch_tanh"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_dict(cls, d: dict) -> "VisionConfig":
        act = d.get("hidden_act", "gelu_pytorch_tanh")
        if act not in ACTIVATIONS:
            raise ValueError(f"vision activation {act!r} is not supported")
        rope = d.get("rope_parameters") or {}
        return cls(depth=int(d["depth"]), hidden_size=int(d["hidden_size"]),
                   intermediate_size=int(d["intermediate_size"]), num_heads=int(d["num_heads"]),
                   in_channels=int(d.get("in_channels", 3)), patch_size=int(d.get("patch_size", 16)),
                   temporal_patch_size=int(d.get("temporal_patch_size", 2)),
                   spatial_merge_size=int(d.get("spatial_merge_size", 2)), out_hidden_size=int(d["out_hidden_size"]),
                   num_position_embeddings=int(d["num_position_embeddings"]),
                   deepstack_visual_indexes=tuple(int(i) for i in d.get("deepstack_visual_indexes", ())),
                   rope_theta=float(rope.get("rope_theta", 10000.0)), hidden_act=act)


def erf(x: np.ndarray) -> np.ndarray:
    """Abramowitz & Stegun 7.1.26 in float64 (absolute error < 1.5e-7), numpy has no erf."""
    z = np.abs(x.astype(np.float64))
    t = 1.0 / (1.0 + 0.3275911 * z)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    return (np.sign(x) * (1.0 - poly * np.exp(-z * z))).astype(np.float32)


def gelu_erf(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + erf(x * np.float32(1 / np.sqrt(2.0))))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(np.float32(np.sqrt(2.0 / np.pi)) * (x + np.float32(0.044715) * x * x * x)))


ACTIVATIONS = {"gelu_pytorch_tanh": gelu_tanh, "gelu": gelu_erf}


def layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    mu = x.mean(axis=-1, keepdims=True)
    d = x - mu
    var = np.mean(d * d, axis=-1, keepdims=True)
    return d / np.sqrt(var + eps) * w + b


@dataclass
class Linear:
    weight: Callable[[np.ndarray], np.ndarray]  # (out, in) linear-weight object
    bias: np.ndarray  # (out,)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return self.weight(x) + self.bias


@dataclass
class VisionBlock:
    norm1: tuple[np.ndarray, np.ndarray]  # LayerNorm weight, bias
    qkv: Linear  # hidden -> 3*hidden
    proj: Linear
    norm2: tuple[np.ndarray, np.ndarray]
    fc1: Linear
    fc2: Linear


@dataclass
class PatchMerger:
    """2x2 neighbouring patches -> one decoder token. The final merger normalises each patch before the
    shuffle; the DeepStack mergers normalise the shuffled (4*hidden) vector."""
    norm: tuple[np.ndarray, np.ndarray]
    fc1: Linear
    fc2: Linear
    postshuffle_norm: bool

    def __call__(self, x: np.ndarray, unit: int, norm: Callable | None = None) -> np.ndarray:
        n, d = x.shape
        norm = norm or layer_norm
        if self.postshuffle_norm:
            x = norm(x.reshape(n // unit, d * unit), *self.norm)  # (n/4, 4*hidden)
        else:
            x = norm(x, *self.norm).reshape(n // unit, d * unit)
        return self.fc2(gelu_erf(self.fc1(x)))  # (n/4, out_hidden)


@dataclass(frozen=True)
class VisionOps:
    """The tower's non-matmul operations, all (array in -> array out) with the numpy twins' signatures."""
    layer_norm: Callable  # (x (T, n), w, b) -> (T, n)
    gelu_tanh: Callable  # x -> x
    self_attention: Callable  # (qkv (N, 3*hidden), heads, cos, sin) -> (N, hidden)


def vision_ops(native: bool) -> VisionOps:
    if native:
        from appliance.native import kernels
        return VisionOps(kernels.layer_norm, kernels.gelu_tanh, kernels.self_attention)
    return VisionOps(layer_norm, gelu_tanh, self_attention)


@dataclass
class VisionOutput:
    embeds: np.ndarray  # (tokens, out_hidden): one row per image-pad token
    deepstack: list[np.ndarray]  # per DeepStack layer: (tokens, out_hidden)


@dataclass
class VisionTower:
    config: VisionConfig
    patch_embed: Linear  # (hidden, C*tp*p*p): the Conv3d kernel flattened
    pos_embed: np.ndarray  # (num_position_embeddings, hidden)
    blocks: list[VisionBlock]
    merger: PatchMerger
    deepstack_mergers: list[PatchMerger]
    ops: VisionOps = None  # type: ignore[assignment]  # None: the numpy functions (__post_init__)

    def __post_init__(self):
        if self.ops is None:
            self.ops = vision_ops(False)

    def run_block(self, blk: VisionBlock, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        """One pre-norm block over one image's patches x (N, hidden)."""
        ops, cfg = self.ops, self.config
        act = ops.gelu_tanh if cfg.hidden_act == "gelu_pytorch_tanh" else ACTIVATIONS[cfg.hidden_act]
        x = x + blk.proj(ops.self_attention(blk.qkv(ops.layer_norm(x, *blk.norm1)), cfg.num_heads, cos, sin))
        return x + blk.fc2(act(blk.fc1(ops.layer_norm(x, *blk.norm2))))

    def encode(self, pixel_values: np.ndarray, grid_thw: tuple[int, int, int]) -> VisionOutput:
        """One image's patches (t*h*w, C*tp*p*p) -> its decoder embeddings and DeepStack features."""
        cfg = self.config
        t, h, w = grid_thw
        m = cfg.spatial_merge_size
        rows, cols = merge_block_coords(h, w, m)  # (h*w,) each, in patch order
        rows, cols = np.tile(rows, t), np.tile(cols, t)
        x = self.patch_embed(pixel_values.astype(np.float32, copy=False))  # (N, hidden)
        x = x + interpolated_pos_embed(self.pos_embed, rows, cols, h, w)
        cos, sin = vision_rope(rows, cols, cfg.head_dim, cfg.rope_theta)  # (N, hd/2)
        deepstack = []
        for i, blk in enumerate(self.blocks):
            x = self.run_block(blk, x, cos, sin)
            if i in cfg.deepstack_visual_indexes:
                merger = self.deepstack_mergers[cfg.deepstack_visual_indexes.index(i)]
                deepstack.append(merger(x, m * m, self.ops.layer_norm))
        return VisionOutput(self.merger(x, m * m, self.ops.layer_norm), deepstack)


def merge_block_coords(h: int, w: int, m: int) -> tuple[np.ndarray, np.ndarray]:
    """Row and column of each patch when patches are ordered (block row, block col, row in block, col in
    block), the order of image_processing.patchify."""
    r, c = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")  # (h, w)
    order = lambda a: a.reshape(h // m, m, w // m, m).transpose(0, 2, 1, 3).reshape(-1)
    return order(r), order(c)


def interpolated_pos_embed(table: np.ndarray, rows: np.ndarray, cols: np.ndarray, h: int, w: int) -> np.ndarray:
    """The learned square (side x side) position table resampled bilinearly (corners aligned) to an h x w
    patch grid, looked up at each patch's (row, col): (N, hidden)."""
    side = int(round(np.sqrt(table.shape[0])))

    def taps(index: np.ndarray, size: int):
        src = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))  # (N,)
        lo = np.floor(src)
        frac = src - lo
        i0 = np.clip(lo.astype(np.int64), 0, side - 1)
        i1 = np.clip(lo.astype(np.int64) + 1, 0, side - 1)
        return (i0, i1), (1.0 - frac, frac)

    (r0, r1), (wr0, wr1) = taps(rows, h)
    (c0, c1), (wc0, wc1) = taps(cols, w)
    out = (table[r0 * side + c0] * (wr0 * wc0)[:, None] + table[r0 * side + c1] * (wr0 * wc1)[:, None]
           + table[r1 * side + c0] * (wr1 * wc0)[:, None] + table[r1 * side + c1] * (wr1 * wc1)[:, None])
    return out.astype(np.float32)  # (N, hidden)


def vision_rope(rows: np.ndarray, cols: np.ndarray, head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """2D rotary angles: the first half of the rotated pairs turn with the patch row, the second half with the
    column, each at the frequencies of a head_dim/2 rotary embedding."""
    spatial = head_dim // 2
    inv_freq = (1.0 / (theta ** (np.arange(0, spatial, 2, dtype=np.float32) / np.float32(spatial)))).astype(np.float32)
    ang = np.concatenate([rows[:, None] * inv_freq, cols[:, None] * inv_freq], axis=-1).astype(np.float32)  # (N, hd/2)
    return np.cos(ang), np.sin(ang)


def self_attention(qkv: np.ndarray, heads: int, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Bidirectional multi-head attention over one image: qkv (N, 3*hidden) -> (N, hidden). One head and one
    block of queries at a time, so the score matrix stays cache-sized and every product is a plain 2D GEMM."""
    n = qkv.shape[0]
    q, k, v = qkv.reshape(n, 3, heads, -1).transpose(1, 2, 0, 3)  # each (H, N, hd)
    hd = q.shape[-1]
    q = apply_rope(q, cos, sin) * np.float32(hd ** -0.5)  # (H, N, hd)
    k = apply_rope(k, cos, sin)
    out = np.empty((n, heads, hd), np.float32)
    block = max(1, ATTN_BLOCK_ELEMS // n)
    for h in range(heads):
        k_t = k[h].T  # (hd, N): a transposed view BLAS takes as is
        v_h = np.ascontiguousarray(v[h])  # (N, hd)
        for s in range(0, n, block):
            scores = q[h, s:s + block] @ k_t  # (b, N)
            scores -= scores.max(axis=-1, keepdims=True)
            np.exp(scores, out=scores)
            out[s:s + block, h] = (scores @ v_h) / scores.sum(axis=-1, keepdims=True)
    return out.reshape(n, heads * hd)  # (N, hidden)
