"""Disconnects and the queue on the Ollama API and the Responses API: the same engine-side checks as
tests/test_server_cancel.py (the worker's JobTrace), and each API's own shape for the queue's 429 and for
what a queued stream receives."""
from __future__ import annotations

import json

import pytest

from tests.support.live_server import LiveServer, RawClient, chat_body, request_bytes


@pytest.fixture(scope="module")
def server(tiny_qwen3_tied):
    with LiveServer(tiny_qwen3_tied, queue=1, prefill_chunk=16, queue_keepalive_s=0.01) as s:
        yield s


def ollama_body(content: str, **extra) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], **extra}


def responses_body(content: str, **extra) -> dict:
    return {"model": "tiny", "input": content, **extra}


def lines(r) -> list[dict]:
    """NDJSON lines received so far (RawClient splits on blank lines, so split the raw text here)."""
    text = b"".join(e for _, e in r.events) + r._text
    return [json.loads(x) for x in text.split(b"\n") if x.strip()]


def open_ollama(server, body) -> tuple[RawClient, object]:
    c = RawClient(server.port)
    c.send(request_bytes("POST", "/api/chat", body))
    r = c.read_head()
    assert r.status == 200 and r.header("content-type") == "application/x-ndjson"
    return c, r


def finished_trace(server, n_before: int, index: int = 0):
    server.wait_for(lambda: len(server.traces()) > n_before + index, what="the engine to finish the job")
    return server.traces()[n_before + index]


def test_ollama_disconnect_mid_decode_stops_within_one_step(server):
    n_before = len(server.traces())
    a, ra = open_ollama(server, ollama_body("Tell me a story.", options={"num_predict": 2000}))
    a.read_events(ra, until=lambda r: sum(1 for x in lines(r) if x["message"]["content"]) >= 5)
    a.close()
    t = finished_trace(server, n_before)
    assert t.finish_reason == "cancelled" and 5 <= t.tokens < 2000
    assert t.tokens_after_cancel <= 1 and t.polls_after_cancel == 1


def test_ollama_non_stream_disconnect(server):
    n_before = len(server.traces())
    c = RawClient(server.port)
    c.send(request_bytes("POST", "/api/generate", {"model": "t", "prompt": "Hello", "stream": False,
                                                    "options": {"num_predict": 2000}}))
    server.wait_for(lambda: server.worker.current is not None and server.worker.current.tokens >= 3,
                    what="decode to be under way")
    c.close()
    t = finished_trace(server, n_before)
    assert t.finish_reason == "cancelled" and t.tokens_after_cancel <= 1 and t.polls_after_cancel == 1


def test_ollama_queue_lines_and_429(server):
    started = server.worker.stats.requests_started
    a, ra = open_ollama(server, ollama_body("Running", options={"num_predict": 2000}))
    a.read_events(ra, until=lambda r: len(lines(r)) >= 3)
    b, rb = open_ollama(server, ollama_body("Waiting", options={"num_predict": 2}))
    # while queued, a stream gets empty assistant lines (the first one before the engine is ours)
    b.read_events(rb, until=lambda r: len(lines(r)) >= 3)
    assert server.worker.waiting == 1
    assert all(x == {"model": x["model"], "created_at": x["created_at"], "done": False,
                     "message": {"role": "assistant", "content": ""}} for x in lines(rb))
    d = RawClient(server.port)
    d.send(request_bytes("POST", "/api/chat", ollama_body("Third")))
    rd = d.read_head()
    body = json.loads(d.read_body(rd))
    d.close()
    assert rd.status == 429 and int(rd.header("Retry-After")) >= 1
    assert set(body) == {"error"} and "busy" in body["error"]
    a.close()
    b.read_events(rb)
    b.close()
    got = lines(rb)
    assert got[-1]["done"] is True and got[-1]["done_reason"] == "length" and got[-1]["eval_count"] == 2
    assert server.worker.stats.requests_started == started + 2
