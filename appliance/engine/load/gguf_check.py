"""What a GGUF model needs of its file, checked before any tensor is wrapped into a weight (gguf.py calls these
between reading the container and building the model).

Policies:
- Metadata is typed: a hyper-parameter is an integer (not a bool, a float or an array) inside a stated range,
  a float is finite and inside its range, a string is a string. A value of the wrong type or range is a
  ValueError naming the key, never an int() of a list or of inf deep in the loader.
- The tensor set is the architecture's, complete and nothing else: every tensor the decoder reads is present
  with the GGUF shape (ne0 first) the hyper-parameters give, 1-D tensors are F32 or F16, optional groups
  (q/k norms, q/k/v biases) are in every layer or in none, and a tensor no part of the model reads is refused
  (llama.cpp refuses such files too: "wrong number of tensors"), except a part the architecture declares unread
  (Qwen3.5's multi-token-prediction block). Shapes compare as ggml's ne, trailing 1s dropped ([64, 1] is [64]).
  The container's own checks (bounds, overlap, alignment) are gguf_file.py's.
- The bounds are generous limits on what the engine can hold, not guesses about published models: they only
  keep a crafted header from asking for absurd allocations before a tensor's bytes are looked at.
"""
from __future__ import annotations

import math
from typing import Any

from appliance.native.qtypes import QType

from .names import (
    EXPERT_PROJECTIONS,
    LAYER_TENSORS,
    MODEL_TENSORS,
    QWEN35_TENSORS,
    gguf_experts,
    gguf_layer,
    gguf_model,
)

MAX_WIDTH = 1 << 20  # hidden, intermediate sizes
MAX_HEADS = 1 << 12
MAX_LAYERS = 1 << 12
MAX_EXPERTS = 1 << 12
MAX_VOCAB = 1 << 24
MAX_CONTEXT = 1 << 24


def meta_int(meta: dict[str, Any], key: str, default: int | None = None, lo: int = 1, hi: int = 1 << 31) -> int:
    """An integer metadata value in lo..hi (default when absent; ValueError when absent without one)."""
    v = meta.get(key, default)
    if v is None:
        raise ValueError(f"metadata key {key} is missing")
    if not isinstance(v, int) or isinstance(v, bool):
        raise ValueError(f"metadata key {key}: expected an integer, got {type(v).__name__}")
    if not lo <= v <= hi:
        raise ValueError(f"metadata key {key}: {v} is out of range {lo}..{hi}")
    return v


