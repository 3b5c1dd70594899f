"""Engine: drives one generation at a time, token by token, over a model and its KV cache.

Policies:
- The engine thread owns the model and one KV cache slot. A prompt is prefilled in chunks (`prefill_chunk`
  tokens) so a cancellation is seen between chunks; decode runs one token a step and polls `should_cancel`
  before each. Text leaves through an IncrementalDetokenizer (never a broken UTF-8 character) and a
  StopMatcher (never part of a stop string). Exactly one TokenEvent per decoded token.
- Prefix reuse: the cache keeps the sequence of the last request (prompt, decoded tokens, or the whole chunks
  a cancelled prefill committed) and `cache_tokens` says which ids it holds. A new request keeps the longest
  prefix it shares with that sequence or with a copy in `store` (PrefixStore: earlier sequences under the
  --cache-ram budget, only their used positions), and prefills the rest; the last prompt token always runs.
  The active sequence is copied into the store before a request would overwrite part of it, and so is a
  prefix the disk prompt cache is still writing from the cache (its own copy). An engine error drops the
  active sequence.
- A request's constraint (a grammar) masks every sampling step and ends the generation as soon as the grammar
  is complete.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol, cast

import numpy as np

from .kv_cache import ContextLengthError, KVCache
from .prefix_cache import CachedSequence, ImageKey, PrefixStore, common_prefix
from .sampling import Sampler, SamplingParams, TokenLogprob
from .text_stream import IncrementalDetokenizer, StopMatcher

if TYPE_CHECKING:
    from .config import Qwen3Config
    from .constraint import CompiledGrammar
    from .image_processing import ImageProcessor
    from .prompt_disk import PromptDiskCache
    from .qwen3_vl import PixelPatches


class CausalLM(Protocol):
    @property
    def config(self) -> Qwen3Config: ...

    def new_cache(self, max_len: int, dtype=np.float32) -> KVCache: ...

    def forward(self, tokens: np.ndarray, cache: KVCache, logits: str = "last") -> np.ndarray | None: ...


class ImageLM(CausalLM, Protocol):
    """A CausalLM whose `multimodal` is True (qwen3_vl.Qwen3VLModel): image runs in the prompt."""
    image_processor: ImageProcessor
    image_token_id: int

    def image_keys(self, prompt_ids: list[int], images: list[PixelPatches]) -> tuple[ImageKey, ...]: ...

    def prepare_images(self, cache: Any, prompt_ids: list[int], images: list[PixelPatches],
                       should_cancel: Callable[[], bool] = ..., reuse: int = 0) -> int | None: ...


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: list[int]
    sampling: SamplingParams = SamplingParams()
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    images: tuple[PixelPatches, ...] = ()  # one per image-pad run of prompt_ids, in order (models with `multimodal`)
    constraint: CompiledGrammar | None = None  # its start() masks each step (structured output)


@dataclass
class Timings:
    prefill_ms: float = 0.0
    ttft_ms: float = 0.0
    decode_ms: list[float] = field(default_factory=list)
    total_ms: float = 0.0
    prefill_chunks: int = 0
    image_encode_ms: float = 0.0  # vision tower time (not part of prefill_ms; part of ttft_ms)
    image_tokens: int = 0
    cache_n: int = 0  # prompt tokens whose keys/values were reused (not prefilled)

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
                 prefill_chunk: int = 256, kv_dtype=np.float32, cache_bytes: int = 0, reuse_prefix: bool = True):
        self.model = model
        self.tokenizer = tokenizer
        self.eos_ids = set(eos_ids)
        self.context_length = context_length
        self.prefill_chunk = prefill_chunk
        self.cache = model.new_cache(context_length, kv_dtype)
        self.cache_tokens: list[int] = []  # ids of the cache's committed positions
        self.cache_images: tuple[ImageKey, ...] = ()  # image runs of that sequence
        self.reuse_prefix = reuse_prefix
        self.store = PrefixStore(cache_bytes)  # copies of earlier sequences (the active one counts too)
        self.disk: PromptDiskCache | None = None  # with --prompt-cache-dir
        self._disk_pending: tuple[list[int], tuple[ImageKey, ...]] | None = None
        # engine-side counters, for tests and /metrics
        self.prefill_chunks_run = 0
        self.decode_steps_run = 0

    def warm_up(self) -> None:
        """One forward pass of a single token, so one-time work at a weight's first product (the native
        kernels' row rearrangement, page faults) happens at load, not in the first request's latency. The
        token goes after the active sequence and is taken back: a prefix adopted from the disk stays active."""
        n = len(self.cache_tokens)
        if n + 1 > self.cache.max_len or self.cache_images:  # no room after it, or image state truncate drops
            self.drop_sequence()
            n = 0
        token = min(self.eos_ids) if self.eos_ids else 0
        self.model.forward(np.asarray([token], dtype=np.int64), self.cache, "last")
        self.cache.truncate(n)

    def adopt(self, entries: list[CachedSequence]) -> None:
        """Cached sequences from elsewhere (the disk): the first becomes the active one, the rest are kept."""
        for i, e in enumerate(entries):
            if i == 0 and len(e.tokens) < self.context_length:
                self.cache.load_prefix(e.k, e.v, len(e.tokens))
                self.cache_tokens, self.cache_images = list(e.tokens), e.images
            else:
                self.store.add(e, reserve=self.cache.length * self.cache.bytes_per_token)

    def after_request(self) -> None:
        """Work that waits until the response is out (the worker calls it): the disk prompt cache's write."""
        pending, self._disk_pending = self._disk_pending, None
        if pending is not None and self.disk is not None:
            self.disk.observe(*pending, self.cache, self.cache_tokens)

    def drop_sequence(self) -> None:
        """Forget the active sequence (after an error, or when its keys/values are not trusted)."""
        self.cache.reset()
        self.cache_tokens, self.cache_images = [], ()

    def _stash_active(self, reserve: int) -> CachedSequence | None:
        """Copy the active sequence's used positions into the store (unless the store already holds it); the
        copy made, if any."""
        n = len(self.cache_tokens)
        if n == 0 or n * self.cache.bytes_per_token + reserve > self.store.budget \
                or self.store.covers(self.cache_tokens, self.cache_images):
            return None
        k, v = self.cache.copy_prefix(n)
        entry = CachedSequence(list(self.cache_tokens), self.cache_images, k, v)
        return entry if self.store.add(entry, reserve) else None

    def begin_sequence(self, ids: list[int], images: tuple[ImageKey, ...]) -> int:
        """Make the cache hold the longest reusable prefix of `ids` (never all of it); return its length."""
        if not self.reuse_prefix:
            if self.disk is not None:
                self.disk.before_overwrite(0)
            self.drop_sequence()
            self.cache_images = images
            return 0
        limit = len(ids) - 1
        n_active = min(common_prefix(self.cache_tokens, self.cache_images, ids, images), limit)
        entry, n_saved = self.store.best(ids, images)
        n_saved = min(n_saved, limit)
        stashed = None
        if n_active < len(self.cache_tokens):  # positions this request would overwrite: keep a copy
            stashed = self._stash_active(reserve=len(ids) * self.cache.bytes_per_token)
        if self.disk is not None:  # a prefix still being written from the cache goes on from a copy
            self.disk.before_overwrite(0 if entry is not None and n_saved > n_active else n_active, stashed)
        if entry is not None and n_saved > n_active:
            self.cache.load_prefix(entry.k, entry.v, n_saved)
            if n_saved >= len(entry.tokens) - self.store.slack:  # (nearly) all active now; copied back when left
                self.store.discard(entry)
            else:
                self.store.touch(entry)
            n = n_saved
        else:
            self.cache.truncate(n_active)
            n = n_active
        self.cache_tokens, self.cache_images = list(ids[:n]), images
        return n

    def _forward(self, tokens: list[int], logits: str) -> np.ndarray | None:
        """Append tokens to the active sequence (its ids follow the cache)."""
        out = self.model.forward(np.asarray(tokens, dtype=np.int64), self.cache, logits)
        self.cache_tokens.extend(tokens)
        return out

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
            chunk = list(ids[start:start + self.prefill_chunk])
            last = start + len(chunk) >= len(ids)
            logits = self._forward(chunk, "last" if last else "none")
            self.prefill_chunks_run += 1
            timings.prefill_chunks += 1
        return logits

    def generate(self, req: GenerationRequest, should_cancel: Callable[[], bool] = lambda: False
                 ) -> Iterator[TokenEvent | FinishEvent]:
        self.check_fits(len(req.prompt_ids))
        images: tuple[ImageKey, ...] = ()
        if req.images:
            if not getattr(self.model, "multimodal", False):
                raise ValueError("this model does not accept images")
            images = cast("ImageLM", self.model).image_keys(req.prompt_ids, list(req.images))  # validates the image runs
        try:
            yield from self._generate(req, images, should_cancel)
        except Exception:
            self.drop_sequence()  # keys/values of a failed step are not trusted
            raise

    def _generate(self, req: GenerationRequest, images: tuple[ImageKey, ...], should_cancel: Callable[[], bool]
                  ) -> Iterator[TokenEvent | FinishEvent]:
        t0 = time.perf_counter()
        timings = Timings()
        sampler = Sampler(req.sampling, self.model.config.vocab_size)
        constraint = req.constraint.start() if req.constraint is not None else None
        detok = IncrementalDetokenizer(self.tokenizer)
        stops = StopMatcher(list(req.stop))
        generated: list[int] = []
        budget = self.context_length - len(req.prompt_ids)
        if req.max_tokens is not None:
            budget = min(budget, req.max_tokens)

        def finish(reason: str, tail: str = "") -> FinishEvent:
            timings.total_ms = _ms(t0)
            self.store.shrink(reserve=len(self.cache_tokens) * self.cache.bytes_per_token)
            self._disk_pending = (list(req.prompt_ids), images)
            return FinishEvent(reason, tail, len(req.prompt_ids), len(generated), generated, timings)

        reused = timings.cache_n = self.begin_sequence(req.prompt_ids, images)
        if req.images:
            t_img = time.perf_counter()
            n_image_tokens = cast("ImageLM", self.model).prepare_images(
                self.cache, req.prompt_ids, list(req.images), should_cancel, reuse=reused)
            timings.image_encode_ms = _ms(t_img)
            if n_image_tokens is None:
                yield finish("cancelled")
                return
            timings.image_tokens = n_image_tokens
        logits = self.prefill(req.prompt_ids[reused:], should_cancel, timings)
        timings.prefill_ms = _ms(t0) - timings.image_encode_ms
        if logits is None:
            yield finish("cancelled")
            return
        t_step = time.perf_counter()
        while True:
            allowed = constraint.allowed() if constraint is not None else None
            token, lp = sampler.sample(logits, req.prompt_ids, generated, allowed)
            if constraint is not None:
                constraint.accept(token)
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
            if constraint is not None and constraint.finished:
                yield finish("stop", _drain(detok, stops))
                return
            if len(generated) >= budget:
                yield finish("length", _drain(detok, stops))
                return
            if should_cancel():
                yield finish("cancelled")
                return
            t_step = time.perf_counter()
            logits = cast(np.ndarray, self._forward([token], "last"))  # "last": never None
            self.decode_steps_run += 1


def _drain(detok: IncrementalDetokenizer, stops: StopMatcher) -> str:
    """Release what the detokenizer and the stop matcher still hold at the end of a generation."""
    released, stopped = stops.push(detok.flush())
    return released if stopped else released + stops.flush()
