"""Engine: drives one generation at a time, token by token, over a model and its KV cache.

Policies:
- The engine thread owns the model and one KV cache slot. A prompt is prefilled in chunks (`prefill_chunk`
  tokens) so a cancellation is seen between chunks; decode runs one token a step and polls `should_cancel`
  before each. With speculation (speculative.py) a step feeds the token with its drafts and the verified run
  is emitted token by token, `should_cancel` still polled before each. Text leaves through an
  IncrementalDetokenizer (never a broken UTF-8 character) and a StopMatcher (never part of a stop string).
  Exactly one TokenEvent per decoded token.
- Prefix reuse: the cache keeps the sequence of the last request (prompt, decoded tokens, or the whole chunks
  a cancelled prefill committed) and `cache_tokens` says which ids it holds. A new request keeps the longest
  prefix it shares with that sequence or with a copy in `store` (PrefixStore: earlier sequences under the
  --cache-ram budget, only their used positions), and prefills the rest; the last prompt token always runs.
  The active sequence is copied into the store before a request would overwrite part of it, and so is a
  prefix the disk prompt cache is still writing from the cache (its own copy). An engine error drops the
  active sequence. A hybrid model's cache (recurrent states, `cache.exact`) is kept only where a state exists:
  `cache.reusable(n)` cuts the shared prefix back to such a position, and its copies carry their states. Its
  prefill also ends a chunk before the prompt's last turn start (the next turn repeats everything before the
  generation prompt), before the last token (a retry of the same prompt runs one token) and where the prompt
  leaves the previous sequence (a shared system prompt: the next request, or the disk file, resumes there). A
  verified draft run keeps a state per position there (HybridCache.keep_steps), so its rejected tail rolls back
  as a KV does.
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
from .speculative import DrafterFactory, NgramDrafter, SpecOptions, Speculation
from .text_stream import IncrementalDetokenizer, StopMatcher

if TYPE_CHECKING:
    from .config import Qwen3Config
    from .constraint import CompiledGrammar
    from .draft_model import DraftModel
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
    draft_n: int = 0  # tokens drafted for verification (speculative decoding; llama-server's name)
    draft_n_accepted: int = 0  # of those, accepted

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
    stop_sequence: str | None = None  # the stop string that ended it (reason 'stop'), else None


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000.0


class Engine:
    """Generation over one model (anything with `new_cache` and `forward(tokens, cache, logits)`)."""

    def __init__(self, model: CausalLM, tokenizer, eos_ids: set[int], context_length: int,
                 prefill_chunk: int = 256, kv_dtype=np.float32, cache_bytes: int = 0, reuse_prefix: bool = True,
                 spec: SpecOptions = SpecOptions(), drafter: DrafterFactory = NgramDrafter,
                 draft_model: DraftModel | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.eos_ids = set(eos_ids)
        self.context_length = context_length
        self.prefill_chunk = prefill_chunk
        self.cache = model.new_cache(context_length, kv_dtype)
        self.cache_tokens: list[int] = []  # ids of the cache's committed positions
        self.cache_images: tuple[ImageKey, ...] = ()  # image runs of that sequence
        self.reuse_prefix = reuse_prefix
        id_of = getattr(tokenizer, "id_of", None)
        self.turn_start = id_of("<|im_start|>") if id_of is not None else None  # chat templates' turn opener
        self.store = PrefixStore(cache_bytes)  # copies of earlier sequences (the active one counts too)
        self.disk: PromptDiskCache | None = None  # with --prompt-cache-dir
        self._disk_pending: tuple[list[int], tuple[ImageKey, ...]] | None = None
        self._shared = 0  # positions the prompt being prefilled shares with the sequence the cache held before it
        # engine-side counters, for tests and /metrics
        self.prefill_chunks_run = 0
        self.decode_steps_run = 0
        self.spec = spec
        self.draft_model = draft_model  # --draft-model: it drafts instead of `drafter` (draft_model.py)
        self.drafter = draft_model.drafter if draft_model is not None else drafter  # a new Drafter per request
        self.step_ms: float | None = None  # a one-token decode step, running mean (speculation pays against it)

    def warm_up(self) -> None:
        """One forward pass of a single token, so one-time work at a weight's first product (the native
        kernels' row rearrangement, page faults) happens at load, not in the first request's latency. The
        token goes after the active sequence and is taken back: a prefix adopted from the disk stays active."""
        n = len(self.cache_tokens)
        # no room after it, or state that truncate drops (image runs)
        if n + 1 > self.cache.max_len or self.cache_images:
            self.drop_sequence()
            n = 0
        if n and self._exact:
            cast(Any, self.cache).snapshot()  # recurrent states: the way back to n
        token = min(self.eos_ids) if self.eos_ids else 0
        self.model.forward(np.asarray([token], dtype=np.int64), self.cache, "last")
        self.cache.truncate(n)
        if self.draft_model is not None:
            self.draft_model.warm_up()

    @property
    def active_bytes_per_token(self) -> int:
        """What one position of the active sequence holds: the target's keys and values, and the draft model's."""
        draft = self.draft_model.bytes_per_token if self.draft_model is not None else 0
        return self.cache.bytes_per_token + draft

    def adopt(self, entries: list[CachedSequence]) -> None:
        """Cached sequences from elsewhere (the disk): the first becomes the active one, the rest are kept."""
        for i, e in enumerate(entries):
            if i == 0 and len(e.tokens) < self.context_length:
                self._load_entry(e, len(e.tokens))
                self.cache_tokens, self.cache_images = list(e.tokens), e.images
            else:
                self.store.add(e, reserve=self.cache.length * self.active_bytes_per_token)

    @property
    def _exact(self) -> bool:
        """The cache holds recurrent states: a prefix is kept only where a state exists."""
        return bool(getattr(self.cache, "exact", False))

    def _reusable(self, n: int) -> int:
        cache: Any = self.cache  # a recurrent_cache.HybridCache when exact
        return cache.reusable(n) if self._exact else n

    def _load_entry(self, entry: CachedSequence, n: int) -> None:
        cache: Any = self.cache
        if entry.states is not None:
            cache.load_prefix(entry.k, entry.v, n, entry.states)  # the states at n and the snapshots before
        else:
            self.cache.load_prefix(entry.k, entry.v, n)

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
        copied: Any = self.cache.copy_prefix(n)  # (k, v), and the recurrent states for a hybrid cache
        entry = CachedSequence(list(self.cache_tokens), self.cache_images, copied[0], copied[1],
                               copied[2] if self._exact else None)
        return entry if self.store.add(entry, reserve) else None

    def begin_sequence(self, ids: list[int], images: tuple[ImageKey, ...]) -> int:
        """Make the cache hold the longest reusable prefix of `ids` (never all of it); return its length."""
        if not self.reuse_prefix:
            self._shared = 0
            if self.disk is not None:
                self.disk.before_overwrite(0)
            self.drop_sequence()
            self.cache_images = images
            return 0
        limit = len(ids) - 1
        self._shared = min(common_prefix(self.cache_tokens, self.cache_images, ids, images), limit)
        n_active = self._reusable(self._shared)
        entry, n_saved = self.store.best(ids, images, limit)
        n_saved = min(n_saved, limit)
        stashed = None
        if n_active < len(self.cache_tokens):  # positions this request would overwrite: keep a copy
            stashed = self._stash_active(reserve=len(ids) * self.active_bytes_per_token)
        if self.disk is not None:  # a prefix still being written from the cache goes on from a copy
            self.disk.before_overwrite(0 if entry is not None and n_saved > n_active else n_active, stashed)
        if entry is not None and n_saved > n_active:
            self._load_entry(entry, n_saved)
            slack = 0 if entry.states is not None else self.store.slack
            if n_saved >= len(entry.tokens) - slack:  # (nearly) all active now; copied back when left
                self.store.discard(entry)
            else:
                self.store.touch(entry)
            n = n_saved
        else:
            self.cache.truncate(n_active)
            n = n_active
        self.cache_tokens, self.cache_images = list(ids[:n]), images
        return n

    def _forward(self, tokens: list[int], logits: str, verify: bool = False) -> np.ndarray | None:
        """Append tokens to the active sequence (its ids follow the cache). verify: a drafted run, which a
        recurrent cache keeps a state for at every position of (so its rejected tail can be cut off)."""
        keep = verify and self._exact
        if keep:
            cast(Any, self.cache).keep_steps = True
        try:
            out = self.model.forward(np.asarray(tokens, dtype=np.int64), self.cache, logits)
        finally:
            if keep:
                cast(Any, self.cache).keep_steps = False
        self.cache_tokens.extend(tokens)
        return out

    def _state_points(self, ids: list[int]) -> set[int]:
        """Where a recurrent cache should keep a state inside this prompt remainder (relative positions): before
        its last token (a retry of the same prompt) and before its last turn start (`<|im_start|>`: the
        generation prompt, which the next turn's rendering of the answer does not repeat), and where it leaves the
        previous sequence (a system prompt both share: the next request with it, or the disk prompt cache's file
        of it, resumes there)."""
        points = {len(ids) - 1, self._shared - len(self.cache_tokens)}
        if self.turn_start is not None and self.turn_start in ids:
            points.add(len(ids) - 1 - ids[::-1].index(self.turn_start))
        return {p for p in points if 0 < p < len(ids)}

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
        cuts = set(range(self.prefill_chunk, len(ids), self.prefill_chunk))
        if self._exact:
            cuts |= self._state_points(ids)
        bounds = [0, *sorted(cuts), len(ids)]
        chunks = [list(ids[a:b]) for a, b in zip(bounds, bounds[1:])]
        for i, chunk in enumerate(chunks):
            if should_cancel():
                return None
            last = i == len(chunks) - 1
            logits = self._forward(chunk, "last" if last else "none")
            if self._exact and not last:
                cache: Any = self.cache
                cache.snapshot()  # a later prompt (or this one, cancelled) can resume here
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
            self._rollback(len(req.prompt_ids) + max(len(generated) - 1, 0))  # as after plain decoding
            self.store.shrink(reserve=len(self.cache_tokens) * self.active_bytes_per_token)
            self._disk_pending = (list(req.prompt_ids), images)
            return FinishEvent(reason, tail, len(req.prompt_ids), len(generated), generated, timings, stops.matched)

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
        spec = self._speculation(req, should_cancel)
        run: list[np.ndarray] = []  # logits of a verified run's next positions, after `logits`
        drafted: list[int] = []     # the drafted tokens those positions were fed
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
            if spec is not None:
                spec.drafter.extend([token])
            if run and token == drafted[0]:  # accepted: the next position's logits are already computed
                timings.draft_n_accepted += 1
                logits = run.pop(0)
                drafted.pop(0)
                t_step = time.perf_counter()
                continue
            if spec is not None and spec.verify is not None:  # a verified run is over (all of it used, or not)
                k, ms = spec.verify
                spec.length.verified(k, k - len(drafted), ms)
                spec.verify = None
            if run:  # rejected at this position: the rest of the run is not the text
                self._rollback(len(req.prompt_ids) + len(generated) - 1)
                run, drafted = [], []
            t_step = t_draft = time.perf_counter()
            draft = self._draft(spec, budget - len(generated))
            t_fwd = time.perf_counter()
            self.decode_steps_run += 1  # a forward of the token, with its drafts if any
            if draft:
                out = self._forward([token] + draft, "all", verify=True)  # (1 + k, V)
                assert out is not None and spec is not None
                logits, run, drafted = out[0], list(out[1:]), list(draft)
                spec.verify = (len(draft), _ms(t_draft))  # the run's cost: drafting and verifying
                timings.draft_n += len(draft)
            else:
                logits = cast(np.ndarray, self._forward([token], "last"))  # "last": never None
                if spec is not None:
                    spec.length.plain_step(_ms(t_fwd))
                    self.step_ms = spec.length.step_ms

    def _speculation(self, req: GenerationRequest, should_cancel: Callable[[], bool]) -> Speculation | None:
        if not self.spec.enabled:
            return None
        return Speculation.start(self.spec, self.drafter, self.step_ms, req.prompt_ids, should_cancel)

    def _draft(self, spec: Speculation | None, room: int) -> list[int]:
        """Tokens to verify after the next one: at most room - 1 (each verified position yields one token) and
        what fits in the context."""
        if spec is None:
            return []
        k = min(spec.length.next_k(), room - 1, self.cache.max_len - self.cache.length - 1)
        return spec.drafter.propose(k) if k > 0 else []

    def _rollback(self, n: int) -> None:
        """Keep the first n positions of the active sequence (a verified run's rejected tail)."""
        if n < len(self.cache_tokens):
            self.cache.rollback(n)
            del self.cache_tokens[n:]


def _drain(detok: IncrementalDetokenizer, stops: StopMatcher) -> str:
    """Release what the detokenizer and the stop matcher still hold at the end of a generation."""
    released, stopped = stops.push(detok.flush())
    return released if stopped else released + stops.flush()
