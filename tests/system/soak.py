#!/usr/bin/env python3
"""Soak and fuzz of the real server (worker thread + trio + h11 on loopback), the long version of the `system`
test tier (tests/system/test_system_soak.py runs the same scenarios with small counts):

    python tests/system/soak.py [--model DIR_OR_GGUF] [--disconnects 1000] [--requests 100000] [--json out.json]
                                [--mixed-minutes 30 [--mixed-threads 6] [--mixed-queue 4] [--server-log F]]

- disconnects: random mid-stream disconnects while queued, in prefill and in decode, closed with FIN or RST;
  every 25th round checks that the next request is served at once; RSS, open fds and threads are compared
  between the start (after a warm-up) and the end, each once the server counts no client connection left.
- requests: generated HTTP + JSON requests (hypothesis strategies: OpenAI chat/completions bodies with
  valid and invalid fields, plus raw request lines, headers and bodies) against the same server; every one
  must get a well-formed response below 500 within the timeout (no crash, no hang, no 5xx).
- mixed load (`--mixed-minutes M`; `--disconnects 0 --requests 0` skips the two above): M minutes of concurrent
  clients over every API with images, disconnects and queue overflows against a server process on the tiny
  Qwen3-VL checkpoint (tests/system/mixed_load.py).
Prints one JSON report; exits non-zero on any failure.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import socket
import struct
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from hypothesis import (
    HealthCheck,
    given,
    settings,
    strategies as st,
)

from tests.support.live_server import LiveServer, RawClient, chat_body, request_bytes
from tests.system.monitor import SETTLE_S, settle, usage

RESPONSE_TIMEOUT_S = 30.0
LONG_PROMPT = " ".join(f"word{i % 97}" for i in range(900))


def close(c: RawClient, rst: bool) -> None:
    if rst:  # SO_LINGER 0: the close sends a reset instead of a FIN
        c.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    c.close()


def open_stream(port: int, content: str, max_tokens: int) -> tuple[RawClient, object]:
    c = RawClient(port, timeout=RESPONSE_TIMEOUT_S)
    c.send(request_bytes("POST", "/v1/chat/completions",
                         chat_body(content, stream=True, max_tokens=max_tokens, ignore_eos=True)))
    return c, c.read_head()


def served_at_once(port: int) -> float:
    """Seconds a short non-stream request takes (the engine must be free: nothing left over)."""
    t = time.perf_counter()
    c = RawClient(port, timeout=RESPONSE_TIMEOUT_S)
    c.send(request_bytes("POST", "/v1/chat/completions", chat_body("Hi", max_tokens=2)))
    r = c.read_head()
    c.read_body(r)
    c.close()
    if r.status != 200:
        raise AssertionError(f"next request got {r.status}")
    return time.perf_counter() - t


def disconnect_round(port: int, rng: random.Random) -> str:
    phase, rst = rng.choice(["queued", "prefill", "decode"]), rng.random() < 0.5
    if phase == "decode":
        c, r = open_stream(port, "Tell a story.", 2000)
        c.read_events(r, stop_after=rng.randint(1, 6))
        close(c, rst)
    elif phase == "prefill":
        c, r = open_stream(port, LONG_PROMPT, 50)
        c.read_events(r, stop_after=1)  # the role frame goes out before prefill
        time.sleep(rng.random() * 0.02)
        close(c, rst)
    else:
        a, ra = open_stream(port, "Tell a story.", 2000)
        a.read_events(ra, stop_after=2)
        b, rb = open_stream(port, "Queued one.", 8)
        b.read_events(rb, stop_after=1)
        close(b, rst)
        close(a, rng.random() < 0.5)
    return phase + ("/rst" if rst else "/fin")


def disconnect_soak(port: int, n: int, seed: int = 16) -> dict:
    rng = random.Random(seed)
    for _ in range(min(20, n)):  # warm-up: thread caches, allocator arenas
        disconnect_round(port, rng)
    served_at_once(port)
    time.sleep(1.0)
    settle(port, SETTLE_S)
    start = usage(os.getpid())
    kinds: dict = {}
    worst_next = 0.0
    for i in range(n):
        k = disconnect_round(port, rng)
        kinds[k] = kinds.get(k, 0) + 1
        if i % 25 == 24:
            worst_next = max(worst_next, served_at_once(port))
    worst_next = max(worst_next, served_at_once(port))
    time.sleep(1.0)
    settled = settle(port, SETTLE_S)  # the last rounds' connections closed on the server's side too
    end = usage(os.getpid())
    return {"disconnects": n, "by_kind": kinds, "start": start, "end": end, "settled": settled,
            "worst_next_request_s": round(worst_next, 3)}


# ---- generated requests ---------------------------------------------------------------------------------

json_scalar = st.one_of(st.none(), st.booleans(), st.integers(-10**20, 10**20), st.floats(allow_nan=False),
                        st.text(max_size=30))
json_value = st.recursive(json_scalar, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                              st.dictionaries(st.text(max_size=10), inner, max_size=4)),
                          max_leaves=12)
content = st.one_of(st.text(max_size=60), json_value,
                    st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "x"]),
                                                    "text": st.text(max_size=20)}), max_size=3))
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "bogus"]),
                                 "content": content})
small_tokens = st.one_of(st.integers(-3, 6), json_scalar)
chat_fields = st.fixed_dictionaries(
    {"messages": st.one_of(st.lists(message, max_size=4), json_value), "max_tokens": small_tokens},
    optional={"model": json_value, "temperature": json_value, "top_p": json_value, "stream": st.booleans(),
              "stop": json_value, "n": json_value, "seed": json_value, "logprobs": json_value,
              "top_logprobs": json_value, "tools": json_value, "tool_choice": json_value,
              "response_format": json_value, "stream_options": json_value, "logit_bias": json_value,
              "presence_penalty": json_value, "chat_template_kwargs": json_value})
completion_fields = st.fixed_dictionaries(
    {"prompt": st.one_of(st.text(max_size=60), st.lists(st.integers(-5, 200000), max_size=8), json_value),
     "max_tokens": small_tokens},
    optional={"echo": json_value, "stream": st.booleans(), "temperature": json_value, "stop": json_value})
header_name = st.text(st.characters(min_codepoint=33, max_codepoint=126, exclude_characters=":"), min_size=1,
                      max_size=20)
header_value = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=40)


@st.composite
def http_request(draw) -> tuple[str, bytes]:
    """(kind, request bytes): "raw" requests may have any head; the others have a well-formed head and a body of
    the length they declare, so the server must answer them."""
    kind = draw(st.sampled_from(["chat", "chat", "completion", "raw"]))
    if kind == "raw":
        method = draw(st.sampled_from(["GET", "POST", "PUT", "DELETE", "OPTIONS", "HEAD", "PATCH", "BREW"]))
        path = draw(st.sampled_from(["/", "/health", "/metrics", "/v1/models", "/v1/models/x", "/v1/chat/completions",
                                     "/v1/completions", "/v1/../etc", "/%00", "/v1/chat/completions?x=%ff"]))
        headers = draw(st.dictionaries(header_name, header_value, max_size=4))
        body = draw(st.binary(max_size=200))
        return kind, request_bytes(method, path, body if method in ("POST", "PUT", "PATCH") else None, headers)
    fields = draw(chat_fields if kind == "chat" else completion_fields)
    if not isinstance(fields.get("max_tokens"), int) or isinstance(fields["max_tokens"], bool):
        fields["max_tokens"] = 4  # a valid request runs to the context otherwise: slow (a 'hang'), not more telling
    if draw(st.booleans()):
        body = json.dumps(fields).encode()
    else:  # the same, damaged
        raw = json.dumps(fields).encode()
        cut = draw(st.integers(0, len(raw)))
        body = raw[:cut] + draw(st.binary(max_size=8))
    return kind, request_bytes("POST", "/v1/chat/completions" if kind == "chat" else "/v1/completions", body)


def send_one(port: int, data: bytes) -> int:
    """Send a request, read the whole response (a stream to its end); the status, or raise on a hang."""
    c = RawClient(port, timeout=RESPONSE_TIMEOUT_S)
    try:
        c.send(data)
        r = c.read_head()
        if (r.header("transfer-encoding") or "").lower() == "chunked":
            c.read_events(r)
            if not r._finished:
                raise AssertionError(f"chunked body of a {r.status} did not end properly")
        elif data.startswith(b"HEAD "):
            pass
        else:
            c.read_body(r)
        return r.status
    finally:
        c.close()


def fuzz(port: int, n: int, seed: int = 16) -> dict:
    counts: dict = {}
    failures: list = []

    @settings(max_examples=n, deadline=None, database=None, derandomize=False,
              suppress_health_check=list(HealthCheck))
    @given(http_request())
    def one(request):
        kind, data = request
        try:
            status = send_one(port, data)
        except (socket.timeout, TimeoutError):
            failures.append(("hang", data[:300]))
            return
        except (ConnectionError, OSError) as e:
            if kind != "raw":  # a well-formed request closed without a response: the client learns nothing
                failures.append((f"closed:{type(e).__name__}", data[:300]))
                return
            status = f"closed:{type(e).__name__}"  # after a malformed head the server may just close
        counts[status] = counts.get(status, 0) + 1
        if isinstance(status, int) and status >= 500:
            failures.append((status, data[:300]))

    random.seed(seed)
    one()
    return {"requests": sum(counts.values()) + len(failures), "by_status": {str(k): v for k, v in counts.items()},
            "failures": [(str(k), repr(v)) for k, v in failures[:10]], "n_failures": len(failures)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model directory or GGUF (default: the tests' tiny Qwen3 checkpoint)")
    ap.add_argument("--disconnects", type=int, default=1000, help="0 skips the disconnect soak")
    ap.add_argument("--requests", type=int, default=100000, help="0 skips the generated requests")
    ap.add_argument("--mixed-minutes", type=float, default=0.0,
                    help="minutes of mixed load with images (tests/system/mixed_load.py; default 0: skipped)")
    ap.add_argument("--mixed-threads", type=int, default=6, help="concurrent clients of the mixed load")
    ap.add_argument("--mixed-queue", type=int, default=4, help="the server's --queue under the mixed load")
    ap.add_argument("--vl-model", help="Qwen3-VL directory for the mixed load (default: the tests' tiny one)")
    ap.add_argument("--server-log", default=os.devnull, help="the mixed load's server stderr goes here")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    report: dict = {}
    ok = True
    if args.disconnects or args.requests:
        ok = soak_in_process(args, report)
    if args.mixed_minutes:
        from tests.system import mixed_load
        if args.vl_model is None:
            import tempfile

            from tests.support.tiny_vl import build_qwen3_vl
            args.vl_model = build_qwen3_vl(tempfile.mkdtemp(prefix="soak-vl-"), seed=3)
        with open(args.server_log, "a") as log:
            mixed = mixed_load.run(args.vl_model, args.mixed_minutes * 60, threads=args.mixed_threads,
                                   queue=args.mixed_queue, log=log)
        mixed["problems"] = mixed_load.problems(mixed)
        report["mixed_load"] = mixed
        ok &= not mixed["problems"]
    report["seconds"] = round(time.monotonic() - t0)
    print(json.dumps(report, indent=1, default=str), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return 0 if ok else 1


def soak_in_process(args, report: dict) -> bool:
    """The disconnect soak and the generated requests against one in-process server; True when they passed."""
    if args.model is None:
        import tempfile

        from tests.support import tiny_models
        args.model = tiny_models.build_qwen3(tempfile.mkdtemp(prefix="soak-"), tie=True, kv_heads=1, seed=1)
    ok = True
    with LiveServer(args.model, queue=2, prefill_chunk=16) as server:
        if args.disconnects:
            d = report["disconnect_soak"] = disconnect_soak(server.port, args.disconnects)
            ok &= (d["end"]["rss_mb"] - d["start"]["rss_mb"] < 64 and d["end"]["fds"] <= d["start"]["fds"] + 4
                   and d["end"]["threads"] <= d["start"]["threads"] + 4 and d["settled"]["settled"])
        if args.requests:
            report["fuzz"] = fuzz(server.port, args.requests)
            ok &= report["fuzz"]["n_failures"] == 0
        report["server_alive"] = served_at_once(server.port) < RESPONSE_TIMEOUT_S
        m = server.api.metric_values()
        report["metrics"] = {k: m[k] for k in ("kestrel_cancelled_total", "kestrel_queue_abandoned_total",
                                               "kestrel_event_loop_lag_max_seconds")}
    return ok


if __name__ == "__main__":
    sys.exit(main())
