"""The SSE stream byte by byte, over a real loopback socket, from the real engine on a tiny real checkpoint.

The expected token texts come from running the same engine directly (greedy, so deterministic), not from
hard-coded strings: the test checks that the server adds exactly the framing and nothing else.
"""
from __future__ import annotations

import json

import pytest

from appliance.engine.generate import FinishEvent, GenerationRequest, TokenEvent
from appliance.engine.load import load_model
from appliance.engine.sampling import SamplingParams
from tests.support.live_server import LiveServer, RawClient, chat_body, request_bytes

SSE_HEAD = (b"HTTP/1.1 200 OK\r\n"
            b"Content-Type: text/event-stream; charset=utf-8\r\n"
            b"Cache-Control: no-cache\r\n"
            b"Connection: keep-alive\r\n"
            b"X-Accel-Buffering: no\r\n"
            b"Vary: Origin\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")


@pytest.fixture(scope="module")
def server(tiny_qwen3_tied):
    with LiveServer(tiny_qwen3_tied, queue=2, queue_keepalive_s=0.1) as s:
        yield s


@pytest.fixture(scope="module")
def reference(tiny_qwen3_tied):
    """The engine run directly: what the server must stream for a greedy request."""
    loaded = load_model(tiny_qwen3_tied)

    def run(messages, max_tokens, ignore_eos=True):
        prompt = loaded.chat_template.render(messages, add_generation_prompt=True)
        ids = loaded.tokenizer.encode(prompt)
        req = GenerationRequest(prompt_ids=ids, sampling=SamplingParams(temperature=0.0), max_tokens=max_tokens,
                                ignore_eos=ignore_eos)
        events = list(loaded.engine.generate(req))
        return ids, events

    return run


def chunk_payloads(raw: bytes) -> list[bytes]:
    """The payload of every HTTP chunk of a chunked body, in order (the terminating chunk excluded)."""
    out = []
    while True:
        i = raw.index(b"\r\n")
        size = int(raw[:i], 16)
        if size == 0:
            assert raw[i:] == b"\r\n\r\n", raw[i:]
            return out
        out.append(raw[i + 2:i + 2 + size])
        assert raw[i + 2 + size:i + 4 + size] == b"\r\n"
        raw = raw[i + 4 + size:]


def stream_request(server, body, client=None):
    c = client or RawClient(server.port)
    c.send(request_bytes("POST", "/v1/chat/completions", body))
    r = c.read_head()
    c.read_events(r)
    return c, r


def test_stream_bytes_match_engine(server, reference):
    messages = [{"role": "user", "content": "Count from 1 to 20."}]
    ids, ref = reference(messages, 12)
    body = chat_body(messages[0]["content"], stream=True, max_tokens=12, temperature=0, ignore_eos=True,
                     stream_options={"include_usage": True, "include_metrics": True, "include_tokens": True})
    c, r = stream_request(server, body)
    assert r.head == SSE_HEAD

    # one HTTP chunk per event: every event is its own write, nothing is coalesced by our code
    payloads = chunk_payloads(r.raw_body)
    assert payloads == [e for _, e in r.events]
    for p in payloads:
        assert p.startswith(b"data: ") and p.endswith(b"\n\n") and p.count(b"\n\n") == 1

    events = r.json_events()
    role, rest = events[0], events[1:]
    assert role["object"] == "chat.completion.chunk"
    assert role["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None}]
    ref_tokens = [e for e in ref if isinstance(e, TokenEvent)]
    ref_finish = ref[-1]
    assert isinstance(ref_finish, FinishEvent) and ref_finish.reason == "length"
    texted = [e.text for e in ref_tokens if e.text]
    n = len(texted)
    token_chunks = rest[:n]
    assert [ch["choices"][0]["delta"] for ch in token_chunks] == [{"content": t} for t in texted]
    for ch in token_chunks:
        assert ch["id"] == role["id"] and ch["model"] == role["model"] == server.api_cfg.model_name
        assert ch["choices"][0]["finish_reason"] is None and ch["usage"] is None
    after = rest[n:]
    if ref_finish.text:  # held-back text released at the end comes as one more content chunk
        assert after[0]["choices"][0]["delta"] == {"content": ref_finish.text}
        after = after[1:]
    finish, usage, metrics, tokens = after
    assert finish["choices"] == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}]
    cached = finish["timings"]["cache_n"]  # llama.cpp's split: prompt_n tokens prefilled, cache_n reused
    assert finish["timings"]["predicted_n"] == 12 and finish["timings"]["prompt_n"] + cached == len(ids)
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 12,
                                                         "total_tokens": len(ids) + 12,
                                                         "prompt_tokens_details": {"cached_tokens": cached}}
    assert metrics["metrics"]["cached_tokens"] == cached
    assert metrics["object"] == "chat.completion.metrics"
    assert metrics["metrics"]["prompt_tokens"] == len(ids) and metrics["metrics"]["completion_tokens"] == 12
    for key in ("ttft_ms", "prefill_ms", "tpot_ms", "total_ms", "tok_s"):
        assert metrics["metrics"][key] > 0
    assert tokens == {"object": "chat.completion.tokens", "tokens": ids + ref_finish.token_ids}
    assert r.data_events()[-1] == b"data: [DONE]\n\n"

    # keep-alive: the same connection serves the next request
    c.send(request_bytes("GET", "/health"))
    r2 = c.read_head()
    assert r2.status == 200 and json.loads(c.read_body(r2))["status"] == "ok"
    c.close()


