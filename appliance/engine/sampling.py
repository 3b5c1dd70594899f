"""Sampling: request parameters, their defaults and validation, and the per-request Sampler.

Policies:
- Order of operations (llama.cpp / vLLM / transformers agree on it): repetition penalty, presence/frequency
  penalties, then greedy argmax when temperature == 0, else temperature, top-k, top-p, min-p, and a draw.
- Semantics follow the reference each knob comes from: the repetition penalty is transformers' (over prompt +
  generated tokens, positive logits divided, the rest multiplied); presence/frequency penalties are OpenAI's (over
  generated tokens only, logit -= presence * [count > 0] + frequency * count); top-k, top-p and min-p are
  transformers' warpers (top-k keeps every token tied with the k-th logit; top-p keeps a token while the mass of the
  tokens strictly above it is < top_p; min-p keeps p >= min_p * p_max, computed after top-k).
- Ties: greedy and the top-p boundary prefer the lower token id, as do logprob alternatives.
- Logprobs are the log-softmax of the raw model logits (before penalties and temperature), as vLLM reports them.
- Randomness: one numpy Generator per request, seeded from `seed` (negative seeds are taken modulo 2**64); no seed
  draws from OS entropy. Same seed + same logits -> same tokens.
- Validation rejects what the OpenAI API / llama.cpp server reject; invalid values in a model's
  generation_config.json are ignored (the dataclass default applies), so a model's defaults never fail a request.
- Cost: the Sampler lives for one request and keeps penalty state incrementally (only when a penalty is set);
  per token it does O(V) scans (argpartition, comparisons, one exp) and sorts only the few candidates that
  top-p actually inspects.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Mapping, Sequence

import numpy as np

MAX_TOP_LOGPROBS = 20


MIN_TEMPERATURE = 1e-6  # smaller positive temperatures sample as this one (already greedy in effect)


class SamplingParamError(ValueError):
    """An out-of-range sampling parameter; `.param` names the offending field."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check_range(name: str, v: Any, lo: float, hi: float, lo_open: bool = False) -> None:
    if not _is_number(v) or math.isnan(v) or v > hi or v < lo or (lo_open and v == lo):
        lo_s = f"greater than {lo:g}" if lo_open else f"at least {lo:g}"
        raise SamplingParamError(name, f"'{name}' must be a number {lo_s} and at most {hi:g}, got {v!r}")


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0     # 0 -> greedy
    top_k: int = 0               # 0 -> off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: bool = False
    top_logprobs: int = 0

    def __post_init__(self) -> None:
        _check_range("temperature", self.temperature, 0.0, 2.0)
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise SamplingParamError("top_k", f"'top_k' must be a non-negative integer (0 = off), got {self.top_k!r}")
        _check_range("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        _check_range("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise SamplingParamError("seed", f"'seed' must be an integer, got {self.seed!r}")
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        rp = self.repetition_penalty
        if not _is_number(rp) or not (0.0 < rp < math.inf):
            raise SamplingParamError("repetition_penalty",
                                     f"'repetition_penalty' must be a number greater than 0, got {rp!r}")
        if not isinstance(self.logprobs, bool):
            raise SamplingParamError("logprobs", f"'logprobs' must be a boolean, got {self.logprobs!r}")
        tl = self.top_logprobs
        if not isinstance(tl, int) or isinstance(tl, bool) or not (0 <= tl <= MAX_TOP_LOGPROBS):
            raise SamplingParamError("top_logprobs",
                                     f"'top_logprobs' must be an integer from 0 to {MAX_TOP_LOGPROBS}, got {tl!r}")
        if tl > 0 and not self.logprobs:
            raise SamplingParamError("top_logprobs", "'logprobs' must be set to true when 'top_logprobs' is used")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @classmethod
    def from_generation_config(cls, generation_config: Mapping[str, Any] | None,
                               **given: Any) -> "SamplingParams":
        """Request fields in `given` (None or absent = unset) over the model's generation_config.json defaults."""
        known = {f.name for f in fields(cls)}
        unknown = set(given) - known
        if unknown:
            raise TypeError(f"unknown sampling fields: {sorted(unknown)}")
        values = generation_defaults(generation_config)
        values.update({k: v for k, v in given.items() if v is not None})
        return cls(**values)


# generation_config.json key -> (SamplingParams field, validity check)
_GC_KEYS = {
    "temperature": lambda v: _is_number(v) and 0.0 <= v <= 2.0,
    "top_k": lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
    "top_p": lambda v: _is_number(v) and 0.0 < v <= 1.0,
    "min_p": lambda v: _is_number(v) and 0.0 <= v <= 1.0,
    "repetition_penalty": lambda v: _is_number(v) and 0.0 < v < math.inf,
}


def generation_defaults(generation_config: Mapping[str, Any] | None) -> dict[str, Any]:
    """The SamplingParams fields a generation_config.json dict sets (invalid or null values are skipped)."""
    gc = generation_config or {}
    out: dict[str, Any] = {}
    for key, ok in _GC_KEYS.items():
        v = gc.get(key)
        if v is not None and ok(v):
            out[key] = v
    if gc.get("do_sample") is False:
        out["temperature"] = 0.0
    return out


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]     # (token_id, logprob), best first, ties by lower id


