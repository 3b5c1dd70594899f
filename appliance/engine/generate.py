"""Engine: drives one generation at a time, token by token, over a model and its KV cache.

Policy: the engine thread owns the model and one KV cache slot. A prompt is prefilled in chunks
(`prefill_chunk` tokens) so a cancellation is seen between chunks; decode runs one token a step and polls
`should_cancel` before each. Text leaves through an IncrementalDetokenizer (never a broken UTF-8 character)
and a StopMatcher (never part of a stop string). Exactly one TokenEvent per decoded token.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol

import numpy as np

from .kv_cache import ContextLengthError, KVCache
from .sampling import Sampler, SamplingParams, TokenLogprob
from .text_stream import IncrementalDetokenizer, StopMatcher


class CausalLM(Protocol):
    config: object  # has vocab_size

    def new_cache(self, max_len: int) -> KVCache: ...

    def forward(self, tokens: np.ndarray, cache: KVCache, logits: str = "last") -> np.ndarray | None: ...


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: list[int]
    sampling: SamplingParams = SamplingParams()
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    images: tuple = ()  # PixelPatches, one per image-pad run of prompt_ids, in order (models with `multimodal`)


@dataclass
class Timings:
    prefill_ms: float = 0.0
    ttft_ms: float = 0.0
    decode_ms: list[float] = field(default_factory=list)
    total_ms: float = 0.0
    prefill_chunks: int = 0
    image_encode_ms: float = 0.0  # vision tower time (not part of prefill_ms; part of ttft_ms)
    image_tokens: int = 0

    @property
    def tpot_ms(self) -> float:
        return float(np.mean(self.decode_ms)) if self.decode_ms else 0.0

    @property
    def tok_s(self) -> float:
        t = sum(self.decode_ms)
        return 1000.0 * len(self.decode_ms) / t if t > 0 else 0.0


@dataclass
class TokenEvent:
    token_id: int
    text: str
    logprob: TokenLogprob | None = None


@dataclass
class FinishEvent:
    reason: str  # 'stop' | 'length' | 'cancelled'
    text: str
    prompt_tokens: int
    completion_tokens: int
    token_ids: list[int]
    timings: Timings


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000.0


class Engine:
    """Generation over one model (anything with `new_cache` and `forward(tokens, cache, logits)`)."""

    def __init__(self, model: CausalLM, tokenizer, eos_ids: set[int], context_length: int,
                 prefill_chunk: int = 256):
        self.model = model
        self.tokenizer = tokenizer
        self.eos_ids = set(eos_ids)
        self.context_length = context_length
        self.prefill_chunk = prefill_chunk
        self.cache = model.new_cache(context_length)
        # engine-side counters, for tests and /metrics
        self.prefill_chunks_run = 0
        self.decode_steps_run = 0

    def warm_up(self) -> None:
        """One forward pass of a single token, so one-time work at a weight's first product (the native
        kernels' row rearrangement, page faults) happens at load, not in the first request's latency."""
        token = min(self.eos_ids) if self.eos_ids else 0
        self.model.forward(np.asarray([token], dtype=np.int64), self.cache, "last")
        self.cache.reset()

    def check_fits(self, prompt_len: int) -> None:
        if prompt_len == 0:
            raise ContextLengthError("the prompt is empty")
        if prompt_len >= self.context_length:
            raise ContextLengthError(f"the prompt has {prompt_len} tokens; the context length is "
                                     f"{self.context_length} and at least one token must be generated")

    def prefill(self, ids: list[int], should_cancel: Callable[[], bool], timings: Timings) -> np.ndarray | None:
        """Run the prompt through the model in chunks; return the last position's logits, or None if
        cancelled between chunks."""
        logits = None
        for start in range(0, len(ids), self.prefill_chunk):
            if should_cancel():
                return None
            chunk = np.asarray(ids[start:start + self.prefill_chunk], dtype=np.int64)
            last = start + len(chunk) >= len(ids)
            logits = self.model.forward(chunk, self.cache, "last" if last else "none")
            self.prefill_chunks_run += 1
            timings.prefill_chunks += 1
        return logits

    def generate(self, req: GenerationRequest, should_cancel: Callable[[], bool] = lambda: False
                 ) -> Iterator[TokenEvent | FinishEvent]:
        self.check_fits(len(req.prompt_ids))
        t0 = time.perf_counter()
        timings = Timings()
        self.cache.reset()
        sampler = Sampler(req.sampling, self.model.config.vocab_size)
        detok = IncrementalDetokenizer(self.tokenizer)
        stops = StopMatcher(list(req.stop))
        generated: list[int] = []
        budget = self.context_length - len(req.prompt_ids)
        if req.max_tokens is not None:
            budget = min(budget, req.max_tokens)

        def finish(reason: str, tail: str = "") -> FinishEvent:
            timings.total_ms = _ms(t0)
            self.cache.reset()
            return FinishEvent(reason, tail, len(req.prompt_ids), len(generated), generated, timings)

        if req.images:
            if not getattr(self.model, "multimodal", False):
                raise ValueError("this model does not accept images")
            t_img = time.perf_counter()
            n_image_tokens = self.model.prepare_images(self.cache, req.prompt_ids, list(req.images), should_cancel)
            timings.image_encode_ms = _ms(t_img)
            if n_image_tokens is None:
                yield finish("cancelled")
                return
            timings.image_tokens = n_image_tokens
        logits = self.prefill(req.prompt_ids, should_cancel, timings)
        timings.prefill_ms = _ms(t0) - timings.image_encode_ms
        if logits is None:
            yield finish("cancelled")
            return
        t_step = time.perf_counter()
        while True:
            token, lp = sampler.sample(logits, req.prompt_ids, generated)
            generated.append(token)
            if len(generated) == 1:
                timings.ttft_ms = _ms(t0)
            else:
                timings.decode_ms.append(_ms(t_step))
            if token in self.eos_ids and not req.ignore_eos:
                yield TokenEvent(token, "", lp)
                yield finish("stop", _drain(detok, stops))
                return
            released, stopped = stops.push(detok.push(token))
            yield TokenEvent(token, released, lp)
            if stopped:
                yield finish("stop")
                return
            if len(generated) >= budget:
                yield finish("length", _drain(detok, stops))
                return
            if should_cancel():
                yield finish("cancelled")
                return
            t_step = time.perf_counter()
            logits = self.model.forward(np.asarray([token], dtype=np.int64), self.cache, "last")
            self.decode_steps_run += 1


def _drain(detok: IncrementalDetokenizer, stops: StopMatcher) -> str:
    """Release what the detokenizer and the stop matcher still hold at the end of a generation."""
    released, stopped = stops.push(detok.flush())
    return released if stopped else released + stops.flush()
