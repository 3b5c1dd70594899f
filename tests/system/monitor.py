"""Beside a load on a server process: /health and /metrics polls and samples of the process's RSS, fds and
threads (tests/system/mixed_load.py)."""
from __future__ import annotations

import collections
import json
import os
import re
import threading
import time

from tests.support.live_server import RawClient, request_bytes

RESPONSE_TIMEOUT_S = 60.0
HEALTH_PERIOD_S, HEALTH_MAX_S = 0.5, 2.0
METRICS_PERIOD_S, SAMPLE_PERIOD_S = 5.0, 3.0
SETTLE_S = 30.0  # a connection a client left open ends at the server's keep-alive timeout (15 s)


def get(port: int, path: str) -> tuple[int, bytes]:
    c = RawClient(port, timeout=RESPONSE_TIMEOUT_S)
    try:
        c.send(request_bytes("GET", path))
        r = c.read_head()
        return r.status, c.read_body(r)
    finally:
        c.close()


def usage(pid: int) -> dict:
    """pid's RSS, and its two parts: anonymous memory (the heap, what a leak grows) and resident pages of mapped
    files (libraries, model files: the kernel drops and reloads them under memory pressure); fds; threads."""
    with open(f"/proc/{pid}/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    with open(f"/proc/{pid}/status") as f:
        kb = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f) if k in ("RssAnon", "RssFile")}
    return {"rss_mb": round(rss / 2**20, 1), "anon_mb": round(kb.get("RssAnon", 0) / 1024, 1),
            "file_mb": round(kb.get("RssFile", 0) / 1024, 1), "fds": len(os.listdir(f"/proc/{pid}/fd")),
            "threads": len(os.listdir(f"/proc/{pid}/task"))}


def fd_kinds(pid: int) -> dict:
    """The process's fds by what they are: "listener" (a TCP socket in LISTEN), "unix" (unix sockets: trio's
    wake-up pairs), "connection" (every other socket: TCP in any other state, CLOSE_WAIT and lingering ones
    included, and one already reset, which has left the TCP table but not the fd table), "pipe", "file", and
    anonymous inodes by name ("eventpoll", "eventfd"...)."""
    listening, unix = set(), set()
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            listening.update(fields[9] for fields in map(str.split, f.readlines()[1:]) if fields[3] == "0A")
    with open(f"/proc/{pid}/net/unix") as f:
        unix.update(fields[6] for fields in map(str.split, f.readlines()[1:]) if len(fields) > 6)
    kinds: collections.Counter = collections.Counter()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inode = target[len("socket:["):-1]
            kinds["listener" if inode in listening else "unix" if inode in unix else "connection"] += 1
        elif target.startswith("anon_inode:"):
            kinds[target[len("anon_inode:"):].strip("[]")] += 1
        else:
            kinds["pipe" if target.startswith("pipe:") else "file"] += 1
    return dict(sorted(kinds.items()))


def settle(port: int, timeout: float, pid: int | None = None) -> dict:
    """Waits (up to timeout) until the server counts no client connection but the one asking
    (kestrel_open_connections in /metrics) and, for a server process pid, holds no connection socket (a closed
    connection's socket goes within milliseconds, even on a loaded machine). What it saw last: the count,
    "settled", the seconds it took and pid's fd_kinds."""
    t0 = time.monotonic()
    while True:
        status, body = get(port, "/metrics")
        count = metric(body.decode(), "kestrel_open_connections") if status == 200 else float("nan")
        time.sleep(0.1)  # the server closes that /metrics request's socket
        kinds = fd_kinds(pid) if pid is not None else {}
        settled = count == 1 and not kinds.get("connection")
        if settled or time.monotonic() - t0 > timeout:
            return dict({"fd_kinds": kinds} if pid is not None else {}, open_connections=count, settled=settled,
                        settle_s=round(time.monotonic() - t0, 1))
        time.sleep(0.4)


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(m.group(1)) if m else float("nan")


def server_5xx(text: str) -> dict:
    """kestrel_requests_total series with a 5xx code."""
    return {m.group(1): int(float(m.group(3))) for m in re.finditer(
        r'^kestrel_requests_total\{(endpoint="([^"]*)",code="5\d\d")\} (\S+)$', text, re.M)}


class Monitor:
    """Threads polling /health and /metrics and sampling the server's RSS, fds and threads until stopped."""

    def __init__(self, port: int, pid: int, health_max_s: float = HEALTH_MAX_S):
        self.port, self.pid, self.health_max_s = port, pid, health_max_s
        self.stop = threading.Event()
        self.health: list[float] = []
        self.health_failures: list = []
        self.metrics_polls, self.metrics_failures = 0, []
        self.lag_window_max = 0.0   # worst of kestrel_event_loop_lag_seconds (the last 10-20 s) over the polls
        self.samples: list[dict] = []
        self.threads = [threading.Thread(target=f, daemon=True) for f in (self._health, self._metrics, self._sample)]

    def __enter__(self) -> "Monitor":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(RESPONSE_TIMEOUT_S + 5)

    def _health(self) -> None:
        while not self.stop.wait(HEALTH_PERIOD_S):
            t0 = time.perf_counter()
            try:
                status, body = get(self.port, "/health")
                dt = time.perf_counter() - t0
                if status != 200 or json.loads(body)["status"] != "ok" or dt > self.health_max_s:
                    self.health_failures.append((status, round(dt, 3), body[:200]))
            except (OSError, ValueError, KeyError) as e:
                dt = time.perf_counter() - t0
                self.health_failures.append(("error", round(dt, 3), repr(e)))
            self.health.append(dt)

    def _metrics(self) -> None:
        while not self.stop.wait(METRICS_PERIOD_S):
            try:
                status, body = get(self.port, "/metrics")
                self.metrics_polls += 1
                lag = metric(body.decode(), "kestrel_event_loop_lag_seconds") if status == 200 else float("nan")
                if lag != lag:  # NaN: no such line
                    self.metrics_failures.append((status, body[:200]))
                else:
                    self.lag_window_max = max(self.lag_window_max, lag)
            except OSError as e:
                self.metrics_failures.append(("error", repr(e)))

    def _sample(self) -> None:
        while not self.stop.wait(SAMPLE_PERIOD_S):
            self.samples.append(usage(self.pid))

    def summary(self) -> dict:
        h = sorted(self.health)
        during = {k: {"first": self.samples[0][k], "last": self.samples[-1][k],
                      "max": max(s[k] for s in self.samples)} for k in self.samples[0]} if self.samples else {}
        return {"health": {"polls": len(h), "max_s": round(h[-1], 3) if h else None,
                           "p99_s": round(h[int(0.99 * (len(h) - 1))], 4) if h else None,
                           "failures": len(self.health_failures), "first_failures": self.health_failures[:5]},
                "metrics": {"polls": self.metrics_polls, "failures": self.metrics_failures[:5]},
                "loop_lag_during_load_max_s": round(self.lag_window_max, 4),
                "samples": len(self.samples), "during_load": during}