def meta_float(meta: dict[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    """A finite number in (lo, hi] (lo excluded: epsilons and RoPE bases are positive)."""
    v = meta.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"metadata key {key}: expected a number, got {type(v).__name__}")
    if not (math.isfinite(v) and lo < v <= hi):
        raise ValueError(f"metadata key {key}: {v} is out of range ({lo}, {hi}]")
    return float(v)


def f32_value(v) -> float:
    """A float32 metadata value as the decimal it was written from (1e-06, not 9.99999997e-07)."""
    return float(f"{float(v):.7g}")


def meta_str(meta: dict[str, Any], key: str, default: str | None = None) -> str | None:
    v = meta.get(key, default)
    if v is not None and not isinstance(v, str):
        raise ValueError(f"metadata key {key}: expected a string, got {type(v).__name__}")
    return v


def meta_list(meta: dict[str, Any], key: str, item: type) -> list | None:
    """A metadata array whose items are all of type `item` (bools are not ints), or None when absent."""
    v = meta.get(key)
    if v is None:
        return None
    if not isinstance(v, list) or not all(type(x) is item for x in v):
        raise ValueError(f"metadata key {key}: expected an array of {item.__name__}")
    return v


def expected_shapes(cfg, moe, sparse_layers: set[int], qk_norm: bool, bias: bool) -> dict[str, tuple[int, ...]]:
    """Every tensor a decoder of this config reads: GGUF name -> GGUF shape (ne0, the row length, first)."""
    H, V, hd = cfg.hidden_size, cfg.vocab_size, cfg.head_dim
    q, kv, inter = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd, cfg.intermediate_size
    want: dict[str, tuple[int, ...]] = {gguf_model("embed"): (H, V), gguf_model("norm"): (H,)}
    if not cfg.tie_word_embeddings:
        want[gguf_model("lm_head")] = (H, V)
    for i in range(cfg.num_hidden_layers):
        layer = {"attn_norm": (H,), "q": (H, q), "k": (H, kv), "v": (H, kv), "o": (q, H), "mlp_norm": (H,)}
        if qk_norm:
            layer.update(q_norm=(hd,), k_norm=(hd,))
        if bias:
            layer.update(q_bias=(q,), k_bias=(kv,), v_bias=(kv,))
        if i in sparse_layers:
            E, I = moe.num_experts, moe.moe_intermediate_size
            layer["router"] = (H, E)
            want.update({gguf_experts(i, "gate"): (H, I, E), gguf_experts(i, "up"): (H, I, E),
                         gguf_experts(i, "down"): (I, H, E)})
        else:
            layer.update(gate=(H, inter), up=(H, inter), down=(inter, H))
        want.update({gguf_layer(i, role): shape for role, shape in layer.items()})
    return want


VECTOR_TYPES = (QType.F32, QType.F16)


def check_tensors(path_tensors: dict, cfg, moe=None, heads: frozenset[str] = frozenset()) -> set[int]:
    """Refuse (ValueError naming the tensor) unless the file's tensors are exactly the decoder's (and the extra
    `heads` the file's kind reads, such as a reranker's cls.output.weight), each of the shape the config gives.
    Returns the sparse (mixture-of-experts) layers."""
    sparse = {i for i in range(cfg.num_hidden_layers) if gguf_layer(i, "router") in path_tensors} if moe else set()
    check_tensor_set(path_tensors, expected_shapes(cfg, moe, sparse, cfg.qk_norm, cfg.attention_bias), heads)
    return sparse


def ne(shape) -> tuple[int, ...]:
    """A GGUF shape without trailing 1s (ggml pads ne with 1s: [64, 1] is the vector [64])."""
    dims = [int(n) for n in shape]
    while len(dims) > 1 and dims[-1] == 1:
        dims.pop()
    return tuple(dims)


def check_tensor_set(path_tensors: dict, want: dict[str, tuple[int, ...]], heads: frozenset[str] = frozenset(),
                     unread: tuple[str, ...] = ()) -> None:
    """The file's tensors are `want` (name -> GGUF shape, ne0 first), plus `heads`, plus any whose name starts
    with one of `unread` (a part the file carries that this engine does not run, e.g. Qwen3.5's MTP block)."""
    for name, shape in want.items():
        t = path_tensors.get(name)
        if t is None:
            raise ValueError(f"tensor {name} is missing")
        got = ne(t.shape)
        if got != ne(shape):
            raise ValueError(f"tensor {name} has shape {list(got)}; the model's hyper-parameters give {list(shape)}")
        if len(ne(shape)) == 1 and t.tensor_type not in VECTOR_TYPES:
            raise ValueError(f"tensor {name} has type {t.tensor_type.name}; a 1-D tensor must be F32 or F16")
    extra = sorted(n for n in set(path_tensors) - set(want) - heads if not n.startswith(unread))
    if extra:
        known = [v[1] for v in LAYER_TENSORS.values()] + [v[1] for v in MODEL_TENSORS.values()] \
            + [v[1] for v in QWEN35_TENSORS.values()] + [f"ffn_{p}_exps.weight" for p in EXPERT_PROJECTIONS]
        tail = extra[0].split(".", 2)[-1] if extra[0].startswith("blk.") else extra[0]
        why = "not used by this model's layers (inconsistent with its metadata)" if tail in known \
            else "not a tensor of this architecture"
        raise ValueError(f"tensor {extra[0]} is {why}" + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))
