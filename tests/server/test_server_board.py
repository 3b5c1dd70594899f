"""X-Kestrel-Board (--board-name) on every response the server writes: the application's JSON, its errors, SSE and
Ollama streams, the queue's 429, and the HTTP layer's own errors (431, a request line that is not HTTP), checked
on the wire; the CLI's default (the host name) and its refusal of a name that is no header value."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading

import pytest

from tests.support.live_server import LiveServer, RawClient, chat_body, request_bytes

BOARD = "board-7.local"
LINE = b"X-Kestrel-Board: board-7.local\r\n"
CHUNKED_END = LINE + b"Transfer-Encoding: chunked\r\n\r\n"   # a stream's head: h11 adds the framing after ours


@pytest.fixture(scope="module")
def server(tiny_qwen3_tied):
    with LiveServer(tiny_qwen3_tied, queue=0, api_keys=("k",), max_header=4096, board_name=BOARD) as s:
        yield s


AUTH = {"Authorization": "Bearer k"}


def head_of(server, raw: bytes) -> bytes:
    c = RawClient(server.port, timeout=30)
    c.send(raw)
    r = c.read_head()
    c.read_body(r)
    c.close()
    return r.head


def test_health_head_byte_for_byte(server):
    c = RawClient(server.port)
    c.send(request_bytes("GET", "/health"))
    r = c.read_head()
    body = c.read_body(r)
    c.close()
    assert r.head == (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                      b"Content-Length: " + str(len(body)).encode() + b"\r\nVary: Origin\r\n" + LINE + b"\r\n")


@pytest.mark.parametrize("raw,status", [
    (request_bytes("GET", "/nothing", headers=AUTH), 404),
    (request_bytes("POST", "/v1/chat/completions", chat_body()), 401),
    (request_bytes("POST", "/v1/chat/completions", b"{not json", headers=AUTH), 400),
    (request_bytes("POST", "/api/chat", b"{}", headers=AUTH), 400),                      # Ollama's error shape
    (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 6000 + b"\r\n\r\n", 431),  # the HTTP layer's own
    (b"HELLO THERE\r\n\r\n", 400),
])
def test_errors_name_the_board(server, raw, status):
    head = head_of(server, raw)
    assert head.startswith(b"HTTP/1.1 %d " % status) and head.endswith(LINE + b"\r\n"), head


def test_streams_and_the_queue_429_name_the_board(server):
    sse = chat_body(stream=True, max_tokens=400, ignore_eos=True)
    c = RawClient(server.port, timeout=60)
    c.send(request_bytes("POST", "/v1/chat/completions", sse, headers=AUTH))
    r = c.read_head()
    c.read_events(r, stop_after=2)
    assert r.status == 200 and r.head.endswith(CHUNKED_END) and b"text/event-stream" in r.head
    # the one generation is running and --queue 0: the next request is a 429, which names the board too
    head = head_of(server, request_bytes("POST", "/v1/chat/completions", chat_body(max_tokens=2), headers=AUTH))
    assert head.startswith(b"HTTP/1.1 429 ") and b"Retry-After" in head and head.endswith(LINE + b"\r\n")
    c.close()
    server.wait_for(lambda: not server.worker.busy, what="the cancelled stream to end")
    ndjson = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "options": {"num_predict": 3}}
    head = head_of(server, request_bytes("POST", "/api/chat", ndjson, headers=AUTH))
    assert head.startswith(b"HTTP/1.1 200 ") and b"application/x-ndjson" in head and head.endswith(CHUNKED_END)


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "appliance", *args], capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.parametrize("name,why", [("two words", "visible ASCII"), ("x" * 65, "longer than 64"),
                                      ("", "is empty"), ("caf\u00e9", "visible ASCII")])
def test_a_board_name_that_is_no_header_value_is_refused(tiny_qwen3_tied, name, why):
    r = cli("--model", tiny_qwen3_tied, "--board-name", name)
    assert r.returncode == 2 and why in r.stderr and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("kestrel-appliance: error: --board-name")


def test_the_default_board_name_is_the_host_name(tiny_qwen3_tied, cli_server):
    proc, port = cli_server(tiny_qwen3_tied)
    threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
    c = RawClient(port)
    c.send(request_bytes("GET", "/health"))
    r = c.read_head()
    c.read_body(r)
    c.close()
    assert r.header("X-Kestrel-Board") == socket.gethostname()[:64] and json.loads(r.raw_body)["status"] == "ok"
