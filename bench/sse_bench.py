"""What the HTTP/SSE layer adds on top of the engine, seen by a client over a real socket.

The server runs as a real subprocess (`python -m appliance`), the client is a raw socket that timestamps
every read. The peer for each figure is the engine's own timing of the same request (the metrics event),
measured in the same run:
- first event: request sent -> role frame arrives, against the engine's time to first token (ttft_ms);
  the role frame goes out before queueing and prefill, so this ratio is far below 1.
- per-token gap: the client-observed time between the first and the last token event, per token, against the
  engine's mean decode step (tpot_ms); the ratio is the SSE overhead factor (1.0 = none).
- cancellation: client closes the socket mid-decode (and mid-prefill) -> the engine is idle again (polled
  on /health over a keep-alive connection), against one decode step (one prefill chunk).

Usage: python -m bench.sse_bench [--model DIR] [--runs 5] [--tokens 64] [--prefill-chunk 16]
Without --model a tiny random Qwen3 (real tokenizer) is built in a temporary directory.
Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import socket
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def post(port: int, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(data) + data)
    return s


def get(port: int, path: str, sock: socket.socket | None = None) -> tuple[int, bytes]:
    s = sock or socket.create_connection(("127.0.0.1", port))
    s.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
    buf = b""
    while b"\r\n\r\n" not in buf:
        buf += s.recv(65536)
    head, rest = buf.split(b"\r\n\r\n", 1)
    n = int(re.search(rb"Content-Length: (\d+)", head).group(1))
    while len(rest) < n:
        rest += s.recv(65536)
    if sock is None:
        s.close()
    return int(head.split()[1]), rest[:n]


def events(s: socket.socket, t0: float, stop_after_tokens: int | None = None):
    """Yield (ms since t0 of the read that brought it, parsed event or '[DONE]'); chunked framing is stripped
    loosely (event payloads never contain CRLF). Bytes that came with the head are events too."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        buf += s.recv(65536)
    now = (time.perf_counter() - t0) * 1000.0
    head, buf = buf.split(b"\r\n\r\n", 1)
    if not head.startswith(b"HTTP/1.1 200 "):
        raise RuntimeError(f"request failed: {head.decode()} {buf[:300]!r}")
    tokens = 0
    while True:
        while b"\n\n" in buf:  # what already arrived (with the head, or in the last read) first
            raw, buf = buf.split(b"\n\n", 1)
            line = raw[raw.find(b"data: "):] if b"data: " in raw else b""
            if not line:
                continue
            payload = line[6:]
            if payload == b"[DONE]":
                yield now, "[DONE]"
                return
            ev = json.loads(payload)
            yield now, ev
            if ev.get("object") == "chat.completion.chunk" and ev["choices"] and \
                    ev["choices"][0]["delta"].get("content"):
                tokens += 1
                if stop_after_tokens is not None and tokens >= stop_after_tokens:
                    return
        data = s.recv(65536)
        now = (time.perf_counter() - t0) * 1000.0
        if not data:
            return
        buf += data


def stream_run(port: int, n_tokens: int, prompt: str = "Tell me a story.") -> dict:
    body = {"messages": [{"role": "user", "content": prompt}], "stream": True, "max_tokens": n_tokens,
            "ignore_eos": True, "stream_options": {"include_metrics": True}}
    t0 = time.perf_counter()
    s = post(port, body)
    role_ms, token_times, metrics = None, [], None
    for t, ev in events(s, t0):
        if ev == "[DONE]":
            break
        if ev.get("object") == "chat.completion.metrics":
            metrics = ev["metrics"]
        elif ev["choices"] and "role" in ev["choices"][0]["delta"]:
            role_ms = t
        elif ev["choices"] and ev["choices"][0]["delta"].get("content"):
            token_times.append(t)
    s.close()
    gaps = [b - a for a, b in zip(token_times, token_times[1:])] or [math.nan]
    per_token = (token_times[-1] - token_times[0]) / (len(token_times) - 1) if len(token_times) > 1 else math.nan
    return {"role_ms": role_ms, "events": len(token_times), "client_ms_per_token": per_token,
            "median_gap_ms": statistics.median(gaps), "engine_ttft_ms": metrics["ttft_ms"],
            "engine_tpot_ms": metrics["tpot_ms"], "prefill_ms": metrics["prefill_ms"],
            "prompt_tokens": metrics["prompt_tokens"]}


