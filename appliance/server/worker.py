"""The engine thread and its trio bridge.

Policies:
- One thread owns the LoadedModel: it loads it (the server is already listening, /health says 503) and then
  runs one generation at a time. Nothing else touches the model, its caches or numpy work.
- Admission is FIFO and bounded: one request runs, at most `queue_limit` wait behind it; past that, admit()
  raises QueueFull at once and the server answers 429 with Retry-After. Waiting is on a fair trio.Semaphore, so the
  order of arrival is the order of service, and a waiter that goes away simply leaves the line.
- Events go from the engine thread to trio with TrioToken.run_sync_soon onto an unbounded memory channel:
  the engine never waits on the network (a generation is bounded by max_tokens / the context).
- The slot (a fair semaphore) belongs to the job once it starts and is released by the engine thread's
  report that the job ended, not by the HTTP side: a cancelled generation never overlaps the next one, and a
  client that reads slowly never holds the engine (its remaining events wait in its own channel).
- Shutdown: close_queue() sends every waiter away (ShuttingDown, 503) and admits no one; the running job
  keeps the grace period. A waiter that leaves before its turn (client gone, shutdown) is counted in
  `requests_abandoned`, so /metrics accounts for every admitted request.
- Cancellation: leaving a Ticket before its FinishEvent (client gone, shutdown) sets the job's cancel flag,
  which Engine.generate polls between prefill chunks and decode steps.
- A job is a GenerationRequest (Engine.generate) or one that runs itself on the engine (`request.run(engine,
  should_cancel)`: embedding and rerank jobs, engine/embedding.py), ending the same way (an event with `reason`).
- Idle after a job (none waiting): freed heap goes back to the system (server/heap.py, malloc_trim).
- Every job leaves a JobTrace (polls of the cancel flag, tokens, what ran after the cancel) for tests and
  /metrics; these are counted on the engine thread, not guessed from wall time.
"""
from __future__ import annotations

import collections
import logging
import math
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Literal

import trio

from ..engine.embedding import EmbeddingJob, EmbeddingResult
from ..engine.generate import FinishEvent
from .heap import release_free_heap

if TYPE_CHECKING:
    from ..engine.generate import GenerationRequest
    from ..engine.load import LoadedModel

    Job = GenerationRequest | EmbeddingJob  # what the engine thread runs

log = logging.getLogger("appliance.worker")
WorkerState = Literal["loading", "ready", "failed", "stopped"]


class QueueFull(Exception):
    def __init__(self, retry_after: int):
        super().__init__(f"the server is busy; retry after {retry_after} s")
        self.retry_after = retry_after


class NotReady(Exception):
    """The model is still loading (or failed to load)."""


class ShuttingDown(Exception):
    """The server is stopping: the queue takes no one and its waiters are sent away (503)."""


@dataclass
class EngineFailure:
    """An exception raised by Engine.generate, carried to the trio side as an event."""
    error: BaseException


@dataclass
class JobTrace:
    """Engine-side facts about one generation, written by the engine thread."""
    prompt_tokens: int = 0
    polls: int = 0                      # calls of should_cancel
    tokens: int = 0                     # TokenEvents produced
    prefill_polls: int = 0              # polls before the first TokenEvent (one per prefill chunk boundary)
    prefill_chunks: int | None = None   # chunks the engine ran (from its Timings), known at the end
    cancel_requested: bool = False
    polls_at_cancel: int = 0
    tokens_at_cancel: int = 0
    finish_reason: str | None = None
    started: float = 0.0
    finished: float = 0.0
    cancel_time: float = 0.0

    @property
    def polls_after_cancel(self) -> int:
        """Polls from the moment the flag was set to the end: 1 means the engine stopped at the next boundary."""
        return self.polls - self.polls_at_cancel if self.cancel_requested else 0

    @property
    def tokens_after_cancel(self) -> int:
        return self.tokens - self.tokens_at_cancel if self.cancel_requested else 0


@dataclass
class WorkerStats:
    requests_started: int = 0
    requests_finished: int = 0
    requests_cancelled: int = 0
    requests_abandoned: int = 0         # left the queue before their turn (client gone, shutdown)
    prompt_tokens: int = 0
    cached_tokens: int = 0              # prompt tokens reused from the KV cache (part of prompt_tokens)
    completion_tokens: int = 0
    draft_tokens: int = 0               # tokens drafted for verification (speculative decoding)
    draft_tokens_accepted: int = 0      # of those, accepted
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    finish_reasons: collections.Counter = field(default_factory=collections.Counter)  # 'error': engine raised
    traces: collections.deque = field(default_factory=lambda: collections.deque(maxlen=64))  # the latest jobs


