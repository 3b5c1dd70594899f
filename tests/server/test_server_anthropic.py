"""Anthropic's Messages API end to end: the official `anthropic` SDK (messages.create, messages.stream, a tool-use
round trip with thinking blocks, count_tokens, its error classes) against the real CLI (`python -m appliance`) on
the scripted tiny Qwen3 (Qwen3's own template: it thinks and calls get_weather with thinking on, answers with
thinking off; tests/support/scripted_model.py) and on SmolLM2-135M (a real model, no tool section in its template:
the generic tool format under a forced call); the event stream checked byte for byte on the wire; the queue
(`ping`s while waiting, the 429 in Anthropic's shape), cancel on disconnect and the API key on an in-process server.

The SDK in use (anthropic 2.x) has no temperature / top_k parameters (newer Claude models refuse them); they go in
`extra_body`, as they are on the wire."""
from __future__ import annotations

import contextlib
import json
import re

import anthropic
import pytest

from tests.support.gguf_files import fetch_smollm2
from tests.support.live_server import LiveServer, RawClient, request_bytes, start_cli_server
from tests.support.scripted_model import ANSWER, THINKING

WEATHER = {"name": "get_weather", "description": "Current weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
ASK = [{"role": "user", "content": "Weather?"}]
GREEDY = {"temperature": 0}
OFF = {"type": "disabled"}
ON = {"type": "enabled", "budget_tokens": 1024}

# POST /v1/messages, "Weather?" with thinking off, streamed: as on the wire, with the message id, the model's
# name and the usage split ({IN} prefilled + {CACHED} reused = 14 prompt tokens) left as placeholders.
EXPECTED_WIRE = (
    'event: message_start\ndata: {"type":"message_start","message":{"id":"{MSG}","type":"message","role":"assistant",'
    '"model":"{MODEL}","content":[],"stop_reason":null,"stop_sequence":null,"usage":{"input_tokens":14,'
    '"cache_creation_input_tokens":0,"cache_read_input_tokens":0,"output_tokens":0}}}\n\n'
    'event: content_block_start\ndata: {"type":"content_block_start","index":0,"content_block":{"type":"text",'
    '"text":""}}\n\n'
    'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta",'
    '"text":" Sunny"}}\n\n'
    'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta",'
    '"text":" in"}}\n\n'
    'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta",'
    '"text":" Paris"}}\n\n'
    'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta",'
    '"text":" today"}}\n\n'
    'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta",'
    '"text":"."}}\n\n'
    'event: content_block_stop\ndata: {"type":"content_block_stop","index":0}\n\n'
    'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"end_turn","stop_sequence":null},'
    '"usage":{"input_tokens":{IN},"cache_creation_input_tokens":0,"cache_read_input_tokens":{CACHED},'
    '"output_tokens":6}}\n\n'
    'event: message_stop\ndata: {"type":"message_stop"}\n\n'
)


@contextlib.contextmanager
def cli(model: str, *args: str):
    proc, port = start_cli_server(model, *args)
    try:
        yield port
    finally:
        proc.kill()
        proc.wait()
        proc.stderr.close()


@pytest.fixture(scope="module")
def scripted(scripted_qwen3):
    with cli(scripted_qwen3) as port:
        yield port


@pytest.fixture()
def client(scripted):
    return anthropic.Anthropic(base_url=f"http://127.0.0.1:{scripted}", api_key="none", max_retries=0)


def model_name(port: int) -> str:
    c = RawClient(port)
    c.send(request_bytes("GET", "/v1/models"))
    r = c.read_head()
    name = json.loads(c.read_body(r))["data"][0]["id"]
    c.close()
    return name


def post(port: int, path: str, body: bytes | dict, headers: dict | None = None):
    """(status, parsed JSON body, content type) of a non-stream POST."""
    c = RawClient(port)
    c.send(request_bytes("POST", path, body, headers))
    r = c.read_head()
    out = json.loads(c.read_body(r))
    c.close()
    return r.status, out, r.header("content-type")


def test_event_stream_byte_for_byte(scripted):
    c = RawClient(scripted)
    c.send(request_bytes("POST", "/v1/messages", {"model": "m", "max_tokens": 32, "messages": ASK, "stream": True,
                                                  "thinking": OFF, **GREEDY}))
    r = c.read_head()
    c.read_events(r)
    c.close()
    assert r.status == 200 and r.header("content-type") == "text/event-stream; charset=utf-8"
    wire = b"".join(e for _, e in r.events).decode()
    msg_id = re.search(r'"id":"(msg_[0-9a-f]{24})"', wire).group(1)
    n_in, n_cached = map(int, re.search(r'"input_tokens":(\d+),"cache_creation_input_tokens":0,'
                                        r'"cache_read_input_tokens":(\d+),"output_tokens":6', wire).groups())
    assert n_in + n_cached == 14 and n_in >= 1
    expected = EXPECTED_WIRE.replace("{MSG}", msg_id).replace("{MODEL}", model_name(scripted))
    assert wire == expected.replace("{IN}", str(n_in)).replace("{CACHED}", str(n_cached))
    assert len(r.events) == 10


def test_create_and_stream(client):
    r = client.messages.create(model="m", max_tokens=32, messages=ASK, thinking=OFF, extra_body=GREEDY)
    assert r.type == "message" and r.role == "assistant" and r.id.startswith("msg_")
    assert [b.type for b in r.content] == ["text"] and r.content[0].text == ANSWER
    assert r.stop_reason == "end_turn" and r.stop_sequence is None and r.usage.output_tokens == 6
    total = r.usage.input_tokens + r.usage.cache_read_input_tokens
    with client.messages.stream(model="m", max_tokens=32, messages=ASK, thinking=OFF, extra_body=GREEDY) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == ANSWER and final.content[0].text == ANSWER and final.stop_reason == "end_turn"
    # the same prompt again: all of it but the last token was reused (prefix reuse, Anthropic's cache read)
    assert final.usage.cache_read_input_tokens == total - 1 and final.usage.input_tokens == 1
    n = client.messages.count_tokens(model="m", messages=ASK, thinking=OFF)
    assert n.input_tokens == total

    stopped = client.messages.create(model="m", max_tokens=32, messages=ASK, thinking=OFF,
                                     stop_sequences=[" Paris"], extra_body=GREEDY)
    assert stopped.content[0].text == " Sunny in"
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == " Paris"
    cut = client.messages.create(model="m", max_tokens=2, messages=ASK, thinking=OFF, extra_body=GREEDY)
    assert cut.content[0].text == " Sunny in" and cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 2
    # a prefill: the answer continues the assistant's words (the scripted model: " Sunny in" -> " Paris today.")
    prefill = client.messages.create(model="m", max_tokens=32, thinking=OFF, extra_body=GREEDY,
                                     messages=[*ASK, {"role": "assistant", "content": " Sunny in"}])
    assert prefill.content[0].text == " Paris today." and prefill.stop_reason == "end_turn"
    assert client.messages.count_tokens(model="m", thinking=OFF, messages=[
        *ASK, {"role": "assistant", "content": " Sunny in"}]).input_tokens == \
        prefill.usage.input_tokens + prefill.usage.cache_read_input_tokens
    system = client.messages.create(model="m", max_tokens=32, messages=ASK, thinking=OFF, extra_body=GREEDY,
                                    system="Answer briefly.")
    assert (system.usage.input_tokens + system.usage.cache_read_input_tokens) > total


def test_tool_use_round_trip_with_thinking(client):
    with client.messages.stream(model="m", max_tokens=64, messages=ASK, tools=[WEATHER], thinking=ON,
                                extra_body=GREEDY) as s:
        kinds = [e.type for e in s]
        first = s.get_final_message()
    assert "thinking" in kinds and "input_json" in kinds
    assert [b.type for b in first.content] == ["thinking", "tool_use"]
    assert first.content[0].thinking == THINKING
    call = first.content[1]
    assert call.name == "get_weather" and call.input == {"city": "Paris"} and call.id.startswith("toolu_")
    assert first.stop_reason == "tool_use" and first.usage.output_tokens == 21
    same = client.messages.create(model="m", max_tokens=64, messages=ASK, tools=[WEATHER], thinking=ON,
                                  extra_body=GREEDY)
    assert [b.type for b in same.content] == ["thinking", "tool_use"] and same.content[1].input == call.input

    # the round trip: the assistant turn as the SDK returned it (thinking block with its signature, tool_use),
    # then the tool's result; with thinking off the model answers
    follow = client.messages.create(
        model="m", max_tokens=64, tools=[WEATHER], thinking=OFF, extra_body=GREEDY,
        messages=[*ASK, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                "content": [{"type": "text", "text": "18 C and sunny"}]}]}])
    assert [b.type for b in follow.content] == ["text"] and follow.content[0].text == ANSWER
    assert follow.stop_reason == "end_turn"
    assert follow.usage.input_tokens + follow.usage.cache_read_input_tokens > \
        first.usage.input_tokens + first.usage.cache_read_input_tokens


