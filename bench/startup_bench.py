"""Time to ready: process start to the first `GET /health` 200, the server's own breakdown of it, and ratios.

Each round starts, from an empty directory, `python -m appliance --model M` (this tree, the interpreter running
the bench) and, when given (`--frozen PATH`, e.g. dist/x86_64/kestrel-appliance), the one-file executable (its
own clean environment and TMPDIR, as tests/system/test_frozen_smoke.py runs it), and also the import floor: the same
interpreter importing just the third-party packages the server needs (numpy, trio, h11, tokenizers, jinja2,
llguidance) and exiting, the part of a start no change of ours removes. /health is polled every 10 ms;
the server's `start-up ... ms to ready:` log line gives each part (appliance/engine/load/phases.py: for the
executable also the unpack its bootloader did before Python started). Rounds interleave the commands (a shared,
loaded machine: noise hits all alike); min and median per command and per part, the load average before and
after, and the ratios: python -m / import floor and frozen / python -m. Also the CPU time the start took (every
thread, the one-file bootloader's unpack included), which a loaded machine stretches far less than wall time.

    python bench/startup_bench.py [--model SMOLLM2.gguf] [--frozen dist/x86_64/kestrel-appliance] [--runs 7]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

FLOOR_IMPORTS = "import numpy, trio, h11, tokenizers, jinja2, llguidance"
LINE = re.compile(r"start-up (\d+) ms to ready: (.*)$")
PART = re.compile(r"([^,]+?) (\d+)(?:, |$)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            return s.recv(64).startswith(b"HTTP/1.1 200")
    except OSError:
        return False


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system, every thread) of process `pid` and its descendants so far: on a loaded machine
    the wall time to ready stretches with the load, this much less (at idle they would nearly agree: the
    start runs on one core but for the C kernels' pool)."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo += [int(c) for c in f.read().split()]
        except (OSError, ValueError, IndexError):
            pass
    return total


def parts_of(stderr: str) -> tuple[float | None, dict[str, float]]:
    """The server's start-up line: (its total, {part: ms})."""
    for line in stderr.splitlines():
        m = LINE.search(line)
        if m:
            return float(m.group(1)), {name: float(ms) for name, ms in PART.findall(m.group(2))}
    return None, {}


def start_once(cmd: list[str], env: dict, timeout: float = 120.0, nice: int = 0) -> dict:
    """Start a server from an empty directory; seconds to the first /health 200 and its start-up parts.
    nice: the niceness to start it at (negative, as root: the start gets a core as on an idle machine)."""
    work = tempfile.mkdtemp(prefix="kestrel-start-")
    os.mkdir(os.path.join(work, "tmp"))
    port = free_port()
    env = {**env, "TMPDIR": os.path.join(work, "tmp")}
    t0 = time.monotonic()
    proc = subprocess.Popen([*cmd, "--port", str(port)], cwd=work, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=(lambda: os.nice(nice)) if nice else None)
    try:
        while not healthy(port):
            if proc.poll() is not None or time.monotonic() - t0 > timeout:
                raise RuntimeError(f"{cmd[0]} did not become healthy: {proc.communicate()[1][-2000:]}")
            time.sleep(0.01)
        ready = time.monotonic() - t0
        cpu = cpu_seconds(proc.pid)
        proc.terminate()
        err = proc.communicate(timeout=60)[1]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.communicate()
        shutil.rmtree(work, ignore_errors=True)
    total, parts = parts_of(err)
    return {"ready_s": ready, "cpu_s": cpu, "logged_ms": total, "parts": parts}


def floor_once(python: str, env: dict, nice: int = 0) -> dict:
    t0 = time.monotonic()
    r0 = os.times()
    subprocess.run([python, "-c", FLOOR_IMPORTS], check=True, cwd=tempfile.gettempdir(), env=env,
                   preexec_fn=(lambda: os.nice(nice)) if nice else None)
    r1 = os.times()
    cpu = (r1.children_user - r0.children_user) + (r1.children_system - r0.children_system)
    return {"ready_s": time.monotonic() - t0, "cpu_s": cpu, "logged_ms": None, "parts": {}}