def test_plain_stream_has_no_usage_or_extension_events(server, reference):
    ids, ref = reference([{"role": "user", "content": "Hi"}], 5)
    c, r = stream_request(server, chat_body("Hi", stream=True, max_tokens=5, temperature=0, ignore_eos=True))
    c.close()
    events = r.json_events()
    assert all(e["object"] == "chat.completion.chunk" and "usage" not in e for e in events)
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    content = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
    assert content == "".join(e.text for e in ref)
    assert r.data_events()[-1] == b"data: [DONE]\n\n"


def test_role_frame_and_keepalives_before_prefill(server):
    """A stream that has to wait gets its head, its role frame and SSE comments before its prefill starts."""
    busy = RawClient(server.port)
    busy.send(request_bytes("POST", "/v1/chat/completions",
                            chat_body("Hello", stream=True, max_tokens=400, ignore_eos=True)))
    r_busy = busy.read_head()
    busy.read_events(r_busy, stop_after=2)  # role frame + first token: the engine is on it
    started_before = server.worker.stats.requests_started

    waiting = RawClient(server.port)
    waiting.send(request_bytes("POST", "/v1/chat/completions",
                               chat_body("Hi", stream=True, max_tokens=3, ignore_eos=True)))
    r = waiting.read_head()
    assert r.head == SSE_HEAD
    waiting.read_events(r, stop_after=1)
    assert json.loads(r.data_events()[0][6:])["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    # the role frame is here, and the engine has not started this request
    assert server.worker.stats.requests_started == started_before and server.worker.waiting == 1
    # keep-alive comments arrive while it waits (queue_keepalive_s=0.1)
    waiting.read_events(r, until=lambda r: any(e == b": queued\n\n" for _, e in r.events))
    assert server.worker.stats.requests_started == started_before
    busy.close()  # the running client leaves; the waiting one is served next
    waiting.read_events(r)
    waiting.close()
    evs = r.json_events()
    assert evs[-1]["choices"][0]["finish_reason"] == "length"
    assert r.data_events()[-1] == b"data: [DONE]\n\n"


def test_completions_stream(server):
    c = RawClient(server.port)
    c.send(request_bytes("POST", "/v1/completions",
                         {"prompt": "Once upon a time", "max_tokens": 6, "stream": True, "temperature": 0,
                          "ignore_eos": True}))
    r = c.read_head()
    assert r.head == SSE_HEAD
    c.read_events(r)
    c.close()
    events = r.json_events()
    assert all(e["object"] == "text_completion" for e in events)
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert all(e["choices"][0]["text"] for e in events[:-1])
    assert r.data_events()[-1] == b"data: [DONE]\n\n"