def test_claude_code_style_request_streams(scripted):
    """What Claude Code sends: ?beta=true, system as text blocks with cache_control, tools with cache_control,
    metadata, a large max_tokens, thinking with a budget, anthropic-* headers, x-api-key."""
    body = {"model": "claude-sonnet-4-5", "max_tokens": 32000, "stream": True, "metadata": {"user_id": "u_1"},
            "thinking": {"type": "enabled", "budget_tokens": 31999},
            "system": [{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
                       {"type": "text", "text": "Be brief."}],
            "tools": [{**WEATHER, "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Weather?",
                                                       "cache_control": {"type": "ephemeral"}}]}]}
    c = RawClient(scripted)
    c.send(request_bytes("POST", "/v1/messages?beta=true", body, {
        "anthropic-version": "2023-06-01", "anthropic-beta": "interleaved-thinking-2025-05-14", "x-api-key": "sk"}))
    r = c.read_head()
    c.read_events(r)
    c.close()
    assert r.status == 200
    evs = [json.loads(e.split(b"\ndata: ", 1)[1]) for _, e in r.events]
    assert evs[0]["type"] == "message_start" and evs[-1] == {"type": "message_stop"}
    starts = [e["content_block"]["type"] for e in evs if e["type"] == "content_block_start"]
    assert starts == ["thinking", "tool_use"] and evs[-2]["delta"]["stop_reason"] == "tool_use"


