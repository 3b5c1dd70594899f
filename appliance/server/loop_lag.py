"""The event loop's lateness as a measured property: everything that blocks the loop shows up here.

Policies:
- LoopLag: a task that sleeps PERIOD_S at a time and records how late each wake-up is; the worst lateness is
  exported in /metrics (kestrel_event_loop_lag_seconds over the last window, _max_ since start), and wake-ups
  later than STALL_S are counted (kestrel_event_loop_stalls_total).
- Run by whoever runs the server (cli.serve, tests/support/live_server.py): `nursery.start_soon(api.loop_lag.run)`.
"""
from __future__ import annotations

import collections

import trio


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