def summary(runs: list[dict]) -> dict:
    s = [r["ready_s"] for r in runs]
    cpu = [r["cpu_s"] for r in runs]
    names = list(dict.fromkeys(n for r in runs for n in r["parts"]))
    parts = {n: (min(r["parts"].get(n, 0.0) for r in runs), statistics.median(r["parts"].get(n, 0.0) for r in runs))
             for n in names}
    return {"min_s": min(s), "median_s": statistics.median(s), "runs_s": s, "cpu_min_s": min(cpu),
            "cpu_median_s": statistics.median(cpu), "parts_ms": parts}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="model path (default: SmolLM2-135M-Instruct Q4_1, scripts/fetch_smollm2.py)")
    ap.add_argument("--frozen", help="the one-file executable to time as well")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--nice", type=int, default=0,
                    help="niceness of the timed starts (-20 as root: each start gets a core as on an idle machine, "
                         "the closest a shared machine comes to an idle figure)")
    ap.add_argument("--json", help="write the figures here too")
    args = ap.parse_args(argv)
    if args.model is None:
        sys.path.insert(0, os.path.join(ROOT, "scripts"))
        from fetch_smollm2 import fetch
        args.model = fetch()
    model = os.path.abspath(args.model)
    # compiled modules cached as an installed package has them (outside the tree), whatever the caller's
    # PYTHONDONTWRITEBYTECODE says: compiling ~80 modules from source is not part of a start
    pycache = os.path.join(tempfile.gettempdir(), "kestrel-startup-bench-pycache")
    dev_env = {**{k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}, "PYTHONPATH": ROOT,
               "PYTHONPYCACHEPREFIX": pycache}
    commands = {"python -m": ([sys.executable, "-m", "appliance", "--model", model], dev_env)}
    if args.frozen:
        exe = os.path.abspath(args.frozen)
        commands["frozen"] = ([exe, "--model", model], {"PATH": "/usr/bin:/bin", "HOME": tempfile.gettempdir(),
                                                         "LANG": "C.UTF-8"})
    floor_once(sys.executable, dev_env)
    for cmd, env in commands.values():  # page cache and compiled modules warm: every timed start is a warm one
        start_once(cmd, env)
    load_before = os.getloadavg()
    results: dict[str, list[dict]] = {name: [] for name in ["import floor", *commands]}
    for i in range(args.runs):
        results["import floor"].append(floor_once(sys.executable, dev_env, args.nice))
        for name, (cmd, env) in commands.items():
            results[name].append(start_once(cmd, env, nice=args.nice))
        print(f"round {i + 1}/{args.runs}: " + ", ".join(f"{n} {r[-1]['ready_s']:.2f} s" for n, r in results.items())
              + f" (load {os.getloadavg()[0]:.1f})", file=sys.stderr, flush=True)
    load_after = os.getloadavg()
    out = {name: summary(runs) for name, runs in results.items()}
    print(f"\ntime to first /health 200 from an empty directory, {args.runs} interleaved rounds; model "
          f"{os.path.basename(model)}; load average {load_before[0]:.1f} before, {load_after[0]:.1f} after "
          f"(2 cores, shared){f'; niceness {args.nice}' if args.nice else ''}")
    print(f"{'command':<14}{'min s':>8}{'median s':>10}{'CPU min s':>11}{'CPU median s':>14}")
    for name, s in out.items():
        print(f"{name:<14}{s['min_s']:>8.2f}{s['median_s']:>10.2f}{s['cpu_min_s']:>11.2f}{s['cpu_median_s']:>14.2f}")
    base, floor = out["python -m"], out["import floor"]
    print(f"ratio python -m / import floor: {base['min_s'] / floor['min_s']:.2f} (min), "
          f"{base['median_s'] / floor['median_s']:.2f} (median)")
    if "frozen" in out:
        fr = out["frozen"]
        print(f"ratio frozen / python -m: {fr['min_s'] / base['min_s']:.2f} (min), "
              f"{fr['median_s'] / base['median_s']:.2f} (median)")
    for name in commands:
        print(f"\n{name}: parts of the start (ms, min / median; the server's own log line)")
        for part, (lo, med) in out[name]["parts_ms"].items():
            print(f"  {part:<34}{lo:>7.0f}{med:>8.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": model, "runs": args.runs, "nice": args.nice, "load_before": load_before,
                       "load_after": load_after,
                       "results": out, "when": time.time()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