@pytest.mark.parametrize("body, status, words", [
    ({"model": "m", "messages": ASK}, 400, "max_tokens: Field required"),
    ({"model": "m", "max_tokens": 8, "messages": [{"role": "system", "content": "x"}]}, 400, "'user' or 'assistant'"),
    ({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "video", "url": "x"}]}]},
     400, "unsupported content block type 'video'"),
    ({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}, 400, "does not accept images"),
    ({"model": "m", "max_tokens": 8, "messages": ASK, "tools": [{"type": "bash_20250124", "name": "bash"}]},
     400, "Anthropic's own tools"),
    ({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "x" * 40000}]}, 400, "context length"),
    (b"{not json", 400, "could not parse"),
])
def test_bad_input_is_a_4xx_in_anthropics_shape(scripted, body, status, words):
    got, out, ctype = post(scripted, "/v1/messages", body)
    assert got == status and ctype == "application/json", out
    assert out["type"] == "error" and out["error"]["type"] == "invalid_request_error" and words in out["error"][
        "message"], out


def test_sdk_error_classes(client):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}]}])
    assert e.value.body["error"]["type"] == "invalid_request_error" and "messages.0.content.0.type" in e.value.message
    with pytest.raises(anthropic.NotFoundError) as e:
        client.get("/v1/messages/batches", cast_to=object)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "not_found_error"


