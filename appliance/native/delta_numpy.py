"""Numpy forms of the Gated DeltaNet operations (Qwen3.5's linear-attention layers): the causal depthwise conv1d
with its carried state, and the gated delta rule, token by token (decode) and chunked (prefill).

Policy: float32 throughout; the recurrent state S of a value head is (dk, dv) and is updated in place. The
chunked form is the same arithmetic regrouped: per chunk of C tokens and per head one unit-lower-triangular
(C x C) solve gives the chunk's state corrections, then one state update; `tests/engine/test_qwen3_5.py`
holds it equal to the token loop. gated_delta_step and gated_delta_chunked are the twins of src/delta.c (same
names and arguments in kernels.py; tests/native/test_native_delta.py fuzzes them against each other).

Per head, with q, k L2-normalised, q scaled by dk^-1/2, decay a_t = exp(g_t) and learning rate beta_t:
    S_t = a_t S_{t-1} + k_t d_t^T,   d_t = beta_t (v_t - a_t S_{t-1}^T k_t),   o_t = S_t^T q_t.
"""
from __future__ import annotations

import numpy as np


def causal_conv1d(x: np.ndarray, state: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Depthwise causal conv over time then SiLU: x (T, C) new inputs, state (K-1, C) the K-1 inputs before them
    (zeros at a sequence start; overwritten with the last K-1 inputs), w (C, K) -> (T, C)."""
    T, K = x.shape[0], w.shape[1]
    xp = np.concatenate([state, x], axis=0)  # (K-1+T, C)
    out = np.zeros_like(x)  # (T, C)
    for j in range(K):
        out += xp[j:j + T] * w[:, j]
    state[...] = xp[T:]
    return out / (1.0 + np.exp(-out))


def l2_normalize(x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """x / sqrt(sum(x^2) + eps) over the last axis (the FLA library's form)."""
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)


def gated_delta_step(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
                     state: np.ndarray) -> np.ndarray:
    """The token-by-token recurrence: q, k (T, nh, dk) (normalised, q scaled), v (T, nh, dv), g, beta (T, nh),
    state (nh, dk, dv) updated in place -> outputs (T, nh, dv)."""
    out = np.empty_like(v)  # (T, nh, dv)
    for t in range(q.shape[0]):
        state *= np.exp(g[t])[:, None, None]
        kt = k[t][:, :, None]  # (nh, dk, 1)
        mem = np.sum(state * kt, axis=1)  # (nh, dv)
        delta = (v[t] - mem) * beta[t][:, None]  # (nh, dv)
        state += kt * delta[:, None, :]
        out[t] = np.sum(state * q[t][:, :, None], axis=1)
    return out


def gated_delta_chunked(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
                        state: np.ndarray, chunk: int = 64) -> np.ndarray:
    """gated_delta_step's arithmetic regrouped by chunks of `chunk` tokens (same arguments, same result up to
    float rounding): within a chunk every head solves (I + L) D = beta V - (beta K * exp(G)) S0 for the state
    corrections D, L_ij = beta_i exp(G_i - G_j) k_i.k_j (j < i), G the cumulative log decay."""
    T = q.shape[0]
    out = np.empty_like(v)  # (T, nh, dv)
    for s in range(0, T, chunk):
        e = min(T, s + chunk)
        out[s:e] = _chunk(q[s:e].transpose(1, 0, 2), k[s:e].transpose(1, 0, 2), v[s:e].transpose(1, 0, 2),
                          g[s:e].T, beta[s:e].T, state).transpose(1, 0, 2)
    return out


def _chunk(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
           state: np.ndarray) -> np.ndarray:
    """One chunk, heads first: q, k (nh, C, dk), v (nh, C, dv), g, beta (nh, C); state (nh, dk, dv) updated."""
    C = q.shape[1]
    G = np.cumsum(g, axis=1)  # (nh, C) log decay from the chunk start
    lower = np.tril(np.ones((C, C), dtype=bool))  # j <= i
    pair = np.exp(np.where(lower, G[:, :, None] - G[:, None, :], -np.inf))  # (nh, C, C)
    kb = k * beta[:, :, None]  # (nh, C, dk)
    L = (kb @ k.transpose(0, 2, 1)) * pair  # (nh, C, C)
    rhs = v * beta[:, :, None] - (kb * np.exp(G)[:, :, None]) @ state  # (nh, C, dv)
    D = _unit_lower_solve(np.tril(L, -1), rhs)  # (nh, C, dv): the chunk's state corrections
    attn = (q @ k.transpose(0, 2, 1)) * pair  # (nh, C, C) causal, decayed
    out = (q * np.exp(G)[:, :, None]) @ state + attn @ D  # (nh, C, dv)
    last = G[:, -1:]  # (nh, 1)
    state *= np.exp(last)[:, :, None]
    state += (k * np.exp(last - G)[:, :, None]).transpose(0, 2, 1) @ D  # (nh, dk, dv)
    return out


def _unit_lower_solve(L: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Solve (I + L) x = b for strictly lower-triangular L (nh, C, C), b (nh, C, n): forward substitution."""
    x = np.empty_like(b)
    for i in range(b.shape[1]):
        x[:, i] = b[:, i] - np.einsum("hj,hjn->hn", L[:, i, :i], x[:, :i])
    return x


def gated_rms_norm(x: np.ndarray, z: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm of x (..., dv) times w, gated by silu(z) (the output norm of a linear-attention layer)."""
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w
    return y * (z / (1.0 + np.exp(-z)))
