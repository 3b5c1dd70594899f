"""Qwen3.5's multi-token-prediction head (`mtp.*`, `mtp_num_hidden_layers`) as a built-in draft (`--spec mtp`).

The maths (vLLM's qwen3_next_mtp and llama.cpp's qwen35 / qwen35moe graph_mtp agree; transformers has no forward
for it): the pair (token x_{p+1}, h_p) at position p+1, h_p the main model's final hidden state at p AFTER its
final norm (llama.cpp's `h_nextn` is taken after output_norm; vLLM's model forward returns the normed states),
    x = fc(concat[pre_fc_norm_embedding(embed(x_{p+1})), pre_fc_norm_hidden(h_p)])      (embedding half first)
    x = one gated full-attention decoder layer (mtp.layers.0; the MoE block in MoE checkpoints) over x,
        with its own keys and values at the MTP positions
    logits = lm_head(mtp.norm(x)),
every RMSNorm zero-centred (1 + w, shifted by the loader). For the next draft the head's own normed output
feeds back as h (llama.cpp's chain: the draft token at p+2 pairs with the head's h_nextn). On the same GGUF,
llama.cpp's MTP context gives the same drafts token for token (tests/engine/test_mtp_gguf.py).

Policies:
- The head's keys and values live in the model's HybridCache (one more KV slot, `mtp_layer`) and the last
  position's normed hidden state as one more recurrent state, so prefix reuse, snapshots, verify steps and
  rollback carry them with the model's: every forward of the model also runs the head over its positions (the
  catch-up llama.cpp runs after each target batch: pairs of the batch's tokens with the hidden state before
  each), which costs the fc and one layer, no lm_head. A sequence start pairs its first token with zeros, as
  llama.cpp does.
- Drafting (MtpDrafter) runs the head alone from the cache's length on, one token a step, greedy, its keys kept
  in a scratch list beside the cache (never written into it): the verify forward writes those positions from
  the model's own hidden states. Verification is exact whatever the head says (speculative.py).
- A Qwen3.5-VL model's head is its text decoder's. With images in the sequence the head is fed the image
  placeholder's token embedding, and it drafts at text positions (the cache index), not at the M-RoPE ones the
  catch-up used: that can only lower acceptance, never change the output.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from .qwen3 import rope_cos_sin
from .recurrent_cache import MTP_HIDDEN, HybridCache

if TYPE_CHECKING:
    from .qwen3_5 import Qwen35Model


class _ScratchKV:
    """The head's keys/values while drafting: the cache's first n positions, then the drafted ones (kept here)."""

    def __init__(self, cache: HybridCache, n: int):
        slot = cache.kv_slot[cache.mtp_layer]  # type: ignore[index]
        self.base_k, self.base_v = cache.kv.k[slot][:, :n], cache.kv.v[slot][:, :n]  # (n_kv, n, hd)
        self.k: list[np.ndarray] = []
        self.v: list[np.ndarray] = []

    def update(self, layer: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        self.k.append(k.astype(np.float32))
        self.v.append(v.astype(np.float32))
        return (np.concatenate([self.base_k.astype(np.float32), *self.k], axis=1),  # (n_kv, S, hd)
                np.concatenate([self.base_v.astype(np.float32), *self.v], axis=1))


class MtpDrafter:
    """One request's drafts from the head (speculative.Drafter): told the sequence, it drafts after the
    cache's last position from the next token (the one just sampled, not yet fed)."""
    always_proposes = True  # DraftLength measures a plain step first

    def __init__(self, model: Qwen35Model, cache: HybridCache):
        self.model, self.cache = model, cache
        self.n_tokens = 0
        self.last = -1

    def extend(self, tokens: Sequence[int]) -> None:
        if len(tokens):
            self.n_tokens += len(tokens)
            self.last = int(tokens[-1])

    def propose(self, k: int) -> list[int]:
        cache, m = self.cache, self.model
        n = cache.length
        if k <= 0 or m.mtp is None or cache.mtp_layer is None or self.n_tokens != n + 1:
            return []
        c = m.config
        scratch = _ScratchKV(cache, n)
        h = cache.state[MTP_HIDDEN].conv.copy()  # (1, hidden) the normed hidden state at n - 1
        tok, out = self.last, []
        for i in range(k):
            cos, sin = rope_cos_sin(np.asarray([n + i]), c.rotary_dim, c.rope_theta)
            h = m.mtp.run(c, m.embed, np.asarray([tok]), h, scratch, 0, cos, sin)  # (1, hidden)
            tok = int(np.argmax(m.lm_head(h)[0]))
            out.append(tok)
        return out


def mtp_drafter(model, cache) -> Callable[[], MtpDrafter]:
    """The Engine's DrafterFactory for --spec mtp."""
    return lambda: MtpDrafter(model, cache)
