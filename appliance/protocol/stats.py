"""Per-request generation figures and the two ways they are reported.

Policies:
- `timings` (on the final chunk and on non-stream responses) mirrors llama.cpp's server names so tools that read
  llama.cpp's figures read ours: prompt_* is prefill of the tokens actually run (prompt_n excludes the reused
  prefix, cache_n counts it, as llama.cpp's server does), predicted_* is everything after prefill (predicted_n
  is the number of completion tokens, as llama.cpp counts them). Our own ttft_ms and tpot_ms are added; with
  speculative decoding llama-server's draft_n / draft_n_accepted too.
- The `chat.completion.metrics` extension event carries the seed's names (prompt_tokens, ttft_ms, tpot_ms, ...)
  plus cached_tokens; prefill_ms / prefill_tok_s cover the prefilled rest.
- usage.prompt_tokens_details (OpenAI's names): cached_tokens always; text_tokens / image_tokens with images.
- Milliseconds are rounded to 3 decimals; rates of an empty interval are 0.0 (JSON has no Infinity/NaN).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


def _num(x: float, digits: int = 3) -> float:
    x = float(x)
    return round(x, digits) if math.isfinite(x) else 0.0


def _rate(n: int, ms: float) -> float:
    return _num(1000.0 * n / ms) if ms > 0 else 0.0


def _per(ms: float, n: int) -> float:
    return _num(ms / n) if n > 0 else 0.0


@dataclass(frozen=True)
class GenerationStats:
    prompt_tokens: int
    completion_tokens: int
    prefill_ms: float
    ttft_ms: float
    decode_ms: float          # sum of the decode steps
    total_ms: float
    tpot_ms: float            # mean decode step
    tok_s: float              # decode steps per second
    queue_ms: float = 0.0     # time spent waiting for the engine (server side)
    image_tokens: int = 0     # image-pad tokens in the prompt (part of prompt_tokens)
    image_encode_ms: float = 0.0  # vision tower time (before prefill; inside ttft, not prefill)
    cached_tokens: int = 0    # prompt tokens whose keys/values were reused (part of prompt_tokens)
    stop_sequence: str | None = None  # the stop string that ended the generation, if one did
    draft_n: int = 0          # tokens drafted for verification (speculative decoding)
    draft_n_accepted: int = 0  # of those, accepted

    @classmethod
    def from_finish(cls, finish: Any, queue_ms: float = 0.0) -> "GenerationStats":
        """From an engine FinishEvent (duck-typed: prompt_tokens, completion_tokens, timings)."""
        t = finish.timings
        return cls(prompt_tokens=finish.prompt_tokens, completion_tokens=finish.completion_tokens,
                   prefill_ms=t.prefill_ms, ttft_ms=t.ttft_ms, decode_ms=float(sum(t.decode_ms)),
                   total_ms=t.total_ms, tpot_ms=t.tpot_ms, tok_s=t.tok_s, queue_ms=queue_ms,
                   image_tokens=getattr(t, "image_tokens", 0), image_encode_ms=getattr(t, "image_encode_ms", 0.0),
                   cached_tokens=getattr(t, "cache_n", 0), stop_sequence=getattr(finish, "stop_sequence", None),
                   draft_n=getattr(t, "draft_n", 0), draft_n_accepted=getattr(t, "draft_n_accepted", 0))

    @property
    def prefilled_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    def prompt_tokens_details(self) -> dict[str, int]:
        """usage.prompt_tokens_details."""
        d = {"cached_tokens": self.cached_tokens}
        if self.image_tokens:
            d.update(text_tokens=self.prompt_tokens - self.image_tokens, image_tokens=self.image_tokens)
        return d

    def _images(self) -> dict[str, Any]:
        """Image figures, present only when the prompt had images."""
        if not self.image_tokens:
            return {}
        return {"image_tokens": self.image_tokens, "image_encode_ms": _num(self.image_encode_ms)}

    def _drafts(self) -> dict[str, Any]:
        """Speculative decoding's figures (llama-server's names), present only when tokens were drafted."""
        return {"draft_n": self.draft_n, "draft_n_accepted": self.draft_n_accepted} if self.draft_n else {}

    def timings(self) -> dict[str, Any]:
        """llama.cpp-style `timings` object."""
        predicted_ms = max(self.total_ms - self.prefill_ms, 0.0)
        return {
            "cache_n": self.cached_tokens,
            "prompt_n": self.prefilled_tokens,
            "prompt_ms": _num(self.prefill_ms),
            "prompt_per_token_ms": _per(self.prefill_ms, self.prefilled_tokens),
            "prompt_per_second": _rate(self.prefilled_tokens, self.prefill_ms),
            "predicted_n": self.completion_tokens,
            "predicted_ms": _num(predicted_ms),
            "predicted_per_token_ms": _per(predicted_ms, self.completion_tokens),
            "predicted_per_second": _rate(self.completion_tokens, predicted_ms),
            "ttft_ms": _num(self.ttft_ms),
            "tpot_ms": _num(self.tpot_ms),
            **self._images(),
            **self._drafts(),
        }

    def metrics(self) -> dict[str, Any]:
        """The `metrics` object of the chat.completion.metrics extension event."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "ttft_ms": _num(self.ttft_ms),
            "prefill_ms": _num(self.prefill_ms),
            "tpot_ms": _num(self.tpot_ms),
            "decode_ms": _num(self.decode_ms),
            "total_ms": _num(self.total_ms),
            "tok_s": _num(self.tok_s),
            "prefill_tok_s": _rate(self.prefilled_tokens, self.prefill_ms),
            "queue_ms": _num(self.queue_ms),
            "cached_tokens": self.cached_tokens,
            **self._images(),
        }
