"""Drafts from a second, smaller model (`--draft-model PATH`): its greedy continuation of the target's sequence.

Policies:
- The draft model is a text decoder (Qwen3, Qwen2, Llama, MoE; a Qwen3-VL checkpoint's text side) loaded beside
  the target, run in the same engine thread and the same native pool. It must share the target's tokenizer:
  every id stands for the same bytes and the same ids are special, up to a GGUF's padding tokens
  (`vocabulary_mismatch`, checked at load). Its logits are read only over the ids both models have rows for.
  A model with recurrent layers (Qwen3.5) drafts too: every forward after its prompt keeps the linear layers'
  state per position (recurrent_cache.HybridCache.keep_steps), so the cut back to the target's sequence lands
  on a kept state; the prompt stops one token short (its last token runs with the first draft), and a cut
  where no state is kept (another request's sequence) falls back to the longest position that has one.
- It replaces the n-gram drafts (as in llama-server, where `-md` is the draft source). Drafting is greedy
  (argmax); verification (speculative.py, generate.py) is exact whatever the draft is, so a poor draft model
  costs speed, never correctness.
- One KV cache of its own (the target's context length and KV type), holding one sequence: `cache_tokens` says
  which ids it has. The prompt runs through it after the target's prefill (in chunks, `should_cancel` polled
  between them; time to first token counts it), keeping the prefix it shares with the cached sequence. Before
  each draft the cache is cut back to the longest prefix it shares with the target's sequence (rejected drafts
  drop out here; accepted ones stay), the missing tokens run in one forward, then one forward per further
  drafted token. The last drafted token is not fed (its keys are computed, if the target accepts it, at the
  next draft). The next request keeps the prefix it shares with the last one (unless --no-prefix-cache), like
  the target's active sequence; no copies of earlier sequences are kept for the draft. Its bytes per token
  count against --cache-ram with the target's (Engine.active_bytes_per_token).
- A failed draft forward drops the draft's sequence (its keys are not trusted), and the error goes on to the
  engine, which drops its own.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence, cast

import numpy as np

_TAIL = 64  # positions _sync compares one by one; the rest of the shared prefix in one comparison

if TYPE_CHECKING:
    from .qwen3 import Qwen3Model
    from .tokenizer import Tokenizer


def vocabulary_mismatch(target: Tokenizer, draft: Tokenizer) -> str | None:
    """Why two tokenizers differ as far as drafting cares (one clause), or None when they agree: every id both
    have stands for the same bytes and is special in both or neither (but for the <|...|> spellings, which
    llama.cpp's converter makes special); ids only one has are padding (`[PAD<id>]`,
    what llama.cpp's converter fills a GGUF vocabulary up to the embedding's rows with)."""
    n = min(len(target), len(draft))
    a, b = target.all_token_bytes(n), draft.all_token_bytes(n)
    if a != b:
        i = next(i for i in range(n) if a[i] != b[i])
        return f"token {i} is {b[i]!r}, the model's is {a[i]!r}"
    longer, whose = (target, "the model's") if len(target) > len(draft) else (draft, "its")
    extra = longer.all_token_bytes(len(longer))[n:]
    odd = next((n + j for j, t in enumerate(extra) if t not in (b"", f"[PAD{n + j}]".encode())), None)
    if odd is not None:
        return f"token {odd} is only in {whose} vocabulary ({len(draft)} tokens, the model's {len(target)})"
    # llama.cpp's converter makes an added token spelled <|...|> a control token even where tokenizer.json does
    # not mark it special (<|fim_prefix|>): the same token either way
    special = {i for i in target.special_ids ^ draft.special_ids
               if i < n and not (a[i].startswith(b"<|") and a[i].endswith(b"|>"))}
    if special:
        i = min(special)
        return f"token {i} is {'' if i in draft.special_ids else 'not '}special there, unlike the model's"
    return None


class DraftModel:
    """The draft model and its one cached sequence; `drafter()` is the Engine's DrafterFactory."""

    def __init__(self, model: Qwen3Model, max_len: int, kv_dtype=np.float32, prefill_chunk: int = 256,
                 vocab_limit: int | None = None, name: str = "draft", reuse_prefix: bool = True):
        self.model = model
        self.name = name
        self.cache = model.new_cache(max_len, kv_dtype)
        self.cache_tokens: list[int] = []
        self.prefill_chunk = prefill_chunk
        self.reuse_prefix = reuse_prefix  # --no-prefix-cache: every prompt runs from scratch here too
        self.vocab_limit = min(model.config.vocab_size, vocab_limit or model.config.vocab_size)
        self.forwards_run = 0  # for tests
        self.recurrent = bool(getattr(self.cache, "exact", False))  # a HybridCache: cut only where a state is

    @property
    def bytes_per_token(self) -> int:
        return self.cache.bytes_per_token

    def drafter(self) -> ModelDrafter:
        return ModelDrafter(self)

    def warm_up(self) -> None:
        """One token through the model (first-product work at load, as Engine.warm_up), then taken back."""
        n = len(self.cache_tokens)
        if n + 1 > self.cache.max_len or (n and self.recurrent):
            self.drop_sequence()
            n = 0
        self.model.forward(np.asarray([0], dtype=np.int64), self.cache, "last")
        self.cache.truncate(n)

    def drop_sequence(self) -> None:
        self.cache.reset()
        self.cache_tokens = []

    def propose(self, seq: Sequence[int], k: int) -> list[int]:
        """Up to k greedy tokens after seq (never past the cache's room)."""
        k = min(k, self.cache.max_len - len(seq) + 1)
        if k <= 0 or not seq:
            return []
        try:
            logits = cast(np.ndarray, self._sync(seq))  # the last token ran with "last"
            out: list[int] = []
            while True:
                out.append(int(np.argmax(logits[:self.vocab_limit])))
                if len(out) >= k:
                    return out
                logits = cast(np.ndarray, self._forward([out[-1]], "last"))  # "last": never None
        except Exception:
            self.drop_sequence()
            raise

    def prefill(self, seq: Sequence[int], should_cancel: Callable[[], bool]) -> None:
        """Make the cache hold seq (a prompt), in prefill chunks; stops between chunks once should_cancel is true."""
        if not self.reuse_prefix:
            self.drop_sequence()
        try:
            if self.recurrent:  # the last token runs with the first draft, keeping a state from there on
                self._sync(seq[:-1], keep_last=True, should_cancel=should_cancel)
            else:
                self._sync(seq, keep_last=True, should_cancel=should_cancel)
        except Exception:
            self.drop_sequence()
            raise

    def _sync(self, seq: Sequence[int], keep_last: bool = False,
              should_cancel: Callable[[], bool] = lambda: False) -> np.ndarray | None:
        """Make the cache hold seq (keeping the prefix it shares, running the rest); the last position's logits
        (unless keep_last: the last token need not run again, and nothing is returned)."""
        have = self.cache_tokens
        limit = min(len(have), len(seq) if keep_last else len(seq) - 1)  # a token that runs gives the next logits
        # Within a request the two part only in the last draft's tail: one list comparison (in C) clears the rest,
        # so a step costs O(draft), not a Python walk over the whole context; another sequence walks from 0.
        n = max(0, limit - _TAIL)
        if have[:n] != list(seq[:n]):
            n = 0
        while n < limit and have[n] == seq[n]:
            n += 1
        if self.recurrent:
            cache: Any = self.cache
            n = cache.reusable(n)  # a kept state (a step of the last drafts, or a snapshot), else 0
        if n < len(have):
            self.cache.truncate(n)
            del have[n:]
        if self.recurrent:  # the target's sequence only grows from n on: states before it are not cut back to
            cast(Any, self.cache).steps = {}
        logits: np.ndarray | None = None
        for a in range(n, len(seq), self.prefill_chunk):
            if should_cancel():
                break
            chunk = list(seq[a:a + self.prefill_chunk])
            logits = self._forward(chunk, "last" if a + len(chunk) == len(seq) and not keep_last else "none")
        return logits

    def _forward(self, tokens: list[int], logits: str) -> np.ndarray | None:
        if self.recurrent:  # after the prompt, a state at every position (the next cut lands on one)
            cache: Any = self.cache
            cache.keep_steps = logits != "none"
        out = self.model.forward(np.asarray(tokens, dtype=np.int64), self.cache, logits)
        self.cache_tokens.extend(tokens)
        self.forwards_run += 1
        return out


class ModelDrafter:
    """One request's view of the draft model (speculative.Drafter): the target's sequence as the engine tells it."""
    always_proposes = True  # never a step without a draft: DraftLength measures a plain step first

    def __init__(self, draft: DraftModel):
        self.draft = draft
        self.tokens: list[int] = []

    def extend(self, tokens: Sequence[int]) -> None:
        self.tokens.extend(int(t) for t in tokens)

    def propose(self, k: int) -> list[int]:
        return self.draft.propose(self.tokens, k)

    def prefill(self, should_cancel: Callable[[], bool]) -> None:
        """The prompt through the draft model before the first token (as the target's prefill; TTFT counts it)."""
        self.draft.prefill(self.tokens, should_cancel)