@pytest.fixture(scope="module")
def queue_server(tiny_qwen3_tied):
    with LiveServer(tiny_qwen3_tied, queue=1, prefill_chunk=16, queue_keepalive_s=0.01,
                    api_keys=("secret",)) as s:
        yield s


def open_stream(server, content: str, max_tokens: int) -> tuple[RawClient, object]:
    c = RawClient(server.port)
    c.send(request_bytes("POST", "/v1/messages", {"model": "m", "max_tokens": max_tokens, "stream": True,
                                                  "thinking": OFF, "messages": [{"role": "user", "content": content}]},
                         {"x-api-key": "secret"}))
    r = c.read_head()
    assert r.status == 200
    return c, r


def deltas(r) -> int:
    return sum(1 for _, e in r.events if e.startswith(b"event: content_block_delta"))


def test_pings_while_queued_429_and_cancel(queue_server):
    s = queue_server
    n_before = len(s.traces())
    a, ra = open_stream(s, "Running", 2000)
    a.read_events(ra, until=lambda r: deltas(r) >= 2)
    b, rb = open_stream(s, "Waiting", 3)
    # message_start at once (before the engine is ours), then pings while in line
    b.read_events(rb, until=lambda r: sum(e.startswith(b"event: ping\n") for _, e in r.events) >= 2)
    assert rb.events[0][1].startswith(b"event: message_start\n") and s.worker.waiting == 1
    status, out, _ = post(s.port, "/v1/messages", {"model": "m", "max_tokens": 4, "messages": ASK},
                          {"x-api-key": "secret"})
    assert status == 429 and out["type"] == "error" and out["error"]["type"] == "rate_limit_error"
    a.close()       # the running client leaves: its generation stops within one step
    s.wait_for(lambda: len(s.traces()) > n_before, what="the first job to end")
    t = s.traces()[n_before]
    assert t.finish_reason == "cancelled" and t.tokens_after_cancel <= 1 and t.polls_after_cancel == 1
    b.read_events(rb)
    b.close()
    last = [json.loads(e.split(b"\ndata: ", 1)[1]) for _, e in rb.events][-2:]
    assert last[0]["delta"]["stop_reason"] == "max_tokens" and last[0]["usage"]["output_tokens"] == 3
    assert last[1] == {"type": "message_stop"}


def test_api_key_as_anthropic_clients_send_it(queue_server):
    url = f"http://127.0.0.1:{queue_server.port}"
    ok = anthropic.Anthropic(base_url=url, api_key="secret", max_retries=0)
    r = ok.messages.create(model="m", max_tokens=3, messages=ASK, thinking=OFF)
    assert r.usage.output_tokens <= 3
    bearer = anthropic.Anthropic(base_url=url, auth_token="secret", api_key=None, max_retries=0)
    assert bearer.messages.count_tokens(model="m", messages=ASK).input_tokens > 0
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(
            model="m", max_tokens=3, messages=ASK)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "authentication_error"


def test_context_end_is_model_context_window_exceeded(scripted_qwen3):
    """max_tokens past the room the prompt leaves is lowered, not refused; stopping there says so."""
    with LiveServer(scripted_qwen3, ctx=160) as s:
        c = anthropic.Anthropic(base_url=s.url, api_key="none", max_retries=0)
        n = c.messages.count_tokens(model="m", messages=ASK, tools=[WEATHER], thinking=ON).input_tokens
        assert 160 - 21 < n < 160 - 5               # the scripted call (21 tokens) does not fit
        r = c.messages.create(model="m", max_tokens=4096, messages=ASK, tools=[WEATHER], thinking=ON,
                              extra_body=GREEDY)
        assert r.stop_reason == "model_context_window_exceeded" and r.usage.output_tokens == 160 - n
        assert r.content[0].type == "thinking" and r.content[0].thinking == THINKING


