"""Speculative decoding: drafts of the next tokens, verified by the target model in one forward.

Policies:
- Verification is exact. The engine feeds the last sampled token plus k drafted tokens in one forward (a short
  prefill tile, logits at every position) and samples each position with the request's own sampler, in order,
  exactly as plain decoding would (penalties, top-k/p, min-p, the seeded generator, grammar masks). A drafted
  token is accepted only when the sampled token equals it; the first mismatch is emitted as the sampled token
  and the rest of the run is dropped (the cache rolls back to the accepted length). For deterministic drafts
  (n-gram lookup, a draft model's greedy choice) this is speculative sampling's accept/resample rule with the
  draft distribution one-hot: the emitted sequence has the target distribution, and with the same seed it is
  the sequence plain decoding draws (the generator is consumed once per emitted token, as without drafts).
- The default (`auto`): a Qwen3.5 checkpoint's own multi-token-prediction head (`mtp`, qwen3_5_mtp.py) when
  it has one and no --draft-model is given (a trained draft beats a lookup on free text, and it costs one
  decoder layer a step), else drafts from the prompt. `--spec ngram` keeps the lookup on such a model.
- Drafts from the prompt (`ngram`): the most recent earlier occurrence of the last n tokens
  (n = 3, then 2) in the prompt and the output so far proposes the tokens that followed it. No match, no
  draft: a step without a draft is a plain decode step and costs nothing extra.
- Drafts from a model (`--draft-model`, draft_model.py): a smaller model of the same tokenizer drafts its greedy
  continuation; it replaces the prompt's drafts. The cost of a run the draft length weighs is drafting plus
  verifying.
- Models whose cache holds recurrent states (Qwen3.5's linear layers) draft too: the verify forward keeps the
  linear layers' state after each drafted position (recurrent_cache.HybridCache.keep_steps), and the rollback
  to the accepted length restores the one there (the full-attention KV is cut as usual).
- Draft length adapts: it grows after a fully accepted run and shrinks to what the last run accepted plus one.
  A run pays when the tokens it yields per verify outweigh what drafting and the wider forward cost over a
  one-token step; both costs are measured as the request runs (a drafter that always has a draft, a model,
  gets the engine's first decode step run plain, to know a step's). When the recent yield per cost falls
  below 1, drafting pauses for a while (doubling pauses) and is retried.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, Protocol, Sequence

SpecMode = Literal["auto", "ngram", "mtp", "none"]
SPEC_MODES: tuple[SpecMode, ...] = ("auto", "ngram", "mtp", "none")


@dataclass(frozen=True)
class SpecOptions:
    mode: SpecMode = "auto"  # auto: the model's MTP head when its checkpoint has one, else the prompt's n-grams
    draft_max: int = 8   # drafted tokens per verify, at most (llama-server's --draft-max)
    draft_min: int = 1   # and at least, when drafting (--draft-min)

    def __post_init__(self) -> None:
        if self.mode not in SPEC_MODES:
            raise ValueError(f"speculative mode must be one of {', '.join(SPEC_MODES)}")
        if not 1 <= self.draft_min <= self.draft_max:
            raise ValueError("need 1 <= draft_min <= draft_max")

    @property
    def enabled(self) -> bool:
        return self.mode != "none"


class Drafter(Protocol):
    """Where drafts come from: told every token of the sequence (prompt, then each emitted token), asked for up
    to k tokens that may come next."""

    def extend(self, tokens: Sequence[int]) -> None: ...

    def propose(self, k: int) -> list[int]: ...

    # optional: `always_proposes = True` (a model drafter), so plain steps are not left to a lack of drafts;
    # `prefill(should_cancel)`, work on the prompt before the first token (a model drafter's prompt prefill)


DrafterFactory = Callable[[], Drafter]


class NgramDrafter:
    """Prompt lookup: an index from each n-gram of the sequence so far to where it last ended."""

    def __init__(self, n_max: int = 3, n_min: int = 2):
        self.n_sizes = tuple(range(n_max, n_min - 1, -1))
        self.tokens: list[int] = []
        self._last: dict[tuple[int, ...], int] = {}  # n-gram -> index of the token that followed its last use

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens to the sequence. The n-grams ending at the newest token are indexed only when the next
        token arrives, so a lookup of the current suffix finds an earlier occurrence, never itself."""
        seq = self.tokens
        for t in tokens:
            seq.append(int(t))
            end = len(seq) - 1  # the new token follows the n-grams ending just before it
            for n in self.n_sizes:
                if end >= n:
                    self._last[tuple(seq[end - n:end])] = end

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the longest suffix seen before (empty: no match)."""
        seq = self.tokens
        for n in self.n_sizes:
            if len(seq) < n:
                continue
            at = self._last.get(tuple(seq[-n:]))
            if at is not None:
                return seq[at:at + k]
        return []


class DraftLength:
    """How many tokens to draft next, from the acceptance and the measured costs of this request's steps."""

    def __init__(self, options: SpecOptions, measure_first: bool = False):
        self.options = options
        self.measure_first = measure_first   # a drafter that always proposes (a model) never makes a plain step
        self.k = min(4, options.draft_max)
        self.step_ms: float | None = None    # one-token decode step, running mean
        self.gain = 1.0                      # recent (tokens per verify) / (verify cost in steps), running mean
        self.verifies = 0
        self.pause = 0                       # plain steps left before drafting again
        self._next_pause = 8

    def next_k(self) -> int:
        if self.step_ms is None and self.measure_first:  # a plain step first: what a run must pay against
            return 0
        if self.pause > 0:
            self.pause -= 1
            return 0
        return self.k

    def plain_step(self, ms: float) -> None:
        self.step_ms = ms if self.step_ms is None else 0.8 * self.step_ms + 0.2 * ms

    def verified(self, drafted: int, accepted: int, ms: float) -> None:
        o = self.options
        self.k = min(o.draft_max, self.k + 2) if accepted == drafted else max(o.draft_min, accepted + 1)
        self.verifies += 1
        if self.step_ms is None or self.step_ms <= 0:
            return
        yielded = accepted + 1
        gain = yielded / max(ms / self.step_ms, 1e-6)
        self.gain = 0.7 * self.gain + 0.3 * gain
        if self.verifies >= 3 and self.gain < 1.0:
            self.pause = self._next_pause
            self._next_pause = min(self._next_pause * 2, 256)
            self.gain = 1.0
            self.verifies = 0
        elif gain >= 1.0:
            self._next_pause = 8


@dataclass
class Speculation:
    """One request's drafting state."""
    drafter: Drafter
    length: DraftLength
    verify: tuple[int, float] | None = None  # the run being consumed: tokens drafted, ms of drafting + its forward

    @classmethod
    def start(cls, options: SpecOptions, drafter_factory: DrafterFactory, step_ms: float | None,
              prompt_ids: Sequence[int], should_cancel: Callable[[], bool]) -> Speculation:
        """A request's drafter, told the prompt (and prefilled with it, if it has a prefill); its draft length
        starts from the engine's measured step."""
        drafter = drafter_factory()
        s = cls(drafter, DraftLength(options, measure_first=getattr(drafter, "always_proposes", False)))
        s.length.step_ms = step_ms
        drafter.extend(prompt_ids)
        prefill = getattr(drafter, "prefill", None)
        if prefill is not None:
            prefill(should_cancel)
        return s
