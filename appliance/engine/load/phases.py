"""Where a start goes: named durations of the load (Phases) and the process's own age (from /proc).

Policy: the loaders mark their parts (model file, weights, tokenizer, chat template, layers, ...) as they go;
the server logs them once, when it turns ready, after the time from process start to the load (interpreter,
imports, binding) and, for the one-file executable, the unpack its bootloader did before Python started.
bench/startup_bench.py reads that line. Nothing here changes what is loaded; reading the clock is all it does.
"""
from __future__ import annotations

import os
import sys
import time


class Phases:
    """`mark(name)`: the time since the previous mark (or since creation) was spent on `name`."""

    def __init__(self) -> None:
        self.items: list[tuple[str, float]] = []  # (name, seconds) in order
        self.began_at_age: float | None = None  # process_age() when the load began (set by the CLI)
        self._last = time.perf_counter()

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.items.append((name, now - self._last))
        self._last = now


def process_age(pid: int | str = "self") -> float | None:
    """Seconds since process `pid` started (10 ms resolution: the kernel counts clock ticks), None off Linux."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            fields = f.read().rpartition(")")[2].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime, counted after the comm field
        return time.clock_gettime(time.CLOCK_BOOTTIME) - started
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def unpack_seconds() -> float | None:
    """For the PyInstaller one-file executable: how long its bootloader (our parent, the same executable)
    ran before this process started, i.e. the unpack into the temporary directory. None when not frozen."""
    if not getattr(sys, "frozen", False):
        return None
    try:
        if os.readlink(f"/proc/{os.getppid()}/exe") != os.readlink("/proc/self/exe"):
            return None
    except OSError:
        return None
    parent, own = process_age(os.getppid()), process_age()
    return None if parent is None or own is None else max(0.0, parent - own)


def startup_line(load: Phases) -> str:
    """The log line at ready: the total from process start (the unpack included), then each part in ms;
    "other" is what no part names (lazy imports inside the load, the hand-over to the event loop)."""
    own = process_age()
    unpack = unpack_seconds()
    parts = [("unpack", unpack)] if unpack is not None else []
    if load.began_at_age is not None:
        parts.append(("interpreter and imports", load.began_at_age))
    parts += load.items
    total = (own or 0.0) + (unpack or 0.0)
    parts.append(("other", max(0.0, total - sum(s for _, s in parts))))
    return f"start-up {1000 * total:.0f} ms to ready: " + ", ".join(f"{n} {1000 * s:.0f}" for n, s in parts)