def time_to_idle(port: int, sock: socket.socket, t_close: float) -> float:
    while True:
        _, body = get(port, "/health", sock)
        if not json.loads(body)["busy"]:
            return (time.perf_counter() - t_close) * 1000.0


def cancel_decode(port: int, health: socket.socket) -> float:
    body = {"messages": [{"role": "user", "content": "Go on."}], "stream": True, "max_tokens": 3000,
            "ignore_eos": True}
    t0 = time.perf_counter()
    s = post(port, body)
    for _ in events(s, t0, stop_after_tokens=5):
        pass
    t_close = time.perf_counter()
    s.close()
    return time_to_idle(port, health, t_close)


def cancel_prefill(port: int, health: socket.socket, prompt: str, after_s: float) -> float:
    body = {"messages": [{"role": "user", "content": prompt}], "stream": True, "max_tokens": 5}
    s = post(port, body)
    time.sleep(after_s)
    _, h = get(port, "/health", health)
    assert json.loads(h)["busy"], "prefill already over; use a longer prompt"
    t_close = time.perf_counter()
    s.close()
    return time_to_idle(port, health, t_close)


def progress(msg: str) -> None:
    print(f"[sse_bench] {msg}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prefill-chunk", type=int, default=16)
    args = ap.parse_args(argv)
    tmp = None
    model = args.model
    if model is None:
        sys.path.insert(0, ROOT)
        from tests.support.tiny_models import build_qwen3
        tmp = tempfile.TemporaryDirectory()
        model = build_qwen3(os.path.join(tmp.name, "tiny-qwen3"))
    sys.path.insert(0, ROOT)
    from tests.support.live_server import start_cli_server
    proc, port = start_cli_server(model, "--prefill-chunk", str(args.prefill_chunk), cwd=ROOT)
    try:
        stream_run(port, 8)  # warm-up
        runs = [stream_run(port, args.tokens) for _ in range(args.runs)]
        progress("streams done")
        long_prompt = " ".join(f"word{i % 97} river{i % 13}" for i in range(400))
        full = stream_run(port, 2, long_prompt)
        chunk_ms = full["prefill_ms"] / math.ceil(full["prompt_tokens"] / args.prefill_chunk)
        health = socket.create_connection(("127.0.0.1", port))
        dec = [cancel_decode(port, health) for _ in range(args.runs)]
        progress("decode cancels done")
        # each cancelled prompt starts differently: with the same one the prefix cache would leave nothing to prefill
        pre = [cancel_prefill(port, health, f"Run {i}. " + long_prompt, min(0.3, full["prefill_ms"] / 4000.0))
               for i in range(args.runs)]
        health.close()
    finally:
        proc.terminate()
        proc.wait(30)
        if tmp is not None:
            tmp.cleanup()

    def med(key):
        return statistics.median(r[key] for r in runs)

    tpot = med("engine_tpot_ms")
    out = {
        "model": os.path.basename(model.rstrip("/")), "runs": args.runs, "tokens": args.tokens,
        "first_event_ms": round(med("role_ms"), 2),
        "engine_ttft_ms": round(med("engine_ttft_ms"), 2),
        "first_event_over_ttft": round(med("role_ms") / med("engine_ttft_ms"), 3),
        "client_ms_per_token": round(med("client_ms_per_token"), 3),
        "client_median_gap_ms": round(med("median_gap_ms"), 3),
        "engine_tpot_ms": round(tpot, 3),
        "sse_overhead_ms_per_token": round(med("client_ms_per_token") - tpot, 3),
        "client_gap_over_engine_tpot": round(med("client_ms_per_token") / tpot, 3),
        "events_per_run": med("events"),
        "cancel_decode_ms": round(statistics.median(dec), 2),
        "cancel_decode_over_tpot": round(statistics.median(dec) / tpot, 2),
        "first_event_ms_long_prompt": round(full["role_ms"], 2),
        "engine_ttft_ms_long_prompt": round(full["engine_ttft_ms"], 2),
        "first_event_over_ttft_long_prompt": round(full["role_ms"] / full["engine_ttft_ms"], 4),
        "prefill_chunk_ms": round(chunk_ms, 2),
        "prefill_prompt_tokens": full["prompt_tokens"],
        "cancel_prefill_ms": round(statistics.median(pre), 2),
        "cancel_prefill_over_chunk": round(statistics.median(pre) / chunk_ms, 2),
    }
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
