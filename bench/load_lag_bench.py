"""The event loop while a model loads: does `/health` keep answering `503 loading` quickly, and which part of the
load stalls it.

Two measures, one run each:
- in the served process (`python -m appliance --model M --port 0`): /health probed open-loop, a new probe every
  PERIOD_S from its own thread whatever the earlier ones are doing (a stall of S seconds makes ~S/PERIOD_S late
  answers, as it would for a watchdog or a load balancer, instead of the one a polling loop would see); late =
  answered after LATE_S. Then /metrics' kestrel_event_loop_lag_max_seconds and the stall count.
- in this process: the load the server runs (cli._load(serving=True)) in a worker thread beside a trio loop
  running server/loop_lag.LoopLag, each load phase (engine/load/phases.py marks) with the worst loop lag inside
  it: where the GIL was held.
The served process answers through its busy responder while the load holds the GIL (h11_server.answer_while_busy),
so the probes measure what a client sees, and the loop lag what the event loop itself went through. The served
process runs the load's first part (the read with the tokenizer's build, the grammar table: cli._read_ahead) before
its event loop starts, so its loop lag should stay that of the machine; the in-process table runs the whole load
beside a loop and still shows where the GIL is held (those phases are marked "before the loop").

    python bench/load_lag_bench.py [--model FILE.gguf]   (default: the random Qwen3-1.7B-shaped Q4_0 file of
                                                          bench/gguf_bench.py, written once to its cache)
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from tests.support.live_server import RawClient, request_bytes  # noqa: E402

PERIOD_S = 0.02
LATE_S = 0.1


def probe_health(port: int, out: list, stop: threading.Event) -> None:
    def one() -> None:
        t0 = time.perf_counter()
        try:
            c = RawClient(port, timeout=60)
            c.send(request_bytes("GET", "/health"))
            r = c.read_head()
            c.read_body(r)
            c.close()
            out.append((r.status, time.perf_counter() - t0))
        except OSError:
            out.append((0, time.perf_counter() - t0))
    while not stop.is_set():
        threading.Thread(target=one, daemon=True).start()
        time.sleep(PERIOD_S)


def served(model: str) -> dict:
    proc = subprocess.Popen([sys.executable, "-m", "appliance", "--model", model, "--port", "0"],
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)
    port = None
    while port is None:
        line = proc.stderr.readline()
        if not line:
            raise RuntimeError("the server exited")
        m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
        port = int(m.group(1)) if m else None
    threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
    answers: list = []
    stop = threading.Event()
    prober = threading.Thread(target=probe_health, args=(port, answers, stop), daemon=True)
    t0 = time.monotonic()
    prober.start()
    while not any(s == 200 for s, _ in list(answers)):
        time.sleep(0.05)
    stop.set()
    prober.join()
    time.sleep(0.5)
    c = RawClient(port)
    c.send(request_bytes("GET", "/metrics"))
    r = c.read_head()
    metrics = c.read_body(r).decode()
    c.close()
    proc.terminate()
    proc.wait(30)
    loading = sorted(d for s, d in answers if s == 503)
    value = {m.group(1): float(m.group(2)) for m in re.finditer(r"^(kestrel_event_loop_\w+) (\S+)$", metrics, re.M)}
    return {"load_s": time.monotonic() - t0, "probes": len(loading), "late": sum(d > LATE_S for d in loading),
            "p99_ms": 1000 * loading[max(0, int(len(loading) * 0.99) - 1)], "max_ms": 1000 * loading[-1],
            "loop_lag_max_ms": 1000 * value.get("kestrel_event_loop_lag_max_seconds", 0.0),
            "stalls": value.get("kestrel_event_loop_stalls_total", 0.0)}


def by_phase(model: str) -> list[tuple[str, float, float]]:
    import trio

    from appliance import cli
    from appliance.engine.load import phases as ph
    from appliance.server.loop_lag import LoopLag

    marks: list[tuple[float, str]] = []
    mark = ph.Phases.mark

    def marked(self, name):
        marks.append((time.monotonic(), name))
        return mark(self, name)

    ph.Phases.mark = marked
    args = cli.build_parser().parse_args(["--model", model])
    lag = LoopLag()
    offset = [0.0]

    async def main():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lag.run)
            offset[0] = trio.current_time() - time.monotonic()
            marks.append((time.monotonic(), "start"))
            await trio.to_thread.run_sync(lambda: cli._load(args, serving=True))
            nursery.cancel_scope.cancel()

    trio.run(main)
    ph.Phases.mark = mark
    history = [(t - offset[0], late) for t, late in lag.history]
    rows = []
    for (t_prev, _), (t, name) in zip(marks, marks[1:]):
        worst = max((late for tt, late in history if t_prev <= tt - late <= t), default=0.0)
        rows.append((name, t - t_prev, worst))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    a = ap.parse_args()
    model = a.model
    if model is None:
        import gguf_bench
        model = gguf_bench.bench_file("q4_0")[1]
    print(f"load average before: {os.getloadavg()[0]:.1f}")
    s = served(model)
    print(f"served: load {s['load_s']:.1f} s, {s['probes']} /health probes every {PERIOD_S * 1000:.0f} ms, "
          f"{s['late']} late (> {LATE_S * 1000:.0f} ms, {100 * s['late'] / max(1, s['probes']):.1f}%), "
          f"p99 {s['p99_ms']:.0f} ms, max {s['max_ms']:.0f} ms; loop lag max {s['loop_lag_max_ms']:.0f} ms, "
          f"{s['stalls']:.0f} stalls > 100 ms")
    print(f"{'phase':36s} {'s':>6s} {'worst loop lag ms':>18s}  served")
    ahead = True
    for name, dt, worst in by_phase(model):
        print(f"{name:36s} {dt:6.2f} {1000 * worst:18.0f}  {'before the loop' if ahead else 'beside the loop'}")
        ahead = ahead and name != "grammar table"
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