@pytest.fixture(scope="module")
def smollm2():
    with cli(fetch_smollm2(), "--ctx", "2048") as port:
        yield anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key="none", max_retries=0)


def test_smollm2_create_stream_and_forced_tool_use(smollm2):
    ask = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    r = smollm2.messages.create(model="smollm2", max_tokens=24, messages=ask, extra_body=GREEDY)
    assert r.content and r.content[0].type == "text" and r.content[0].text.strip()
    with smollm2.messages.stream(model="smollm2", max_tokens=24, messages=ask, extra_body=GREEDY) as s:
        pieces = list(s.text_stream)
        final = s.get_final_message()
    assert len(pieces) > 3 and "".join(pieces) == final.content[0].text == r.content[0].text
    assert final.usage.output_tokens == r.usage.output_tokens and final.usage.cache_read_input_tokens > 0

    # no tool section in SmolLM2's template: the generic format, its call constrained to the schema
    with smollm2.messages.stream(model="smollm2", max_tokens=64, tools=[WEATHER], tool_choice={"type": "any"},
                                 messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                                 extra_body=GREEDY) as s:
        kinds = [e.type for e in s]
        call_msg = s.get_final_message()
    tool = [b for b in call_msg.content if b.type == "tool_use"]
    assert "input_json" in kinds and len(tool) == 1 and tool[0].name == "get_weather"
    assert isinstance(tool[0].input.get("city"), str) and call_msg.stop_reason == "tool_use"


def test_image_blocks_on_tiny_qwen3_vl_match_chat_completions(tmp_path_factory):
    import base64

    import openai

    from tests.support.tiny_vl import cached_qwen3_vl, image_bytes
    data = base64.b64encode(image_bytes(120, 90, "PNG", seed=6)).decode()
    with LiveServer(cached_qwen3_vl(tmp_path_factory)) as s:
        c = anthropic.Anthropic(base_url=s.url, api_key="none", max_retries=0)
        content = [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}},
                   {"type": "text", "text": "Describe."}]
        with c.messages.stream(model="vl", max_tokens=16, extra_body=GREEDY,
                               messages=[{"role": "user", "content": content}]) as st:
            start = next(e for e in st if e.type == "message_start")
            r = st.get_final_message()
        cc = openai.OpenAI(base_url=s.url + "/v1", api_key="none").chat.completions.create(
            model="vl", temperature=0, max_tokens=16, messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}},
                {"type": "text", "text": "Describe."}]}])
        text = "".join(b.text for b in r.content if b.type == "text")
        reasoning = "".join(b.thinking for b in r.content if b.type == "thinking")
        assert text == (cc.choices[0].message.content or "")
        assert reasoning == (getattr(cc.choices[0].message, "reasoning_content", None) or "")
        prompt = r.usage.input_tokens + r.usage.cache_read_input_tokens
        assert prompt == cc.usage.prompt_tokens and r.usage.output_tokens == cc.usage.completion_tokens
        assert start.message.usage.input_tokens == prompt          # message_start counts the image's tokens too
        assert c.messages.count_tokens(model="vl", messages=[{"role": "user", "content": content}]).input_tokens \
            == prompt
        assert c.messages.count_tokens(model="vl", messages=[{"role": "user", "content": "Describe."}]).input_tokens \
            < prompt - 4
        # a bad image is named as the client sent it
        with pytest.raises(anthropic.BadRequestError) as e:
            c.messages.create(model="vl", max_tokens=4, messages=[{"role": "user", "content": [
                {"type": "text", "text": "Describe."},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "bm90IGEgcGljdHVyZQ=="}}]}])
        assert e.value.body["type"] == "error" and "messages.0.content.1" in e.value.body["error"]["message"]


