"""Decode speed when the appliance does not have the cores to itself (a kiosk runs a browser beside it): decode
tok/s with and without one competing busy process, ours vs llama.cpp (bench/peer.py) under the same condition,
interleaved run by run in one process pair.

    python bench/contention_bench.py [--model FILE.gguf] [--threads 2] [--runs 5] [--decode 64]

Prints one row per condition: median decode tok/s of each, the ratio ours/llama.cpp, and what each keeps of its
idle speed. The figure that matters is the ratio under contention: a pool that spins for its workers collapses
there (its threads burn the time slices the descheduled worker needs); ours spins briefly, then sleeps.
The machine's load average is printed with each row (shared machines: compare rows of one run only).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import peer
from gguf_bench import Ours, interleaved, side_by_side


def busy_process() -> subprocess.Popen:
    """One process that wants a whole core (a browser's main thread, say)."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF file (default: SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.model is None:
        from tests.support.gguf_files import fetch_smollm2
        args.model = fetch_smollm2()
    ours = Ours(args.model, args.prompt, args.decode)
    rows = []
    with side_by_side(ours, peer, args.threads) as theirs:
        for condition in ("idle", "one busy process"):
            hog = busy_process() if condition != "idle" else None
            try:
                load = os.getloadavg()[0]
                measured = interleaved(ours, theirs, args.runs)
                o, t = measured["ours_dec"], measured["llama_dec"]
            finally:
                if hog is not None:
                    hog.kill()
                    hog.wait()
            rows.append({"condition": condition, "threads": args.threads, "ours_dec": statistics.median(o),
                         "llama_dec": statistics.median(t), "load": load, "runs": {"ours": o, "llama": t}})
    idle = rows[0]
    print(f"{'condition':<18}{'thr':>4}{'ours tok/s':>12}{'llama tok/s':>13}{'ratio':>7}{'ours kept':>11}"
          f"{'llama kept':>12}{'load':>6}")
    for r in rows:
        r["ratio"] = r["ours_dec"] / r["llama_dec"]
        r["ours_kept"], r["llama_kept"] = r["ours_dec"] / idle["ours_dec"], r["llama_dec"] / idle["llama_dec"]
        print(f"{r['condition']:<18}{r['threads']:>4}{r['ours_dec']:>12.1f}{r['llama_dec']:>13.1f}{r['ratio']:>7.2f}"
              f"{r['ours_kept']:>11.0%}{r['llama_kept']:>12.0%}{r['load']:>6.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": os.path.basename(args.model), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
