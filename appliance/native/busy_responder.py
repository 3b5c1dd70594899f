"""The busy responder (src/busy_responder.c): a native thread that answers the server's listening sockets while
the interpreter cannot.

Policy: while a model loads, third-party native code on the engine thread holds the GIL for up to seconds at a
time (the tokenizers library converting and building a BPE vocabulary, llguidance building its token table:
neither releases it), so the event loop cannot even accept. This thread needs no GIL: a connection still in
the backlog after `grace_s` (the event loop takes one within a millisecond when it can) is accepted and
answered with one fixed response, then closed. Only the start and the stop are Python calls (ctypes releases
the GIL in both). It uses the kernel library's file (library_path.py, as native/kernels.py does (KESTREL_NATIVE=0,
which turns the kernels off, does not matter here)); without the library there is no responder and the event
loop answers alone, as before. While it runs it can also feed systemd's watchdog (`watchdog(address,
interval_s)`, WATCHDOG=1 datagrams from the same thread): the server does the load's GIL-bound steps before its
event loop starts, and the loop's own pings take over (`watchdog(None)`) once it runs.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import time
from typing import Callable, Iterator

from .library_path import library_candidates

_lib: ctypes.CDLL | None = None


def _library() -> ctypes.CDLL | None:
    global _lib
    if _lib is None:
        paths = library_candidates()
        if not paths:
            return None
        try:
            lib = ctypes.CDLL(paths[0])
            lib.kq_busy_start.restype = ctypes.c_int
            lib.kq_busy_start.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_char_p,
                                          ctypes.c_int64]
            lib.kq_busy_stop.restype = ctypes.c_int64
            lib.kq_busy_stop.argtypes = []
            lib.kq_busy_watchdog.restype = ctypes.c_int64
            lib.kq_busy_watchdog.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_int]
        except (OSError, AttributeError):
            return None
        _lib = lib
    return _lib


class BusyResponder:
    """`start(fds, response)` answers what the event loop leaves waiting on `fds` with `response` (a whole HTTP
    response, `Connection: close`); `stop()` ends it and returns how many connections it answered. One at a
    time per process."""

    def __init__(self, grace_s: float = 0.05):
        self.grace_s = grace_s
        self.running = False

    def start(self, fds: list[int], response: bytes) -> bool:
        """True when the thread runs; False without the library (or if it could not start)."""
        lib = _library()
        if lib is None or self.running or not fds:
            return False
        arr = (ctypes.c_int * len(fds))(*fds)
        err = lib.kq_busy_start(ctypes.cast(arr, ctypes.c_void_p), len(fds), int(self.grace_s * 1000), response,
                                len(response))
        if err != 0:
            raise OSError(-err, f"busy responder: {os.strerror(-err)}")
        self.running = True
        return True

    def watchdog(self, address: bytes | None, interval_s: float = 0.0) -> int:
        """While the thread runs, WATCHDOG=1 to the AF_UNIX datagram `address` (as for sendto; a leading NUL:
        abstract) every `interval_s`; None turns it off and returns the pings sent meanwhile. 0 without the
        library."""
        lib = _library()
        if lib is None:
            return 0
        if address is None or interval_s <= 0:
            return int(lib.kq_busy_watchdog(None, 0, 0))
        err = int(lib.kq_busy_watchdog(address, len(address), max(1, int(interval_s * 1000))))
        if err < 0:
            raise OSError(-err, f"busy responder watchdog: {os.strerror(-err)}")
        return 0

    def stop(self) -> int:
        """Join the thread (within ~1 s: the connection it is answering, if any); the count it answered."""
        if not self.running:
            return 0
        self.running = False
        lib = _library()
        assert lib is not None
        return int(lib.kq_busy_stop())


class GilBoundSections:
    """Where the load calls native code that holds the GIL for long (`with GIL_BOUND.section("tokenizer"):`),
    no connection waits inside the event loop: the server (h11_server, while its busy responder runs) takes no
    new connection into the loop during a section, and a section starts only once the connections the loop
    already has are answered (at most DRAIN_S; during the load they close after one response), so the busy
    responder, which needs no GIL, answers everything that comes meanwhile. Without a server watching (the
    one-shot CLI, in-process tests) a section is only a name."""

    DRAIN_S = 0.5
    ACCEPT_RECHECK_S = 0.01   # the event loop looks at `active` at least this often while it accepts

    def __init__(self) -> None:
        self.active = 0                                  # sections running now (read by the event loop)
        self._open_connections: Callable[[], int] | None = None

    def watch(self, open_connections: Callable[[], int] | None) -> None:
        """The server's count of connections in the event loop (None: stop watching)."""
        self._open_connections = open_connections

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        self.active += 1
        try:
            count = self._open_connections
            if count is not None:  # past 2 rechecks the loop accepts no more; then its connections must end
                t0 = time.monotonic()
                while (count() or time.monotonic() < t0 + 2 * self.ACCEPT_RECHECK_S) and time.monotonic() < t0 + self.DRAIN_S:
                    time.sleep(0.002)  # the GIL is free meanwhile: the event loop answers what it has
            yield
        finally:
            self.active -= 1


GIL_BOUND = GilBoundSections()
