"""A fleet behind nginx (`kestrel-appliance fleet-config`): aggregate decode tokens/s and time to first token for 12
concurrent clients on 1, 2 and 3 boards, and the time to first token of a conversation's second turn with the
configuration's affinity (consistent hash of X-Session-Id) and without it (the same file with least_conn instead).

    python bench/fleet_bench.py [--model FILE.gguf] [--clients 12] [--max-tokens 32] [--queue 1] [--threads 1]

The "boards" are `kestrel-appliance` processes on this machine: they share its cores (on a 2-core machine three
boards have less than one core each), so the 2- and 3-board rows measure the proxy's spreading of the load and
the overlap of one board's prefill with another's decode, not three boards' worth of compute. Clients are the
openai client, retrying 429s after Retry-After as it does by default (`--queue 1`: six places in three boards);
TTFT counts from the first attempt. The turn-2 rows run one request at a time, so their TTFT is the prefill the
board had to do: the conversation so far (a ~400-token first message) on a cold board, the new turn on its own.
The machine's load average is printed with each row.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from appliance.fleet import FleetOptions, render  # noqa: E402
from tests.support.live_server import drain_stderr, start_cli_server  # noqa: E402
from tests.support.nginx import Nginx, free_port  # noqa: E402

LONG = ("The lighthouse keeper wrote in the log every evening: the weather, the ships that passed, the state of "
        "the lamp and the oil that remained. ")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def stream(c, messages, session: str | None, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    ttft, n, cached, board = None, 0, 0, None
    with c.chat.completions.with_streaming_response.create(
            model="any", messages=messages, stream=True, max_tokens=max_tokens, temperature=0,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            extra_headers={"X-Session-Id": session} if session else {}) as resp:
        board = resp.headers.get("x-kestrel-board")
        text = ""
        for chunk in resp.parse():
            if chunk.choices and chunk.choices[0].delta.content:
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                text += chunk.choices[0].delta.content
            if chunk.usage:
                n = chunk.usage.completion_tokens
                d = chunk.usage.prompt_tokens_details
                cached = d.cached_tokens if d else 0
    return {"ttft": ttft if ttft is not None else time.perf_counter() - t0, "tokens": n, "cached": cached,
            "board": board, "text": text, "total": time.perf_counter() - t0}


class Fleet:
    def __init__(self, model: str, n: int, queue: int, threads: int):
        self.procs, self.ports = [], []
        with ThreadPoolExecutor(n) as ex:
            for proc, port in ex.map(lambda i: start_cli_server(
                    model, "--queue", str(queue), "--threads", str(threads), "--ctx", "2048",
                    "--board-name", f"board-{i}", stdout=subprocess.DEVNULL), range(n)):
                drain_stderr(proc)
                self.procs.append(proc)
                self.ports.append(port)

    def proxy(self, d: str, boards: int, affinity: bool = True) -> Nginx:
        port = free_port()
        conf = render([f"127.0.0.1:{p}" for p in self.ports[:boards]],
                      FleetOptions(listen=f"127.0.0.1:{port}", access_log="off"))
        if not affinity:
            conf = conf.replace("hash $kestrel_conversation consistent;", "least_conn;")
        return Nginx(d, conf, port, workers=2)

    def close(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait()


def client(port: int):
    from openai import OpenAI
    return OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=100, timeout=600)


def load_row(fleet: Fleet, d: str, boards: int, clients: int, max_tokens: int) -> dict:
    with fleet.proxy(d, boards) as ng:
        c = client(ng.port)
        stream(c, [{"role": "user", "content": "Warm up."}], None, 2)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(clients) as ex:
            rs = list(ex.map(lambda i: stream(c, [{"role": "user", "content": f"Client {i}: tell me a story."}],
                                              f"load-{boards}-{i}", max_tokens), range(clients)))
        wall = time.perf_counter() - t0
    ttfts = [r["ttft"] for r in rs]
    return {"boards": boards, "clients": clients, "tok_s": sum(r["tokens"] for r in rs) / wall, "wall_s": wall,
            "ttft_p50": pct(ttfts, 0.5), "ttft_p95": pct(ttfts, 0.95), "load": os.getloadavg()[0],
            "per_board": {b: sum(r["board"] == b for r in rs) for b in sorted({r["board"] for r in rs})}}


def turn2_row(fleet: Fleet, d: str, affinity: bool, conversations: int, max_tokens: int) -> dict:
    """Every conversation's turn 1, then (in reverse order) every turn 2, one request at a time: other
    conversations' turns run between a conversation's two (people pause between turns), and no request waits for
    a place, so the time to first token is the prefill the board has to do."""
    with fleet.proxy(d, len(fleet.ports), affinity) as ng:
        c = client(ng.port)
        tag = "affinity" if affinity else "least_conn"
        msgs = {i: [{"role": "user", "content": f"Log {i} of {tag}. " + LONG * 12 + "Summarise the log."}]
                for i in range(conversations)}

        def run(i: int) -> dict:
            return stream(c, msgs[i], f"conv-{tag}-{i}", max_tokens)

        first = {i: run(i) for i in msgs}
        for i, t1 in first.items():
            msgs[i] += [{"role": "assistant", "content": t1["text"]}, {"role": "user", "content": "And the lamp?"}]
        second = {i: run(i) for i in reversed(msgs)}
    t2 = [r["ttft"] for r in second.values()]
    return {"affinity": affinity, "conversations": conversations, "turn2_ttft_p50": pct(t2, 0.5),
            "turn2_ttft_p95": pct(t2, 0.95), "turn1_ttft_p50": pct([r["ttft"] for r in first.values()], 0.5),
            "same_board": sum(first[i]["board"] == second[i]["board"] for i in first),
            "turn2_cached_mean": statistics.mean(r["cached"] for r in second.values()), "load": os.getloadavg()[0]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF file (default: SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--clients", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--queue", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--conversations", type=int, default=9)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.model is None:
        from tests.support.gguf_files import fetch_smollm2
        args.model = fetch_smollm2()
    print(f"{os.cpu_count()} cores shared by all boards and nginx; --queue {args.queue} --threads {args.threads}")
    fleet = Fleet(args.model, 3, args.queue, args.threads)
    rows = []
    try:
        with tempfile.TemporaryDirectory() as d:
            for boards in (1, 2, 3):
                r = load_row(fleet, d, boards, args.clients, args.max_tokens)
                rows.append(r)
                print(f"{boards} board(s), {args.clients} clients: {r['tok_s']:.1f} tok/s aggregate, TTFT p50 "
                      f"{r['ttft_p50'] * 1000:.0f} ms p95 {r['ttft_p95'] * 1000:.0f} ms, wall {r['wall_s']:.1f} s, "
                      f"per board {r['per_board']} (load {r['load']:.1f})", flush=True)
            for affinity in (True, False):
                r = turn2_row(fleet, d, affinity, args.conversations, 8)
                rows.append(r)
                print(f"turn 2 {'with' if affinity else 'without'} affinity: TTFT p50 {r['turn2_ttft_p50'] * 1000:.0f}"
                      f" ms p95 {r['turn2_ttft_p95'] * 1000:.0f} ms (turn 1 p50 {r['turn1_ttft_p50'] * 1000:.0f} ms),"
                      f" same board {r['same_board']}/{r['conversations']}, turn-2 cached tokens mean "
                      f"{r['turn2_cached_mean']:.0f} (load {r['load']:.1f})", flush=True)
    finally:
        fleet.close()
    one, three = rows[0], rows[2]
    with_a, without = rows[3], rows[4]
    print(f"3 boards / 1 board: {three['tok_s'] / one['tok_s']:.2f}x tok/s, TTFT p50 "
          f"{one['ttft_p50'] / three['ttft_p50']:.2f}x lower; turn-2 TTFT p50 without / with affinity: "
          f"{without['turn2_ttft_p50'] / with_a['turn2_ttft_p50']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
