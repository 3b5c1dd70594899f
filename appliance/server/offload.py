"""CPU work a request needs before it can queue (body parsing, template, tokenization, image decoding), run off
the event loop with bounds (the event loop's own lateness is measured in loop_lag.py).

Policies:
- Nothing here runs inside `async def`: `off_loop` runs a function in a worker thread under a CapacityLimiter
  (request preparation: PREP_THREADS at once; image decoding: IMAGE_THREADS at once, so the decoded pixels one
  burst can hold are those of IMAGE_THREADS images, not of every waiting request).
- A request whose client leaves stops waiting at once (the thread is abandoned, not awaited); the function gets
  a `stop` Event that is set then, and checks it between units of work (between images), so abandoned work
  ends at the next boundary. The limiter's place is held until the thread really ends.
- After a large piece of work the thread gives freed heap back to the system (glibc malloc_trim), so a burst
  of big requests does not leave the process resident at its peak.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import threading
from typing import Callable, TypeVar

import trio

T = TypeVar("T")

PREP_THREADS = 2     # request preparations (JSON, template, tokenizer) at once
IMAGE_THREADS = 1    # image decodes at once (one 8000x8000 RGBA PNG: ~1.2 GB of peak RSS growth, README)
TRIM_BYTES = 1 << 20  # work on at least this many input bytes ends with malloc_trim

_libc: ctypes.CDLL | None = None
_no_libc = False  # looked for and not found: nothing to trim with


def trim_memory() -> bool:
    """Return free heap pages of every malloc arena to the system (glibc); False where there is none."""
    global _libc, _no_libc
    if _libc is None and not _no_libc:
        try:
            lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            lib.malloc_trim.argtypes, lib.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
            _libc = lib
        except (OSError, AttributeError):  # musl, other systems: nothing to trim with
            _no_libc = True
    if _libc is None:
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