class _Job:
    def __init__(self, request: Job, send: trio.MemorySendChannel):
        self.request = request
        self.send = send
        self.trace = JobTrace(prompt_tokens=len(getattr(request, "prompt_ids", ())))
        self._cancel = False
        self._lock = threading.Lock()

    def request_cancel(self) -> None:
        with self._lock:
            if self.trace.cancel_requested:
                return
            self.trace.cancel_requested = True
            self.trace.polls_at_cancel = self.trace.polls
            self.trace.tokens_at_cancel = self.trace.tokens
            self.trace.cancel_time = time.perf_counter()
            self._cancel = True

    def should_cancel(self) -> bool:
        with self._lock:
            self.trace.polls += 1
            return self._cancel


class Worker:
    """Owns the engine thread. Create inside trio, then `await worker.start()`."""

    def __init__(self, load: Callable[[], LoadedModel], queue_limit: int = 4):
        self._load = load
        self.queue_limit = max(0, queue_limit)
        self.state: WorkerState = "loading"
        self.loaded: LoadedModel | None = None
        self.load_error: BaseException | None = None
        self.ready = trio.Event()          # set when loading ends, either way
        self.stats = WorkerStats()
        self.waiting = 0
        self.current: JobTrace | None = None   # the job the engine is running (engine thread writes it)
        self._slot = trio.Semaphore(1)     # fair: FIFO hand-off on release
        self._jobs: queue.Queue = queue.Queue()
        self._token: trio.lowlevel.TrioToken | None = None
        self._thread: threading.Thread | None = None
        self._avg_job_s = 2.0
        self.closing = False
        self._waiters: set[trio.CancelScope] = set()

    # ---- lifecycle -------------------------------------------------------------------------------------
    async def start(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._thread = threading.Thread(target=self._thread_main, name="engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Ask the engine thread to exit after its current job; wait a little for it."""
        self._jobs.put(None)
        if self._thread is not None:
            self._thread.join(timeout)
        self.state = "stopped" if self.state == "ready" else self.state

    def engine_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def close_queue(self) -> None:
        """Shutdown: admit no one; every request still waiting for its turn gets ShuttingDown."""
        self.closing = True
        for scope in list(self._waiters):
            scope.cancel()

    @property
    def busy(self) -> bool:
        return self._slot.value == 0

    # ---- trio side -------------------------------------------------------------------------------------
    def admit(self) -> "Ticket":
        """A place in line, or QueueFull / NotReady at once. Use as `async with worker.admit() as ticket`."""
        if self.closing:
            raise ShuttingDown()
        if self.state != "ready":
            raise NotReady(self.state)
        if self.waiting + (1 if self.busy else 0) >= 1 + self.queue_limit:
            raise QueueFull(self.retry_after())
        self.waiting += 1
        return Ticket(self)

    def retry_after(self) -> int:
        return max(1, math.ceil(self._avg_job_s * (self.waiting + 1)))

    def _job_done(self, job: _Job) -> None:
        t = job.trace
        s = self.stats
        s.requests_finished += 1
        s.finish_reasons[t.finish_reason or "error"] += 1
        if t.finish_reason == "cancelled":
            s.requests_cancelled += 1
            log.info("generation cancelled (client gone or shutdown) after %d prefill chunks and %d tokens; "
                     "%d token(s) after the cancel", t.prefill_chunks or 0, t.tokens, t.tokens_after_cancel)
        s.traces.append(t)
        self._avg_job_s = 0.8 * self._avg_job_s + 0.2 * max(0.0, t.finished - t.started)
        self._slot.release()

    def _loaded(self, loaded: LoadedModel) -> None:
        self.loaded = loaded
        self.state = "ready"
        self.ready.set()

    def _load_failed(self, error: BaseException) -> None:
        self.load_error = error
        self.state = "failed"
        self.ready.set()

    # ---- engine thread ---------------------------------------------------------------------------------
    def _call_trio(self, fn: Callable, *args: Any) -> None:
        assert self._token is not None  # set before the engine thread starts
        try:
            self._token.run_sync_soon(fn, *args)
        except trio.RunFinishedError:
            pass

    def _thread_main(self) -> None:
        try:
            loaded = self._load()
        except BaseException as e:  # reported to the CLI, which prints one line and exits non-zero
            self._call_trio(self._load_failed, e)
            return
        self._call_trio(self._loaded, loaded)
        while True:
            job = self._jobs.get()
            if job is None:
                return
            self._run(loaded, job)
            if self._jobs.empty():  # idle: what the request freed goes back to the system (server/heap.py)
                release_free_heap()

    def _run(self, loaded: LoadedModel, job: _Job) -> None:
        t = job.trace
        t.started = time.perf_counter()
        self.current = t
        s = self.stats
        s.requests_started += 1
        last: FinishEvent | EmbeddingResult | EngineFailure | None = None  # delivered with the slot's release
        try:
            req = job.request  # an embedding / rerank job (engine/embedding.py) runs itself
            events: Iterator[Any] = req.run(loaded.engine, job.should_cancel) if isinstance(req, EmbeddingJob) \
                else loaded.engine.generate(req, job.should_cancel)
            for ev in events:
                if isinstance(ev, (FinishEvent, EmbeddingResult)):  # the engine has already freed its cache
                    t.finish_reason = ev.reason
                    s.prompt_tokens += ev.prompt_tokens
                    s.completion_tokens += ev.completion_tokens
                    tm = ev.timings
                    s.cached_tokens += getattr(tm, "cache_n", 0)
                    s.draft_tokens += getattr(tm, "draft_n", 0)
                    s.draft_tokens_accepted += getattr(tm, "draft_n_accepted", 0)
                    t.prefill_chunks = getattr(tm, "prefill_chunks", None)
                    s.prefill_seconds += tm.prefill_ms / 1000.0
                    s.decode_seconds += sum(tm.decode_ms) / 1000.0
                    last = ev
                    break
                with job._lock:
                    if t.tokens == 0:
                        t.prefill_polls = t.polls
                    t.tokens += 1
                self._call_trio(job.send.send_nowait, ev)
        except Exception as e:  # an engine bug or a request the engine refused (ContextLengthError)
            last = EngineFailure(e)
        finally:
            t.finished = time.perf_counter()
            self.current = None
            self._call_trio(self._end_job, job, last)
        after = getattr(loaded.engine, "after_request", None)
        if after is not None:  # e.g. the disk prompt cache's write, once the client has its response
            try:
                after()
            except Exception as e:
                log.warning("after-request work failed: %r", e)

    def _end_job(self, job: _Job, last: FinishEvent | EmbeddingResult | EngineFailure | None) -> None:
        """Trio side: the last event, then the slot, in one step, so a client that has seen the end of its
        generation and sends the next request never finds the engine still marked busy."""
        if last is not None:
            job.send.send_nowait(last)
        job.send.close()
        self._job_done(job)


class Ticket:
    """One request's place in line and, once its turn comes, its generation."""

    def __init__(self, worker: Worker):
        self._worker = worker
        self._waiting = True
        self._holding = False
        self._job: _Job | None = None
        self._finished = False

    async def __aenter__(self) -> "Ticket":
        return self

    async def wait_turn(self) -> None:
        """Wait (FIFO) until the engine is free. Cancellable: a cancelled waiter just leaves the line.
        ShuttingDown when the queue is closed before its turn."""
        w = self._worker
        with trio.CancelScope() as scope:
            if w.closing:
                scope.cancel()
            w._waiters.add(scope)
            try:
                await w._slot.acquire()
                self._holding = True
            finally:
                w._waiters.discard(scope)
        if not self._holding:
            raise ShuttingDown()
        self._leave_line()

    def start(self, request: Job) -> trio.MemoryReceiveChannel:
        """Hand the request to the engine thread; events arrive on the returned channel, FinishEvent last."""
        assert self._holding and self._job is None
        send, recv = trio.open_memory_channel(math.inf)
        self._job = _Job(request, send)
        self._holding = False  # the job owns the slot now; the engine thread's end-of-job report frees it
        self._worker._jobs.put(self._job)
        return recv

    def finished(self) -> None:
        """The caller saw the FinishEvent (or an EngineFailure): nothing to cancel."""
        self._finished = True

    @property
    def trace(self) -> JobTrace | None:
        return self._job.trace if self._job else None

    def _leave_line(self) -> None:
        if self._waiting:
            self._waiting = False
            self._worker.waiting -= 1

    def drop(self, abandoned: bool) -> None:
        """Give the place in line back before waiting for the turn (the request failed, or its client left)."""
        if abandoned and self._waiting:
            self._worker.stats.requests_abandoned += 1
        self._leave_line()

    async def __aexit__(self, *exc: Any) -> None:
        if self._waiting:  # never got its turn
            self._worker.stats.requests_abandoned += 1
        self._leave_line()
        if self._job is not None and not self._finished:
            self._job.request_cancel()
        if self._holding:
            self._holding = False
            self._worker._slot.release()