def test_shutdown_mid_stream_is_an_error_event_the_sdk_raises(tiny_qwen3_tied):
    """SIGTERM's path: the queued stream gets the `error` event at once, the running one when the grace ends;
    both end the body properly, and the SDK raises the error it carries; a queued non-stream request gets the 503
    in Anthropic's shape."""
    import threading
    with LiveServer(tiny_qwen3_tied, queue=2, queue_keepalive_s=0.05) as s:
        c = anthropic.Anthropic(base_url=s.url, api_key="none", max_retries=0)
        raised: list[BaseException] = []
        got: list[str] = []

        def run():
            try:
                with c.messages.stream(model="m", max_tokens=4000, thinking=OFF, messages=ASK) as st:
                    for e in st:
                        got.append(e.type)
            except BaseException as e:  # noqa: BLE001 - what the SDK raised is the test's subject
                raised.append(e)
        t = threading.Thread(target=run, daemon=True)
        t.start()
        s.wait_for(lambda: "content_block_delta" in got, what="the first stream to decode")
        b, rb = open_stream_plain(s)
        b.read_events(rb, until=lambda r: any(e.startswith(b"event: ping\n") for _, e in r.events))
        q = RawClient(s.port)             # a non-stream request in line too
        q.send(request_bytes("POST", "/v1/messages", {"model": "m", "max_tokens": 3, "messages": ASK}))
        s.wait_for(lambda: s.worker.waiting == 2, what="both requests to wait in line")
        s.stop(grace=0.3)
        b.read_events(rb)
        b.close()
        rq = q.read_head()
        queued = json.loads(q.read_body(rq))
        q.close()
        t.join(30)
    assert rq.status == 503 and queued == {"type": "error", "error": {
        "type": "overloaded_error", "message": "The server is shutting down; retry the request."}}
    assert rb.events[-1][1] == (b'event: error\ndata: {"type":"error","error":{"type":"overloaded_error","message":'
                                b'"The server is shutting down; retry the request."}}\n\n')
    assert rb._finished                                 # the chunked body ended properly
    assert len(raised) == 1 and isinstance(raised[0], anthropic.APIStatusError), raised
    assert raised[0].body["error"]["type"] == "overloaded_error"


def open_stream_plain(server) -> tuple[RawClient, object]:
    c = RawClient(server.port)
    c.send(request_bytes("POST", "/v1/messages", {"model": "m", "max_tokens": 3, "stream": True, "thinking": OFF,
                                                  "messages": ASK}))
    r = c.read_head()
    assert r.status == 200
    return c, r


def test_random_bodies_over_the_wire_get_200_or_a_4xx_in_anthropics_shape(queue_server):
    """The protocol fuzz's random Messages bodies over real sockets: a 200 (whose stream or body we drop, which
    cancels it) or a 4xx in Anthropic's error shape, never a 500; the server keeps serving."""
    import random

    from tests.protocol.test_protocol_anthropic import anthropic_mutate
    s = queue_server
    rng = random.Random(11)
    seen: dict[int, int] = {}
    for _ in range(60):
        body = anthropic_mutate(rng)
        if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 0:
            body["max_tokens"] = min(body["max_tokens"], 8)
        c = RawClient(s.port, timeout=30)
        c.send(request_bytes("POST", "/v1/messages", json.dumps(body).encode(), {"x-api-key": "secret"}))
        r = c.read_head()
        seen[r.status] = seen.get(r.status, 0) + 1
        if r.status != 200:
            out = json.loads(c.read_body(r))
            assert 400 <= r.status < 500 and out["type"] == "error", (body, out)
            assert set(out["error"]) == {"type", "message"} and out["error"]["type"] == "invalid_request_error"
        c.close()
        s.wait_for(lambda: not s.worker.busy and s.worker.waiting == 0, what="the engine to idle")
    assert seen.get(200, 0) > 0 and sum(n for st, n in seen.items() if st >= 400) > 0
