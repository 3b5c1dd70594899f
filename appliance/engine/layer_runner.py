"""Which code runs a Qwen3Model's decoder layers: chosen once at load (`choose_runner`, called by
load.finish) and stored on the model as `model.runner`.

Policy: NativeLayers (all layers in one C call per forward, native/decoder.py) when the library serves every
piece — each weight says what the C side reads through its own `native_spec()`, a SwiGLU MLP gives its three
weights, a SparseMoE its experts bound at load (`SparseMoE.native`) — else None, and qwen3.forward_hidden runs
its numpy layers (also for a cache the C side does not write). A Qwen3.5 model runs its own layers; what is
chosen for it is the delta rule's code (`native_delta`). A hook between layers (Qwen3-VL's DeepStack)
makes the C side run one call per layer. When a model's weights change form after the choice
(low-memory mode), the owner chooses again.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from appliance.native.decoder import DecoderDims, NativeDecoder

from .qwen3 import Qwen3Model, SwiGLU, rms_norm
from .qwen3_5 import NUMPY_DELTA, DeltaOps, Qwen35Model
from .qwen3_moe import SparseMoE


class NativeLayers:
    """The model's layers bound for the C side; forward_hidden is a drop-in for the numpy layers."""

    def __init__(self, decoder: NativeDecoder, norm: np.ndarray, eps: float):
        self.decoder, self.norm, self.eps = decoder, norm, eps

    def serves(self, cache) -> bool:
        return self.decoder.serves(cache)

    def forward_hidden(self, h: np.ndarray, cache, cos: np.ndarray, sin: np.ndarray, layer_done=None,
                       after_layer=None) -> np.ndarray:
        """qwen3.forward_hidden's layers in C (one call per layer when a hook runs between them): commits the T
        tokens, returns the final-normed hidden states (T, hidden)."""
        cache.check_room(h.shape[0])
        h = self.decoder.forward_layers(h, cache, cos, sin, layer_done, after_layer)
        cache.commit(h.shape[0])
        return rms_norm(h, self.norm, self.eps)


def layer_specs(model: Qwen3Model) -> list[dict] | None:
    """The plain specs native/decoder.py takes, or None when a piece has no native form."""
    specs = []
    for layer in model.layers:
        a, mlp = layer.attn, layer.mlp
        spec: dict = {"attn_norm": layer.attn_norm, "mlp_norm": layer.mlp_norm, "q_norm": a.q_norm,
                      "k_norm": a.k_norm, "q_bias": a.q_bias, "k_bias": a.k_bias, "v_bias": a.v_bias}
        linears: list[tuple[str, Any]] = [("q", a.q), ("k", a.k), ("v", a.v), ("o", a.o)]  # weight objects
        if isinstance(mlp, SparseMoE):
            if mlp.native is None:
                return None
            spec["moe"] = (mlp.native, mlp.record)
        elif isinstance(mlp, SwiGLU):
            linears += [("gate", mlp.gate), ("up", mlp.up), ("down", mlp.down)]
        else:
            return None
        for name, w in linears:
            served = w.native_spec()
            if served is None:
                return None
            spec[name], spec[name + "_shape"] = served, tuple(w.shape)
        specs.append(spec)
    return specs


def native_layers(model: Qwen3Model) -> NativeLayers | None:
    c = model.config
    specs = layer_specs(model)
    if specs is None:
        return None
    dims = DecoderDims(c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
                       c.head_dim, c.intermediate_size, c.rms_norm_eps)
    decoder = NativeDecoder.from_specs(dims, specs)
    return None if decoder is None else NativeLayers(decoder, model.norm, c.rms_norm_eps)


def choose_runner(model: Qwen3Model) -> None:
    """Store on the model which code runs its layers (NativeLayers, or None for the numpy layers; always None for
    a decoder that is not a Qwen3Model, such as Qwen3.5's hybrid layers)."""
    model.runner = native_layers(model) if isinstance(model, Qwen3Model) else None
    if isinstance(model, Qwen35Model):  # its layers run in numpy over C matmuls; the delta rule in C when there
        model.delta = native_delta() or NUMPY_DELTA


def native_delta() -> DeltaOps | None:
    """The delta rule and its causal conv1d in C: the token loop for decode and for prefill too; None without the
    library. The chunked form does as many multiply-adds per token at this width (dk = dv = 128, chunks of 64:
    ~70K per token and head, the loop ~64K), so it only pays where its products run faster than the loop's
    L1-resident column blocks; bench/delta_bench.py (16 heads, 256 tokens, 1 thread, AVX2): the loop 10.2 ms, the C
    chunked form 53.9 ms (bench/RESULTS.md). The numpy path prefills with the chunked form (matrix products beat a Python loop)."""
    from appliance.native import kernels
    if not kernels.available():
        return None

    def prefill(q, k, v, g, beta, state, chunk):
        return kernels.gated_delta_step(q, k, v, g, beta, state)
    return DeltaOps(kernels.gated_delta_step, prefill, kernels.causal_conv1d)
