"""What writing a prompt prefix to disk (--prompt-cache-dir) costs the next, unrelated request.

Each round sends two requests that share a new ~3,500-token system prompt (the second one makes the server
save that prefix: ~78 MB for SmolLM2-135M at f16) and right after the second response an unrelated 1-token
request, timed by the client. The same rounds run, interleaved, against a second server without
--prompt-cache-dir (no write at all): the ratio of the two medians is what the write adds (1.0 = nothing).
The unrelated request's own log line (`queued ... ms, ttft ... ms`) is printed too: it should account for
any wait.

Usage: python bench/prompt_disk_stall.py [--model PATH] [--rounds 8] [--prefix-lines 300]
Without --model the SmolLM2-135M Q4_1 GGUF of the tests (tests/support/gguf_files.py). Prints one JSON object.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests.support.live_server import start_cli_server


def chat(port: int, system: str, user: str, max_tokens: int) -> tuple[float, dict]:
    body = json.dumps({"model": "m", "messages": [{"role": "system", "content": system},
                                                   {"role": "user", "content": user}],
                       "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}).encode()
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    t0 = time.perf_counter()
    c.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    data = json.loads(r.read())
    dt = (time.perf_counter() - t0) * 1000.0
    c.close()
    assert r.status == 200, data
    return dt, data


class Server:
    """One CLI server process (with or without --prompt-cache-dir) and what its rounds measured."""

    def __init__(self, model: str, cache_dir: str | None):
        self.cache_dir = cache_dir
        extra = ["--ctx", "4096", "--queue", "4"] + (["--prompt-cache-dir", cache_dir] if cache_dir else [])
        self.proc, self.port = start_cli_server(model, *extra, stdout=subprocess.DEVNULL)
        chat(self.port, "Be brief.", "Hi.", 1)  # first request: pages, tables
        self.after: list[float] = []

    def round(self, r: int, lines: int) -> None:
        system = f"Round {r} of the house. " + " ".join(f"light.room_{r}_{i} is on." for i in range(lines))
        chat(self.port, system, "Turn on the kitchen light.", 1)
        _, second = chat(self.port, system, "Is the hall light on?", 1)  # the prefix both share is saved now
        ms, _ = chat(self.port, "Be brief.", f"Say {r}.", 1)
        self.after.append(ms)
        self.shared = second["usage"]["prompt_tokens"]

    def stop(self) -> dict:
        self.proc.kill()
        self.proc.wait()
        log = self.proc.stderr.read()
        self.proc.stderr.close()
        # the server's own log line of each unrelated request (short prompts; the first one is the warm-up)
        own = [f"queued {q} ms, ttft {t} ms" for p, q, t in re.findall(r"prompt (\d+) \(\d+ reused\).*queued (\d+) "
                                                                     r"ms, ttft (\d+) ms", log) if int(p) < 100][1:]
        files = sorted(n for n in os.listdir(self.cache_dir) if n.endswith(".kvc")) if self.cache_dir else []
        return {"unrelated_ms": [round(x, 1) for x in self.after], "median_ms": round(statistics.median(self.after), 1),
                "its_log_lines": own, "shared_prompt_tokens": self.shared,
                "files_mb": [round(os.path.getsize(os.path.join(self.cache_dir, f)) / 2**20, 1) for f in files]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--prefix-lines", type=int, default=300)
    args = ap.parse_args(argv)
    if args.model is None:
        from tests.support.gguf_files import fetch_smollm2
        args.model = fetch_smollm2()
    with tempfile.TemporaryDirectory() as d:
        load0 = os.getloadavg()[0]
        servers = [Server(args.model, None), Server(args.model, os.path.join(d, "cache"))]
        try:
            for r in range(args.rounds):  # interleaved, so both see the same machine load
                for s in servers:
                    s.round(r, args.prefix_lines)
        finally:
            without, with_disk = [s.stop() for s in servers]
        out = {"model": os.path.basename(args.model), "load_average": [round(load0, 1), round(os.getloadavg()[0], 1)],
               "without_prompt_cache_dir": without, "with_prompt_cache_dir": with_disk,
               "ratio": round(with_disk["median_ms"] / without["median_ms"], 2)}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