def top_ids(values: np.ndarray, n: int) -> np.ndarray:
    """Indices of the n largest values, largest first, ties broken by the lower index (exact, no full sort)."""
    V = values.shape[0]
    n = min(n, V)
    if n <= 0:
        return np.zeros(0, dtype=np.int64)
    if n < V:
        kth = np.partition(values, V - n)[V - n]              # the n-th largest value
        above = np.flatnonzero(values > kth)
        tied = np.flatnonzero(values == kth)[: n - above.size]  # lowest ids among the tied
        idx = np.concatenate([above, tied])
    else:
        idx = np.arange(V)
    order = np.lexsort((idx, -values[idx]))                   # by value desc, then id asc
    return idx[order]


class Sampler:
    """Chooses the next token for one request. Keeps penalty state incrementally across calls."""

    def __init__(self, params: SamplingParams, vocab_size: int):
        self.params = params
        self.vocab_size = vocab_size
        seed = params.seed
        self._rng = np.random.default_rng(None if seed is None else seed % 2**64)
        self._reset()

    def _reset(self) -> None:
        V = self.vocab_size
        self._counts = np.zeros(V, dtype=np.int32)              # (V,) occurrences in generated tokens
        self._gen_ids = _IdSet(V)                                 # distinct generated ids
        self._rep_ids = _IdSet(V)                                 # distinct prompt + generated ids
        self._n_prompt = -1                                       # prompt length consumed (-1: none yet)
        self._n_gen = 0                                           # generated tokens consumed

    # -- penalties -------------------------------------------------------------------------------------------
    def _track(self, prompt_ids: Sequence[int], generated_ids: Sequence[int]) -> None:
        if len(prompt_ids) != self._n_prompt or len(generated_ids) < self._n_gen:
            if self._n_prompt >= 0:
                self._reset()                                     # a different history: recount from scratch
            self._n_prompt = len(prompt_ids)
            self._rep_ids.add_many(prompt_ids)
        new = generated_ids[self._n_gen:]
        self._n_gen = len(generated_ids)
        if len(new):
            a = np.asarray(new, dtype=np.int64)
            np.add.at(self._counts, a[(a >= 0) & (a < self.vocab_size)], 1)
        self._gen_ids.add_many(new)
        self._rep_ids.add_many(new)

    def apply_penalties(self, logits: np.ndarray, prompt_ids: Sequence[int],
                        generated_ids: Sequence[int]) -> np.ndarray:
        """The logits after repetition, presence and frequency penalties (a copy when anything changes)."""
        p = self.params
        rep = p.repetition_penalty != 1.0
        pf = p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
        if not (rep or pf):
            return logits                                         # nothing to track either (the usual case)
        self._track(prompt_ids, generated_ids)
        out = np.array(logits, dtype=np.float32, copy=True)      # (V,)
        if rep and self._rep_ids.size:
            ids = self._rep_ids.ids                               # (n,)
            s = out[ids]
            out[ids] = np.where(s < 0, s * np.float32(p.repetition_penalty), s / np.float32(p.repetition_penalty))
        if pf and self._gen_ids.size:
            ids = self._gen_ids.ids
            out[ids] -= np.float32(p.presence_penalty) + np.float32(p.frequency_penalty) * self._counts[ids]
        return out

    # -- filtering -------------------------------------------------------------------------------------------
    def candidates(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(ids ascending, probabilities) left after temperature, top-k, top-p and min-p; needs temperature > 0.

        `logits` are the penalized logits (V,)."""
        ids, w = self._filter(np.asarray(logits))
        if ids is None:
            ids = np.arange(w.shape[0])
        w = w.astype(np.float64)
        return ids, w / w.sum()

    def _filter(self, x: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
        """(candidate ids ascending or None = all V, their unnormalized probabilities p / p_max as float32)."""
        p = self.params
        if p.greedy:
            raise ValueError("sampling filters need temperature > 0; greedy takes the argmax")
        V = x.shape[0]
        t = np.float32(max(p.temperature, MIN_TEMPERATURE))  # a positive temperature that float32 rounds to 0
        # would divide by zero (inf/NaN weights, an empty candidate set)
        if 0 < p.top_k < V:
            kth = np.partition(x, V - p.top_k)[V - p.top_k]
            ids = np.flatnonzero(x >= kth)                         # (n,) ties with the k-th kept (transformers)
            vals = x[ids].astype(np.float32) / t
        else:
            ids = None
            vals = np.asarray(x, dtype=np.float32) / t             # (V,)
        w = np.exp(vals - vals.max())                              # (n,) p / p_max
        keep = None                                                # bool mask over w, None = all
        if p.min_p > 0.0:
            keep = w >= np.float32(p.min_p)
        if p.top_p < 1.0:
            limit = int(np.count_nonzero(keep)) if keep is not None else w.shape[0]
            n_keep, w_min = _top_p_count(w, float(w.sum(dtype=np.float64)), p.top_p, limit)
            if n_keep < limit:
                mask = w > w_min
                tied = np.flatnonzero(w == w_min)[: n_keep - int(np.count_nonzero(mask))]
                mask[tied] = True                                  # boundary ties: lowest ids first
                keep = mask if keep is None else keep & mask
        if keep is not None:
            w = w[keep]
            ids = np.flatnonzero(keep) if ids is None else ids[keep]
        return ids, w

    # -- the step --------------------------------------------------------------------------------------------
    def sample(self, logits: np.ndarray, prompt_ids: Sequence[int], generated_ids: Sequence[int],
               allowed: np.ndarray | None = None) -> tuple[int, TokenLogprob | None]:
        """The next token; `allowed` (V,) bool restricts it to a grammar's tokens (constrained decoding).

        With a mask the filters run over the allowed tokens only: a masked token has probability 0, so top-k,
        top-p, min-p and the draw over the renormalized rest are the same as over the masked (V,) logits, and
        the only copy is of the allowed entries. Logprobs stay those of the raw logits."""
        if logits.shape != (self.vocab_size,):
            raise ValueError(f"logits shape {logits.shape} != ({self.vocab_size},)")
        penalized = self.apply_penalties(logits, prompt_ids, generated_ids)
        sub_ids = None
        if allowed is not None:
            sub_ids = np.flatnonzero(allowed)                     # (n,) ascending
            if sub_ids.size == 0:
                raise ValueError("the constraint allows no token")
            penalized = penalized[sub_ids]                        # (n,) the one copy of the logits
        if self.params.greedy:
            token = int(np.argmax(penalized))                      # first maximum = lowest id
        else:
            ids, w = self._filter(penalized)
            i = _draw(w, self._rng.random())
            token = i if ids is None else int(ids[i])
        if sub_ids is not None:
            token = int(sub_ids[token])
        return token, (self.logprob(logits, token) if self.params.logprobs else None)

    def logprob(self, logits: np.ndarray, token: int) -> TokenLogprob:
        """Log-softmax of the raw logits: the chosen token's value and the top `top_logprobs` alternatives."""
        x = np.asarray(logits, dtype=np.float32)
        m = float(x.max())
        lse = m + math.log(float(np.exp(x - np.float32(m)).sum(dtype=np.float64)))
        top = [(int(i), float(x[i]) - lse) for i in top_ids(x, self.params.top_logprobs)]
        return TokenLogprob(token, float(x[token]) - lse, top)


def _top_p_count(w: np.ndarray, total: float, top_p: float, limit: int) -> tuple[int, float]:
    """How many of the largest weights top-p keeps (at most `limit`), and the smallest kept weight. Token i (in
    descending order) is kept while the mass before it is < top_p; a growing top slice is sorted, not all of w."""
    n = w.shape[0]
    m = min(limit, 64)
    while True:
        top = np.sort(np.partition(w, n - m)[n - m:] if m < n else w)[::-1]    # (m,) largest, descending
        before = np.concatenate(([0.0], np.cumsum(top[:-1], dtype=np.float64))) / total
        kept = int(np.count_nonzero(before < top_p))                            # a prefix: `before` increases
        if kept < m or m >= limit:
            kept = max(1, min(kept, limit))
            return kept, float(top[kept - 1])
        m = min(limit, m * 8)


_BLOCK = 2048


def _draw(w: np.ndarray, u: float) -> int:
    """Index i with probability w[i] / sum(w), by inverse CDF at u in [0, 1): block sums first, then one block's
    cumulative sum, so a full-vocabulary draw costs one pass instead of a (V,) cumsum."""
    n = w.shape[0]
    if n <= _BLOCK:
        c = np.cumsum(w, dtype=np.float64)
        i = int(np.searchsorted(c, u * c[-1], side="right"))
    else:
        starts = np.arange(0, n, _BLOCK)
        cb = np.cumsum(np.add.reduceat(w, starts, dtype=np.float64))
        target = u * cb[-1]
        b = min(int(np.searchsorted(cb, target, side="right")), starts.shape[0] - 1)
        lo = starts[b]
        c = np.cumsum(w[lo: lo + _BLOCK], dtype=np.float64)
        i = lo + int(np.searchsorted(c, target - (cb[b - 1] if b else 0.0), side="right"))
    i = min(i, n - 1)
    if w[i] == 0:                                                   # rounding at a block's end: step back
        i = int(np.flatnonzero(w[: i + 1])[-1]) if np.any(w[: i + 1]) else int(np.argmax(w))
    return i


class _IdSet:
    """Distinct token ids in insertion order, as a growing numpy array (ids outside [0, V) are ignored)."""

    def __init__(self, vocab_size: int):
        self._seen = np.zeros(vocab_size, dtype=bool)
        self._buf = np.zeros(64, dtype=np.int64)
        self.size = 0

    def add_many(self, ids: Sequence[int]) -> None:
        if len(ids) == 0:
            return
        a = np.unique(np.asarray(ids, dtype=np.int64))
        a = a[(a >= 0) & (a < self._seen.shape[0])]
        a = a[~self._seen[a]]
        if a.size == 0:
            return
        self._seen[a] = True
        if self.size + a.size > self._buf.shape[0]:
            grown = np.zeros(max(2 * self._buf.shape[0], self.size + a.size), dtype=np.int64)
            grown[: self.size] = self._buf[: self.size]
            self._buf = grown
        self._buf[self.size: self.size + a.size] = a
        self.size += a.size

    @property
    def ids(self) -> np.ndarray:
        return self._buf[: self.size]
