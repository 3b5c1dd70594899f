"""Disconnects and the queue on the Ollama API and the Responses API: the same engine-side checks as
tests/server/test_server_cancel.py (the worker's JobTrace), and each API's own shape for the queue's 429 and for
what a queued stream receives."""
from __future__ import annotations

import json

import pytest

from tests.support.live_server import LiveServer, RawClient, request_bytes


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


def open_responses(server, body) -> tuple[RawClient, object]:
    c = RawClient(server.port)
    c.send(request_bytes("POST", "/v1/responses", {**body, "stream": True}))
    r = c.read_head()
    assert r.status == 200 and r.header("content-type").startswith("text/event-stream")
    return c, r


def deltas(r) -> int:
    return sum(1 for _, e in r.events if e.startswith(b"event: response.output_text.delta"))


# (path, long-running stream body, "enough tokens seen" on the received events, non-stream body)
APIS = {
    "ollama": ("/api/chat", ollama_body("Tell me a story.", options={"num_predict": 2000}),
               lambda r: sum(1 for x in lines(r) if x["message"]["content"]) >= 5,
               {"model": "t", "prompt": "Hello", "stream": False, "options": {"num_predict": 2000}}, "/api/generate"),
    "responses": ("/v1/responses", responses_body("Tell me a story.", max_output_tokens=2000, stream=True),
                  lambda r: deltas(r) >= 5, responses_body("Hello", max_output_tokens=2000), "/v1/responses"),
}


@pytest.mark.parametrize("api", APIS)
def test_disconnect_mid_decode_stops_within_one_step(server, api):
    path, body, enough, _, _ = APIS[api]
    n_before = len(server.traces())
    a = RawClient(server.port)
    a.send(request_bytes("POST", path, body))
    ra = a.read_head()
    assert ra.status == 200
    a.read_events(ra, until=enough)
    a.close()
    t = finished_trace(server, n_before)
    assert t.finish_reason == "cancelled" and 5 <= t.tokens < 2000
    assert t.tokens_after_cancel <= 1 and t.polls_after_cancel == 1


@pytest.mark.parametrize("api", APIS)
def test_non_stream_disconnect(server, api):
    _, _, _, body, path = APIS[api]
    n_before = len(server.traces())
    c = RawClient(server.port)
    c.send(request_bytes("POST", path, body))
    server.wait_for(lambda: server.worker.current is not None and server.worker.current.tokens >= 3,
                    what="decode to be under way")
    c.close()
    t = finished_trace(server, n_before)
    assert t.finish_reason == "cancelled" and t.tokens_after_cancel <= 1 and t.polls_after_cancel == 1


def rejected(server, path: str, body: dict) -> dict:
    """A request sent while the queue is full: 429 with Retry-After; its JSON body."""
    d = RawClient(server.port)
    d.send(request_bytes("POST", path, body))
    rd = d.read_head()
    out = json.loads(d.read_body(rd))
    d.close()
    assert rd.status == 429 and int(rd.header("Retry-After")) >= 1
    return out


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
    body = rejected(server, "/api/chat", ollama_body("Third"))
    assert set(body) == {"error"} and "busy" in body["error"]
    a.close()
    b.read_events(rb)
    b.close()
    got = lines(rb)
    assert got[-1]["done"] is True and got[-1]["done_reason"] == "length" and got[-1]["eval_count"] == 2
    assert server.worker.stats.requests_started == started + 2


def test_responses_queue_comments_and_429(server):
    a, ra = open_responses(server, responses_body("Running", max_output_tokens=2000))
    a.read_events(ra, until=lambda r: deltas(r) >= 2)
    b, rb = open_responses(server, responses_body("Waiting", max_output_tokens=16))
    # response.created and response.in_progress come at once; then `: queued` comments while in line
    b.read_events(rb, until=lambda r: any(e == b": queued\n\n" for _, e in r.events))
    assert [e.split(b"\n", 1)[0] for _, e in rb.events[:2]] == [b"event: response.created",
                                                                b"event: response.in_progress"]
    assert server.worker.waiting == 1
    body = rejected(server, "/v1/responses", responses_body("Third"))
    assert body["error"]["type"] == "rate_limit_error" and body["error"]["code"] == "queue_full"
    a.close()
    b.read_events(rb)
    b.close()
    last = json.loads(rb.events[-1][1].split(b"\ndata: ", 1)[1])
    assert last["type"] == "response.incomplete" and last["response"]["usage"]["output_tokens"] == 16


def test_random_bodies_over_the_wire_get_200_or_a_4xx_in_each_apis_shape(server):
    """The fuzz tests' random bodies, sent to every new endpoint over real sockets: each answer is a 200 (a
    stream we then drop, which cancels it) or a 4xx in that API's error shape; the server keeps serving."""
    import random

    from tests.protocol.test_protocol_fuzz import ollama_mutate, responses_mutate
    rng = random.Random(7)
    seen: dict[int, int] = {}
    for i in range(90):
        path, body = [("/api/chat", ollama_mutate), ("/api/generate", ollama_mutate),
                      ("/v1/responses", responses_mutate), ("/api/show", ollama_mutate)][i % 4]
        payload = json.dumps(body(rng)).encode()
        c = RawClient(server.port, timeout=30)
        c.send(request_bytes("POST", path, payload))
        r = c.read_head()
        seen[r.status] = seen.get(r.status, 0) + 1
        if r.status != 200:
            err = json.loads(c.read_body(r))["error"]
            assert 400 <= r.status < 500, (path, payload, err)
            assert isinstance(err, str) if path.startswith("/api/") else set(err) == {"message", "type", "param", "code"}
        c.close()
        server.wait_for(lambda: not server.worker.busy and server.worker.waiting == 0, what="the engine to idle")
    assert seen.get(200, 0) > 0 and sum(n for s, n in seen.items() if s >= 400) > 0
    c = RawClient(server.port)
    c.send(request_bytes("GET", "/health"))
    assert c.read_head().status == 200
    c.close()
