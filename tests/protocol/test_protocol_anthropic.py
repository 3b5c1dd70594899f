"""Anthropic's Messages API, sans I/O: request bodies into the chat path (system, blocks, tools, tool_choice,
thinking, stop_sequences) and their 400s in Anthropic's dotted paths, the event stream of AnthropicAssembler byte for
byte (thinking, a streamed tool_use, text, a stop sequence, max_tokens against the context's end), each event
loaded by the official `anthropic` SDK's own event and message types, and the error shape."""
from __future__ import annotations

import itertools
import json

import pytest
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import TypeAdapter

from appliance.protocol.anthropic_requests import (
    continue_final_message,
    parse_count_tokens_request,
    parse_messages_request,
)
from appliance.protocol.anthropic_stream import PING, AnthropicAssembler, error_body
from appliance.protocol.errors import ApiError, queue_full
from appliance.protocol.stats import GenerationStats

EVENT = TypeAdapter(RawMessageStreamEvent)
WEATHER = {"name": "get_weather", "description": "Current weather", "cache_control": {"type": "ephemeral"},
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL_TOKENS = ["<think>", "Let", " me", " check", "</think>", "<tool_call>", '{"', "name", '":"', "get", "_weather",
               '","', "arguments", '":{"', "city", '":', ' "', "Paris", '"}}', "</tool_call>", ""]

# The scripted thinking + tool call, as written on the wire (one write per token that releases anything).
EXPECTED_CALL_WIRE = (
    'event: message_start\ndata: {"type":"message_start","message":{"id":"msg_1","type":"message","role":"assistant",'
    '"model":"m","content":[],"stop_reason":null,"stop_sequence":null,"usage":{"input_tokens":30,'
    '"cache_creation_input_tokens":0,"cache_read_input_tokens":0,"output_tokens":0}}}\n\n'
    'event: content_block_start\ndata: {"type":"content_block_start","index":0,"content_block":{"type":"thinking",'
    '"thinking":"","signature":""}}\n\n'
    'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,"delta":{"type":"thinking_delta",'
    '"thinking":"Let"}}\n\n'
    'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,"delta":{"type":"thinking_delta",'
    '"thinking":" me"}}\n\n'
    'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,"delta":{"type":"thinking_delta",'
    '"thinking":" check"}}\n\n'
    'event: content_block_stop\ndata: {"type":"content_block_stop","index":0}\n\n'
    'event: content_block_start\ndata: {"type":"content_block_start","index":1,"content_block":{"type":"tool_use",'
    '"id":"toolu_2","name":"get_weather","input":{}}}\n\n'
    'event: content_block_delta\ndata: {"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta",'
    '"partial_json":"{\\""}}\n\n'
    'event: content_block_delta\ndata: {"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta",'
    '"partial_json":"city"}}\n\n'
    'event: content_block_delta\ndata: {"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta",'
    '"partial_json":"\\":"}}\n\n'
    'event: content_block_delta\ndata: {"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta",'
    '"partial_json":" \\""}}\n\n'
    'event: content_block_delta\ndata: {"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta",'
    '"partial_json":"Paris"}}\n\n'
    'event: content_block_delta\ndata: {"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta",'
    '"partial_json":"\\"}"}}\n\n'
    'event: content_block_stop\ndata: {"type":"content_block_stop","index":1}\n\n'
    'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"tool_use","stop_sequence":null},'
    '"usage":{"input_tokens":20,"cache_creation_input_tokens":0,"cache_read_input_tokens":10,"output_tokens":21}}\n\n'
    'event: message_stop\ndata: {"type":"message_stop"}\n\n'
)


def stats(completion: int, prompt: int = 30, cached: int = 10, stop_sequence: str | None = None) -> GenerationStats:
    return GenerationStats(prompt_tokens=prompt, completion_tokens=completion, prefill_ms=5.0, ttft_ms=6.0,
                           decode_ms=4.0, total_ms=12.0, tpot_ms=2.0, tok_s=500.0, cached_tokens=cached,
                           stop_sequence=stop_sequence)


def assembler(max_tokens: int = 64, **kw) -> AnthropicAssembler:
    n = itertools.count(1)
    return AnthropicAssembler("m", 30, max_tokens, make_id=lambda p: f"{p}_{next(n)}", **kw)


def events(blobs: list[bytes]) -> list[dict]:
    """Every event of the writes, its `event:` line checked against its type and loaded by the SDK's types."""
    out = []
    for ev in filter(None, b"".join(blobs).split(b"\n\n")):
        head, data = ev.split(b"\n", 1)
        obj = json.loads(data[len(b"data: "):])
        assert head == b"event: " + obj["type"].encode()
        EVENT.validate_python(obj)
        out.append(obj)
    return out


def body(**kw) -> bytes:
    return json.dumps({"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}], **kw}).encode()


def bad(raw: bytes | str, **kw) -> ApiError:
    with pytest.raises(ApiError) as e:
        parse_messages_request(raw.encode() if isinstance(raw, str) else raw, **kw)
    assert e.value.status == 400
    return e.value


def test_thinking_and_streamed_tool_call_byte_for_byte():
    a = assembler(tools=True)
    writes = a.start() + [a.token(t) for t in CALL_TOKENS] + a.finish("stop", "", stats(21))
    assert b"".join(writes).decode() == EXPECTED_CALL_WIRE
    assert writes[1] == b"" and writes[5] == b'event: content_block_stop\ndata: {"type":"content_block_stop","index":0}\n\n'
    evs = events(writes)
    assert sum(e["type"] == "content_block_delta" for e in evs) == 9      # three thinking + six argument tokens

    # the same tokens, non-stream: the SDK's Message, the arguments parsed into `input`
    b = assembler(tools=True)
    for t in CALL_TOKENS:
        b.token(t)
    msg = Message.model_validate(b.response("stop", "", stats(21)))
    assert [c.type for c in msg.content] == ["thinking", "tool_use"]
    assert msg.content[0].thinking == "Let me check" and msg.content[0].signature == ""
    assert msg.content[1].input == {"city": "Paris"} and msg.content[1].id == "toolu_2"
    assert msg.stop_reason == "tool_use" and msg.usage.input_tokens == 20 and msg.usage.cache_read_input_tokens == 10


def test_text_stop_reasons_and_usage():
    a = assembler()
    writes = a.start() + [a.token(t) for t in ["Hel", "lo", "!"]] + a.finish("stop", "", stats(4, stop_sequence="##"))
    evs = events(writes)
    assert [e["type"] for e in evs] == ["message_start", "content_block_start"] + ["content_block_delta"] * 3 + [
        "content_block_stop", "message_delta", "message_stop"]
    assert evs[1]["content_block"] == {"type": "text", "text": ""}
    assert evs[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "##"}

    cases = [("stop", 3, None, "end_turn"), ("length", 64, None, "max_tokens"),
             ("length", 12, None, "model_context_window_exceeded")]   # lowered to the room the context left
    for reason, n, seq, expected in cases:
        b = assembler()
        b.token("x")
        r = b.response(reason, "y", stats(n, stop_sequence=seq))
        assert r["stop_reason"] == expected and r["content"] == [{"type": "text", "text": "xy"}], (reason, n, r)
    empty = assembler().response("stop", "", stats(1, cached=0))
    assert empty["content"] == [] and empty["usage"] == {"input_tokens": 30, "cache_creation_input_tokens": 0,
                                                          "cache_read_input_tokens": 0, "output_tokens": 1}
    Message.model_validate(empty)


def test_a_call_cut_by_max_tokens_keeps_what_the_model_wrote():
    a = assembler(max_tokens=15, tools=True)
    for t in CALL_TOKENS[5:15]:                  # <tool_call> ... "city"
        a.token(t)
    r = a.response("length", "", stats(15))
    assert r["stop_reason"] == "max_tokens"
    assert r["content"] == [{"type": "tool_use", "id": "toolu_2", "name": "get_weather",
                             "input": {"arguments": '{"city'}}]


def test_ping_and_errors_in_anthropics_shape():
    assert PING == b'event: ping\ndata: {"type":"ping"}\n\n' and assembler().keepalive("queued") == PING
    assert json.loads(error_body(ApiError(400, "max_tokens: Field required."))) == {
        "type": "error", "error": {"type": "invalid_request_error", "message": "max_tokens: Field required."}}
    assert json.loads(error_body(queue_full()))["error"]["type"] == "rate_limit_error"
    assert json.loads(error_body(ApiError(503, "loading")))["error"]["type"] == "overloaded_error"
    assert json.loads(error_body(ApiError(500, "oops")))["error"]["type"] == "api_error"
    ev = assembler().error_event(ApiError(503, "The server is shutting down; retry the request."))
    assert ev == (b'event: error\ndata: {"type":"error","error":{"type":"overloaded_error","message":"The server is '
                  b'shutting down; retry the request."}}\n\n')


def test_blocks_become_chat_messages():
    r = parse_messages_request(json.dumps({
        "model": "m", "max_tokens": 100, "stop_sequences": ["##", "", "##"], "temperature": 0.2, "top_k": 5,
        "metadata": {"user_id": "u"}, "stream": True,
        "system": [{"type": "text", "text": "You are terse. ", "cache_control": {"type": "ephemeral"}},
                   {"type": "text", "text": "Answer in French."}],
        "tools": [WEATHER], "tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Look: "},
                                         {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                      "data": "AAAA"}}]},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "sig"},
                                              {"type": "redacted_thinking", "data": "xyz"},
                                              {"type": "text", "text": "Checking."},
                                              {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                               "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                          "content": [{"type": "text", "text": "18 C"}]},
                                         {"type": "text", "text": "And tomorrow?", "cache_control": {"type": "ephemeral"}}]},
        ]}).encode(), images_supported=True)
    req = r.request
    assert r.max_tokens == req.max_tokens == 100 and req.stream and req.stop == ("##",)
    assert req.sampling.temperature == 0.2 and req.sampling.top_k == 5
    assert req.tool_choice == "auto" and req.parallel_tool_calls is False and req.output_format is None
    assert req.tools == [{"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                                           "parameters": WEATHER["input_schema"]}}]
    m = req.messages
    assert [x["role"] for x in m] == ["system", "user", "assistant", "tool", "user"]
    assert m[0]["content"] == "You are terse. Answer in French."
    assert m[1]["content"][1]["image_url"] == {"url": "data:image/png;base64,AAAA"}
    assert m[2]["content"] == "Checking." and m[2]["reasoning_content"] == "hm"
    assert m[2]["tool_calls"] == [{"id": "toolu_1", "type": "function",
                                   "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
    assert m[3] == {"role": "tool", "content": "18 C", "tool_call_id": "toolu_1"}
    assert m[4] == {"role": "user", "content": "And tomorrow?"}
    assert "enable_thinking" not in req.template_kwargs     # absent: the template's default


def test_thinking_and_tool_choice():
    on = parse_messages_request(body(thinking={"type": "enabled", "budget_tokens": 2048})).request
    off = parse_messages_request(body(thinking={"type": "disabled"})).request
    assert on.template_kwargs == {"enable_thinking": True} and off.template_kwargs == {"enable_thinking": False}
    anyc = parse_messages_request(body(tools=[WEATHER], tool_choice={"type": "any"})).request
    assert anyc.tool_choice == "required" and anyc.output_format.kind == "tool_calls"
    assert anyc.template_kwargs == {"enable_thinking": False}    # a forced call: thinking off
    named = parse_messages_request(body(tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"})).request
    assert named.tool_choice == "function" and named.output_format.tools[0][0] == "get_weather"
    none = parse_messages_request(body(tools=[WEATHER], tool_choice={"type": "none"})).request
    assert none.tools is None and none.tool_choice is None
    e = bad(body(tools=[WEATHER], tool_choice={"type": "any"}, thinking={"type": "enabled", "budget_tokens": 1024}))
    assert e.param == "thinking"
    e = bad(body(tools=[WEATHER], tool_choice={"type": "tool", "name": "nope"}))
    assert e.param == "tool_choice.name"
    count = parse_count_tokens_request(json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                                   "system": "s"}).encode())
    assert count.max_tokens is None and [x["role"] for x in count.request.messages] == ["system", "user"]


def test_a_final_assistant_message_is_a_prefill():
    r = parse_messages_request(body(messages=[{"role": "user", "content": "Pick (A) or (B)."},
                                              {"role": "assistant", "content": [{"type": "text", "text": "The "},
                                                                                {"type": "text", "text": "answer is ("}]}]))
    assert r.prefill and r.prefill_text == "The answer is ("
    rendered = "<|im_start|>user\nPick (A) or (B).<|im_end|>\n<|im_start|>assistant\nThe answer is (<|im_end|>\n"
    assert continue_final_message(rendered, r.prefill_text) == rendered[:-len("<|im_end|>\n")]
    with pytest.raises(ApiError):
        continue_final_message("<|im_start|>assistant\n<|im_end|>\n", "dropped by the template")
    empty = parse_messages_request(body(messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]))
    assert not empty.prefill and [m["role"] for m in empty.request.messages] == ["user"]
    assert not parse_messages_request(body()).prefill


@pytest.mark.parametrize("raw, param, words", [
    (json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}]}), "max_tokens", "Field required"),
    (body(max_tokens=0), "max_tokens", ">= 1"),
    (body(max_tokens="10"), "max_tokens", "integer"),
    (body(messages=[]), "messages", "at least one"),
    (body(messages=[{"role": "system", "content": "x"}]), "messages.0.role", "'user' or 'assistant'"),
    (body(messages=[{"role": "user"}]), "messages.0.content", "Field required"),
    (body(messages=[{"role": "user", "content": [{"type": "document", "source": {}}]}]), "messages.0.content.0.type",
     "'document'"),
    (body(messages=[{"role": "user", "content": [{"text": "no type"}]}]), "messages.0.content.0.type", "Missing"),
    (body(messages=[{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]),
     "messages.0.content.0.type", "'tool_use'"),
    (body(messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "The answer is "}]),
     "messages.1.content", "trailing whitespace"),
    (body(messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]), "messages.1.content", "tool_use"),
    (body(messages=[{"role": "user", "content": [{"type": "image", "source": {"type": "base64",
                                                  "media_type": "image/png", "data": "AA"}}]}]),
     "messages.0.content.0", "does not accept images"),
    (body(system=[{"type": "image"}]), "system.0.type", "'image'"),
    (body(tools=[{"type": "web_search_20250305", "name": "web_search"}]), "tools.0.type", "Anthropic's own tools"),
    (body(tools=[{"name": "f"}]), "tools.0.input_schema", "Missing"),
    (body(tool_choice={"type": "maybe"}, tools=[WEATHER]), "tool_choice.type", "'maybe'"),
    (body(tool_choice={"type": "any"}), "tool_choice", "only allowed when 'tools'"),
    (body(thinking={"type": "enabled"}), "thinking.budget_tokens", "Missing"),
    (body(thinking={"type": "sometimes"}), "thinking.type", "'sometimes'"),
    (body(stop_sequences="##"), "stop_sequences", "array"),
    (body(temperature="hot"), "temperature", "number"),
    (b"[1]", None, "JSON object"),
])
def test_bad_bodies_are_400s_naming_the_field(raw, param, words):
    e = bad(raw)
    assert e.param == param and words in e.message, e
    assert json.loads(error_body(e))["error"]["type"] == "invalid_request_error"


