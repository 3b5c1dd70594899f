"""Streams as real clients and proxies see them: `curl -N`, and a real nginx (Debian package) reverse proxy
with its default buffering, started by the test on loopback.

"One by one" is measured as arrival batches: the client timestamps every read, and events that arrive in
the same read share a timestamp. Through a buffering proxy, events arrive in a few large batches; that is
shown by a control location that makes nginx ignore our `X-Accel-Buffering: no`.
"""
from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from tests.support.live_server import LiveServer, RawClient, chat_body, request_bytes
from tests.support.nginx import Nginx, free_port

N_TOKENS = 60


@pytest.fixture(scope="module")
def server(tiny_qwen3_tied):
    with LiveServer(tiny_qwen3_tied) as s:
        yield s


@pytest.fixture(scope="module")
def nginx(server, tmp_path_factory):
    port = free_port()
    up = f"http://127.0.0.1:{server.port}"
    http = f"""
    server {{
        listen 127.0.0.1:{port};
        location / {{ proxy_pass {up}; }}
        location /buffered/ {{ proxy_pass {up}/; proxy_ignore_headers X-Accel-Buffering; }}
    }}
"""
    with Nginx(str(tmp_path_factory.mktemp("nginx")), http, port):
        yield port


def body(**extra) -> dict:
    return chat_body("Tell me a story.", stream=True, max_tokens=N_TOKENS, ignore_eos=True, **extra)


def stream_via(port: int, path: str = "/v1/chat/completions"):
    c = RawClient(port)
    c.send(request_bytes("POST", path, body()))
    r = c.read_head()
    c.read_events(r)
    c.close()
    return r


def batches(times: list[float]) -> int:
    return len(set(times))


def check_stream(events: list[bytes]) -> None:
    assert events[-1] == b"data: [DONE]\n\n"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_curl_n_gets_events_one_by_one(server):
    proc = subprocess.Popen(["curl", "-sN", "-X", "POST", f"{server.url}/v1/chat/completions",
                             "-H", "Content-Type: application/json", "-d", json.dumps(body())],
                            stdout=subprocess.PIPE)
    arrivals, buf = [], b""
    while True:
        data = os.read(proc.stdout.fileno(), 65536)
        if not data:
            break
        now = time.perf_counter()
        buf += data
        while b"\n\n" in buf:
            ev, buf = buf.split(b"\n\n", 1)
            arrivals.append((now, ev + b"\n\n"))
    assert proc.wait(30) == 0 and buf == b""
    events = [e for _, e in arrivals]
    check_stream(events)
    assert len(events) >= N_TOKENS // 2
    assert batches([t for t, _ in arrivals]) >= 0.5 * len(events)


def test_nginx_default_buffering_still_streams_event_by_event(server, nginx):
    r = stream_via(nginx)
    assert r.status == 200 and r.header("Content-Type") == "text/event-stream; charset=utf-8"
    events = [e for _, e in r.events]
    check_stream(events)
    assert batches([t for t, _ in r.events]) >= 0.5 * len(events)

    # control: the same nginx told to ignore X-Accel-Buffering delivers the stream in a few lumps
    ctl = stream_via(nginx, "/buffered/v1/chat/completions")
    check_stream([e for _, e in ctl.events])
    assert batches([t for t, _ in ctl.events]) <= 0.25 * len(ctl.events)
