"""Numpy twins of the C decoder operations in src/ops.c (same names and argument order as kernels.py's
wrappers). Float paths: the C side sums in a different order, so tests compare with a tight tolerance."""
from __future__ import annotations

import numpy as np


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x (T, n), w (n,) -> x / sqrt(mean(x^2) + eps) * w."""
    var = np.mean(x.astype(np.float64) ** 2, axis=-1, keepdims=True)
    return (x / np.sqrt(var + eps) * w).astype(np.float32)


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE on x (T, nh, hd) with cos/sin (T, hd/2)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]  # (T, 1, hd/2)
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(np.float32)


def swiglu(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    return (g / (1.0 + np.exp(-g)) * u).astype(np.float32)


def attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, S: int) -> np.ndarray:
    """Causal grouped-query attention: q (T, H, hd) for the last T of S positions, caches (KV, max_len, hd)
    of float32 or float16 (widened exactly, computed in float32) -> (T, H, hd)."""
    T, H, hd = q.shape
    KV = k_cache.shape[0]
    k, v = (a[:, :S].astype(np.float32) for a in (k_cache, v_cache))  # (KV, S, hd)
    g = q.transpose(1, 0, 2).reshape(KV, H // KV * T, hd)  # heads sharing a KV head: (KV, rep*T, hd)
    scores = (g @ k.transpose(0, 2, 1) / np.sqrt(hd)).reshape(KV, H // KV, T, S)
    mask = np.arange(S)[None, :] > (S - T + np.arange(T))[:, None]  # (T, S)
    scores = np.where(mask, -np.inf, scores)
    p = np.exp(scores - scores.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    out = p.reshape(KV, H // KV * T, S) @ v  # (KV, rep*T, hd)
    return out.reshape(H, T, hd).transpose(1, 0, 2).astype(np.float32)


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