GOOD = {"model": "m", "max_tokens": 64, "system": "s", "messages": [{"role": "user", "content": "hi"}],
        "tools": [WEATHER], "tool_choice": {"type": "auto"}, "thinking": {"type": "disabled"}, "stop_sequences": ["#"]}
BLOCK_TYPES = ["text", "image", "tool_use", "tool_result", "thinking", "redacted_thinking", "document", None]


def anthropic_mutate(rng) -> dict:
    from tests.protocol.test_protocol_fuzz import rand_value
    body = {k: v for k, v in GOOD.items() if rng.random() < 0.8}
    for _ in range(rng.randint(0, 3)):
        body[rng.choice(list(GOOD) + ["temperature", "top_k", "top_p", "stream", "metadata"])] = rand_value(rng)
    if rng.random() < 0.7:
        msgs = []
        for _ in range(rng.randint(0, 3)):
            blocks = [{k: v for k, v in {"type": rng.choice(BLOCK_TYPES), "text": rand_value(rng, 3),
                                         "id": rng.choice(["t", None, 1]), "name": rng.choice(["f", None]),
                                         "input": rng.choice([{}, None, "x"]), "tool_use_id": rng.choice(["t", None]),
                                         "content": rand_value(rng, 2), "thinking": rng.choice(["h", None]),
                                         "source": rng.choice([None, {"type": "base64", "media_type": "image/png",
                                                                      "data": "AA"}, {"type": "url", "url": 5}])
                                         }.items() if v is not None or rng.random() < 0.2}
                      for _ in range(rng.randint(0, 3))]
            msgs.append({"role": rng.choice(["user", "assistant", "system", 3]),
                         "content": blocks if rng.random() < 0.7 else rand_value(rng, 2)})
        body["messages"] = msgs
    return body


@pytest.mark.parametrize("seed", range(4))
def test_random_bodies_end_in_a_request_or_a_400(seed):
    import random
    rng = random.Random(3000 + seed)
    seen = set()
    for _ in range(400):
        raw = json.dumps(anthropic_mutate(rng)).encode()
        try:
            parse_messages_request(raw, defaults={"temperature": 0.6}, images_supported=rng.random() < 0.5)
            seen.add("ok")
        except ApiError as e:
            assert e.status == 400 and e.message
            assert json.loads(error_body(e))["error"]["type"] == "invalid_request_error"
            seen.add("400")
    assert seen == {"ok", "400"}
