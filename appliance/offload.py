"""CPU work a request needs before it can queue (body parsing, template, tokenization, image decoding), run off
the event loop with bounds, and the event loop's own lateness as a measured property.

Policies:
- Nothing here runs inside `async def`: `off_loop` runs a function in a worker thread under a CapacityLimiter
  (request preparation: PREP_THREADS at once; image decoding: IMAGE_THREADS at once, so the decoded pixels one
  burst can hold are those of IMAGE_THREADS images, not of every waiting request).
- A request whose client leaves stops waiting at once (the thread is abandoned, not awaited); the function gets
  a `stop` Event that is set then, and checks it between units of work (between images), so abandoned work
  ends at the next boundary. The limiter's place is held until the thread really ends.
- After a large piece of work the thread gives freed heap back to the system (glibc malloc_trim), so a burst
  of big requests does not leave the process resident at its peak.
- LoopLag: a task that sleeps PERIOD_S at a time and records how late each wake-up is; the worst lateness is
  exported in /metrics (kestrel_event_loop_lag_seconds over the last window, _max_ since start), and wake-ups
  later than STALL_S are counted (kestrel_event_loop_stalls_total).
"""
from __future__ import annotations

import collections
import ctypes
import ctypes.util
import threading
from typing import Callable, TypeVar

import trio

T = TypeVar("T")

PREP_THREADS = 2     # request preparations (JSON, template, tokenizer) at once
IMAGE_THREADS = 1    # image decodes at once (one 8000x8000 RGBA PNG: ~1.2 GB of peak RSS growth, README)
TRIM_BYTES = 1 << 20  # work on at least this many input bytes ends with malloc_trim

_libc = None


def trim_memory() -> bool:
    """Return free heap pages of every malloc arena to the system (glibc); False where there is none."""
    global _libc
    if _libc is None:
        try:
            lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            lib.malloc_trim.argtypes, lib.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
            _libc = lib
        except (OSError, AttributeError):  # musl, other systems: nothing to trim with
            _libc = False
    if not _libc:
        return False
    _libc.malloc_trim(0)
    return True


async def off_loop(fn: Callable[[threading.Event], T], limiter: trio.CapacityLimiter) -> T:
    """fn(stop) in a worker thread under `limiter`. If the caller is cancelled (client gone, shutdown), stop is
    set and the caller leaves at once; the thread ends at fn's next check of stop."""
    stop = threading.Event()
    try:
        return await trio.to_thread.run_sync(fn, stop, limiter=limiter, abandon_on_cancel=True)
    finally:
        stop.set()


class LoopLag:
    """How late the event loop wakes a sleeping task: the measure of everything that blocks it."""

    PERIOD_S = 0.02
    WINDOW_S = 10.0
    STALL_S = 0.1

    def __init__(self) -> None:
        self.max_s = 0.0          # worst since start
        self.stalls = 0           # wake-ups later than STALL_S
        self._window: list[float] = [0.0, 0.0]  # worst in the previous and the current window
        self._window_start = 0.0
        self.history: collections.deque = collections.deque(maxlen=4096)  # (trio time, lateness): ~80 s

    def worst_between(self, t0: float, t1: float) -> float:
        """Worst lateness of the wake-ups due between t0 and t1 (trio clock)."""
        return max((late for t, late in list(self.history) if t0 <= t - late <= t1), default=0.0)

    @property
    def recent_s(self) -> float:
        """Worst lateness over the last one to two windows."""
        return max(self._window)

    def record(self, now: float, late: float) -> None:
        if now - self._window_start >= self.WINDOW_S:
            self._window = [self._window[1], 0.0]
            self._window_start = now
        late = max(0.0, late)
        self._window[1] = max(self._window[1], late)
        self.max_s = max(self.max_s, late)
        self.stalls += late > self.STALL_S
        self.history.append((now, late))

    async def run(self) -> None:
        self._window_start = trio.current_time()
        while True:
            due = trio.current_time() + self.PERIOD_S
            await trio.sleep_until(due)
            now = trio.current_time()
            self.record(now, now - due)
