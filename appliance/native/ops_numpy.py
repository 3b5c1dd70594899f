"""Numpy twins of the C decoder operations in src/ops.c (same names and argument order as kernels.py's
wrappers). Float paths: the C side sums in a different order, so tests compare with a tight tolerance."""
from __future__ import annotations

import numpy as np


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x (..., n), w (n,) -> x / sqrt(mean(x^2) + eps) * w, in float32 (the engine's numpy layers use this too)."""
    var = np.mean(x * x, axis=-1, keepdims=True)
    return x / np.sqrt(var + eps) * w


def rotate_half(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE on x (..., hd) with cos/sin broadcasting to (..., hd/2): the one RoPE formula."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE on x (T, nh, hd) with cos/sin (T, hd/2)."""
    return rotate_half(x, cos[:, None, :], sin[:, None, :]).astype(np.float32)


def swiglu(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """silu(g) * u (the engine's SwiGLU MLP uses this too)."""
    return g / (1.0 + np.exp(-g)) * u


def grouped_attention(q: np.ndarray, keys: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Causal grouped-query attention in float32: q (H, T, hd) for the last T of S positions, keys/values
    (KV, S, hd) -> (H, T, hd). The one formula: the engine's numpy layers and the twin below."""
    H, T, hd = q.shape
    KV, S = keys.shape[:2]
    g = q.reshape(KV, H // KV * T, hd)  # heads sharing a KV head, stacked: (KV, rep*T, hd)
    scores = g @ keys.transpose(0, 2, 1) * np.float32(1.0 / np.sqrt(hd))  # (KV, rep*T, S)
    scores = scores.reshape(KV, H // KV, T, S)
    if T > 1:  # causal: query i sees keys 0..S-T+i
        mask = np.arange(S)[None, :] > (S - T + np.arange(T))[:, None]  # (T, S)
        scores = np.where(mask, np.float32(-np.inf), scores)
    scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
    scores /= scores.sum(axis=-1, keepdims=True)
    return (scores.reshape(KV, H // KV * T, S) @ values).reshape(H, T, hd)


def attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, S: int) -> np.ndarray:
    """Causal grouped-query attention: q (T, H, hd) for the last T of S positions, caches (KV, max_len, hd)
    of float32 or float16 (widened exactly, computed in float32) -> (T, H, hd)."""
    k, v = (a[:, :S].astype(np.float32) for a in (k_cache, v_cache))  # (KV, S, hd)
    out = grouped_attention(np.ascontiguousarray(q.transpose(1, 0, 2)), k, v)
    return out.transpose(1, 0, 2).astype(np.float32)


def route(x: np.ndarray, router: np.ndarray, top_k: int, normalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """Top-k experts per token and their weights: (T, k) ids and (T, k) float32 weights (softmax over all
    experts in float32; ties go to the lower expert id)."""
    logits = x @ router.T  # (T, E)
    probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    top = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]  # (T, k)
    w = np.take_along_axis(probs, top, axis=-1)  # (T, k)
    if normalize:
        w = w / w.sum(axis=-1, keepdims=True)
    return top, w.astype(np.float32)


def moe_ffn(x: np.ndarray, router: np.ndarray, top_k: int, norm_topk: bool, gate, up, down) -> np.ndarray:
    """Routed experts (kernels.moe_ffn's twin): gate/up/down are (qtype, per-expert matrices); each used expert
    runs once over its tokens, the outputs are added in ascending expert order."""
    from .twins import matmul
    x = np.ascontiguousarray(x, dtype=np.float32)
    top, w = route(x, router, top_k, norm_topk)
    out = np.zeros_like(x)  # (T, hidden)
    for e in np.unique(top):
        rows, slot = np.nonzero(top == e)  # tokens routed to expert e
        xe = x[rows]
        g, u = matmul(gate[0], gate[1][e], xe), matmul(up[0], up[1][e], xe)  # (t, inter)
        out[rows] += matmul(down[0], down[1][e], swiglu(g, u)) * w[rows, slot][:, None]
    return out
