"""Issue 22: a long prompt that passes the bytes pre-check no longer stalls the event loop. A 900 KB prompt
(~450k tokens against a 4,096 context; its bytes alone prove only ~1,760) used to be tokenized in full while
holding the GIL (the tokenizers library's `encode` does), so /health waited seconds behind it; four at once
held the loop for longer still. Now tokenization releases the GIL and stops once a prefix proves the prompt
too long (engine/token_bounds.py).

The check is structural, on the real CLI server as a subprocess: another client's /health stays within a
generous bound of the quiet latency measured just before (the defect: seconds; now: tens of ms), and the
server's own probe counts no more than one wake-up later than 100 ms (kestrel_event_loop_stalls_total; the
defect: several per burst). Both allow for a loaded 2-core machine; neither is a speed target.
"""
from __future__ import annotations

import json
import threading
import time

from tests.support.live_server import RawClient, drain_stderr, request_bytes

TEXT = "a " * 450_000
BODIES = {"/v1/chat/completions": {"model": "m", "messages": [{"role": "user", "content": TEXT}]},
          "/api/chat": {"model": "m", "messages": [{"role": "user", "content": TEXT}], "stream": False},
          "/v1/responses": {"model": "m", "input": TEXT}}
AT_ONCE = 4


def get(port: int, path: str) -> bytes:
    c = RawClient(port, timeout=60)
    try:
        c.send(request_bytes("GET", path))
        r = c.read_head()
        assert r.status == 200, r.status
        return c.read_body(r)
    finally:
        c.close()


def stalls(port: int) -> float:
    for line in get(port, "/metrics").decode().splitlines():
        if line.startswith("kestrel_event_loop_stalls_total "):
            return float(line.split()[1])
    raise AssertionError("no kestrel_event_loop_stalls_total in /metrics")


def health_latency(port: int) -> float:
    t = time.perf_counter()
    get(port, "/health")
    return time.perf_counter() - t


def post(port: int, path: str, body: bytes) -> tuple[int, bytes]:
    c = RawClient(port, timeout=120)
    try:
        c.send(request_bytes("POST", path, body))
        r = c.read_head()
        return r.status, c.read_body(r)
    finally:
        c.close()


def test_long_prompts_are_refused_without_stalling_the_loop(tiny_qwen3_tied, cli_server):
    proc, port = cli_server(tiny_qwen3_tied)
    drain_stderr(proc)
    quiet = []
    for _ in range(20):
        quiet.append(health_latency(port))
        time.sleep(0.02)
    before = stalls(port)
    busy, done = [], threading.Event()

    def poll():
        while not done.is_set():
            busy.append(health_latency(port))
            time.sleep(0.02)
    poller = threading.Thread(target=poll)
    poller.start()
    results: list[tuple[str, int, bytes]] = []
    try:
        for path, body in BODIES.items():
            data = json.dumps(body).encode()
            clients = [threading.Thread(target=lambda p=path, d=data: results.append((p, *post(port, p, d))))
                       for _ in range(AT_ONCE)]
            for t in clients:
                t.start()
            for t in clients:
                t.join(120)
    finally:
        done.set()
        poller.join(60)
    after = stalls(port)
    assert len(results) == AT_ONCE * len(BODIES)
    for path, status, payload in results:
        err = json.loads(payload)["error"]
        message = err if path.startswith("/api/") else err["message"]
        assert status == 400 and "maximum context length is 4096 tokens" in message, (path, payload[:300])
        assert "at least" in message, message   # refused from a prefix, not after counting all 450k tokens
        if not path.startswith("/api/"):
            assert err["code"] == "context_length_exceeded"
    assert busy, "no /health answered while the prompts were processed"
    bound = max(0.5, 10 * max(quiet))
    assert max(busy) < bound, (f"/health took {max(busy):.3f} s (quiet: {max(quiet):.3f} s) while "
                               f"{AT_ONCE} long prompts were prepared", sorted(busy)[-5:])
    assert after - before <= 1, f"{after - before:.0f} event-loop wake-ups over 100 ms late"
