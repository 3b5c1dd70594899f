#!/usr/bin/env python3
"""Start / serve / SIGTERM cycles of the real executable path (`python -m appliance`), counting crashes:

    python tests/system/sigterm_cycles.py [--model FILE] [--cycles 300] [--grace 1] [--json out.json]

Each cycle starts the server on a free port, waits for /health, runs two streamed chats of 16-64 tokens and a
short non-stream chat, then sends SIGTERM — on every other cycle while a third stream is still generating, so
the shutdown meets the engine inside a native call. A cycle passes when the process exits 0 within grace + 5 s
and every response was well formed; an exit by signal (SIGSEGV, SIGABRT, ...) is a crash. The issue this
answers saw one segfault in 20-40 starts; the report gives the counts (and exits non-zero on any crash).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)

from tests.support.live_server import RawClient, chat_body, request_bytes, wait_healthy


def start(model: str, grace: float, log, *extra: str) -> tuple[subprocess.Popen, int]:
    """A server process (`extra`: more command-line options) serving on a free port and ready; its stderr goes
    to log."""
    proc = subprocess.Popen([sys.executable, "-m", "appliance", "--model", model, "--port", "0", "--grace", str(grace),
                             "--ctx", "1024", "--log-level", "warning", *extra],
                            cwd=os.environ.get("KESTREL_CYCLES_CWD", ROOT), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, preexec_fn=allow_core_dumps,
                            env=dict(os.environ, PYTHONPATH=ROOT, PYTHONFAULTHANDLER="1"))
    port = None
    deadline = time.monotonic() + 120
    lines = []

    def read_stderr():
        for line in proc.stderr:
            lines.append(line)
            log.write(line)
    # --log-level warning hides the 'listening' line: find the port from the socket table instead
    threading.Thread(target=read_stderr, daemon=True).start()
    while port is None and time.monotonic() < deadline and proc.poll() is None:
        port = listening_port(proc.pid)
        time.sleep(0.05)
    if port is not None and wait_healthy(port, deadline - time.monotonic(), proc):
        return proc, port
    rc = proc.poll()
    proc.kill()
    raise RuntimeError(f"server never became ready (exit {rc}, port {port}): {''.join(lines)[-2000:]}")


def allow_core_dumps() -> None:
    """A crashed server leaves a core file in its working directory (KESTREL_CYCLES_CWD) for gdb."""
    import resource
    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def listening_port(pid: int) -> int | None:
    """The TCP port process pid listens on (from /proc/net/tcp and its socket inodes)."""
    try:
        inodes = {os.readlink(f"/proc/{pid}/fd/{fd}")[8:-1] for fd in os.listdir(f"/proc/{pid}/fd")
                  if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:[")}
        with open("/proc/net/tcp") as f:
            for line in f.readlines()[1:]:
                parts = line.split()
                if parts[3] == "0A" and parts[9] in inodes:  # LISTEN
                    return int(parts[1].split(":")[1], 16)
    except OSError:
        return None
    return None


def stream(port: int, n: int, read_all: bool = True):
    c = RawClient(port, timeout=60)
    c.send(request_bytes("POST", "/v1/chat/completions",
                         chat_body("Tell me about lighthouses.", stream=True, max_tokens=n, ignore_eos=True)))
    r = c.read_head()
    if read_all:
        c.read_events(r)
        c.close()
        ok = r.status == 200 and r.data_events()[-1] == b"data: [DONE]\n\n"
        return ok, None
    c.read_events(r, stop_after=3)
    return r.status == 200, (c, r)


def cycle(model: str, grace: float, rng: random.Random, cut_mid_stream: bool, log) -> dict:
    t0 = time.monotonic()
    proc, port = start(model, grace, log)
    try:
        return serve_and_stop(proc, port, grace, rng, cut_mid_stream, t0)
    except Exception as e:  # a request failed: did the server die under it?
        try:
            rc = proc.wait(grace + 5)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = f"alive after {e!r}"[:200]
        return {"rc": rc, "ok": False, "exit_s": 0.0, "cycle_s": time.monotonic() - t0, "error": repr(e)[:200]}


def serve_and_stop(proc, port: int, grace: float, rng: random.Random, cut_mid_stream: bool, t0: float) -> dict:
    ok = True
    for _ in range(2):
        ok &= stream(port, rng.randint(16, 64))[0]
    c = RawClient(port, timeout=60)
    c.send(request_bytes("POST", "/v1/chat/completions", chat_body("Hi", max_tokens=8)))
    r = c.read_head()
    body = c.read_body(r)
    c.close()
    ok &= r.status == 200 and b'"choices"' in body
    open_stream = None
    if cut_mid_stream:
        good, open_stream = stream(port, 900, read_all=False)
        ok &= good
    t_term = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    if open_stream is not None:
        sc, sr = open_stream
        sc.read_events(sr)
        sc.close()
        ok &= sr._finished and sr.json_events()[-1].get("error", {}).get("code") == "server_shutdown"
    try:
        rc = proc.wait(grace + 5)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = "hang"
    return {"rc": rc, "ok": bool(ok), "exit_s": time.monotonic() - t_term, "cycle_s": time.monotonic() - t0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--cycles", type=int, default=300)
    ap.add_argument("--grace", type=float, default=1.0)
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--log", default=os.devnull, help="servers' stderr goes here")
    args = ap.parse_args(argv)
    if args.model is None:
        from tests.support.gguf_files import fetch_smollm2
        args.model = fetch_smollm2()
    rng = random.Random(16)
    codes: collections.Counter = collections.Counter()
    bad, exits, t0 = 0, [], time.monotonic()
    with open(args.log, "a") as log:
        for i in range(args.cycles):
            try:
                res = cycle(args.model, args.grace, rng, cut_mid_stream=i % 2 == 1, log=log)
            except Exception as e:  # a server that died or never came up counts as a failed cycle
                res = {"rc": f"error: {e!r}"[:200], "ok": False, "exit_s": 0.0, "cycle_s": 0.0}
            codes[str(res["rc"])] += 1
            bad += not res["ok"]
            exits.append(res["exit_s"])
            if res["rc"] != 0 or not res["ok"]:
                print(f"cycle {i}: {res}", flush=True)
            if (i + 1) % 25 == 0:
                print(f"{i + 1} cycles: exit codes {dict(codes)}, bad responses {bad}, "
                      f"{time.monotonic() - t0:.0f} s", flush=True)
    crashes = sum(n for rc, n in codes.items() if rc.lstrip("-").isdigit() and int(rc) < 0)
    report = {"cycles": args.cycles, "exit_codes": dict(codes), "crashes_by_signal": crashes,
              "segfaults": codes.get(str(-signal.SIGSEGV), 0), "bad_responses": bad,
              "max_exit_after_sigterm_s": round(max(exits, default=0.0), 2), "grace_s": args.grace,
              "model": os.path.basename(args.model), "seconds": round(time.monotonic() - t0)}
    print(json.dumps(report), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if codes.get("0", 0) == args.cycles and bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
