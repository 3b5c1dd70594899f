"""Chunk and response shapes: exact bytes, and loaded by the official openai client's pydantic types."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from appliance.protocol.chunks import (
    ChatChunks,
    CompletionChunks,
    chat_completion,
    model_list,
    new_completion_id,
    text_completion,
)
from appliance.protocol.logprobs import LogprobEntry, entry_from_engine
from appliance.protocol.sse import sse_event
from appliance.protocol.stats import GenerationStats

HEAD = b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1700000000,"model":"qwen3",'
STATS = GenerationStats(prompt_tokens=12, completion_tokens=5, prefill_ms=40.0, ttft_ms=52.5, decode_ms=40.0,
                        total_ms=100.0, tpot_ms=10.0, tok_s=100.0)
TIMINGS = (b'"timings":{"cache_n":0,"prompt_n":12,"prompt_ms":40.0,"prompt_per_token_ms":3.333,"prompt_per_second":300.0,'
           b'"predicted_n":5,"predicted_ms":60.0,"predicted_per_token_ms":12.0,"predicted_per_second":83.333,'
           b'"ttft_ms":52.5,"tpot_ms":10.0}')


@pytest.fixture
def cc():
    return ChatChunks("chatcmpl-1", "qwen3", 1700000000)


def test_role_frame_bytes(cc):
    assert sse_event(cc.role()) == HEAD + (b'"choices":[{"index":0,"delta":{"role":"assistant","content":""},'
                                           b'"logprobs":null,"finish_reason":null}]}\n\n')


def test_content_and_reasoning_delta_bytes(cc):
    assert sse_event(cc.delta(content="Hi")) == HEAD + (b'"choices":[{"index":0,"delta":{"content":"Hi"},'
                                                        b'"logprobs":null,"finish_reason":null}]}\n\n')
    assert sse_event(cc.delta(reasoning_content="hm")) == HEAD + (
        b'"choices":[{"index":0,"delta":{"reasoning_content":"hm"},"logprobs":null,"finish_reason":null}]}\n\n')


def test_finish_chunk_bytes_carry_llama_cpp_timings(cc):
    assert sse_event(cc.finish("stop", STATS)) == HEAD + (
        b'"choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":"stop"}],' + TIMINGS + b'}\n\n')
    # without timings the field is absent
    assert b"timings" not in sse_event(cc.finish("length"))


def test_usage_chunk_and_include_usage_nulls():
    cc = ChatChunks("chatcmpl-1", "qwen3", 1700000000, include_usage=True)
    assert sse_event(cc.delta(content="x")).endswith(b'"finish_reason":null}],"usage":null}\n\n')
    assert sse_event(cc.usage(12, 5)) == HEAD + (
        b'"choices":[],"usage":{"prompt_tokens":12,"completion_tokens":5,"total_tokens":17}}\n\n')


def test_extension_events_bytes(cc):
    assert sse_event(cc.metrics(STATS)) == (
        b'data: {"object":"chat.completion.metrics","metrics":{"prompt_tokens":12,"completion_tokens":5,'
        b'"ttft_ms":52.5,"prefill_ms":40.0,"tpot_ms":10.0,"decode_ms":40.0,"total_ms":100.0,"tok_s":100.0,'
        b'"prefill_tok_s":300.0,"queue_ms":0.0,"cached_tokens":0}}\n\n')
    assert sse_event(cc.tokens([1, 2, 151645])) == \
        b'data: {"object":"chat.completion.tokens","tokens":[1,2,151645]}\n\n'


def test_logprobs_in_a_delta():
    cc = ChatChunks("chatcmpl-1", "qwen3", 1700000000)
    e = LogprobEntry("é".encode(), -0.25, ((b"\xc3\xa9", -0.25), (b"e", -1.5)))
    assert sse_event(cc.delta(content="é", logprobs=[e])) == HEAD + (
        '"choices":[{"index":0,"delta":{"content":"é"},"logprobs":{"content":[{"token":"é","logprob":-0.25,'
        '"bytes":[195,169],"top_logprobs":[{"token":"é","logprob":-0.25,"bytes":[195,169]},'
        '{"token":"e","logprob":-1.5,"bytes":[101]}]}]},"finish_reason":null}]}\n\n').encode()


def test_partial_utf8_token_and_infinite_logprob():
    e = LogprobEntry(b"\xe4\xbd", float("-inf"), ((b"\xe4\xbd", float("-inf")),))
    item = ChatChunks("c", "m", 0).delta(content="", logprobs=[e])["choices"][0]["logprobs"]["content"][0]
    assert item == {"token": "bytes:\\xe4\\xbd", "logprob": -9999.0, "bytes": [228, 189],
                    "top_logprobs": [{"token": "bytes:\\xe4\\xbd", "logprob": -9999.0, "bytes": [228, 189]}]}


def test_entry_from_engine_token_logprob():
    table = {5: b"a", 6: b"b"}
    tl = SimpleNamespace(token_id=5, logprob=-0.1, top=[(5, -0.1), (6, -2.4)])
    assert entry_from_engine(tl, table.__getitem__) == LogprobEntry(b"a", -0.1, ((b"a", -0.1), (b"b", -2.4)))


def test_a_whole_stream_loads_as_openai_chunks():
    cc = ChatChunks("chatcmpl-1", "qwen3", 1700000000, include_usage=True)
    e = LogprobEntry(b"Hi", -0.5, ((b"Hi", -0.5),))
    events = [cc.role(), cc.delta(reasoning_content="think"), cc.delta(content="Hi", logprobs=[e]),
              cc.finish("stop", STATS), cc.usage(12, 5, reasoning_tokens=1)]
    parsed = [ChatCompletionChunk.model_validate(json.loads(sse_event(ev)[6:])) for ev in events]
    assert parsed[0].choices[0].delta.role == "assistant"
    assert parsed[2].choices[0].delta.content == "Hi"
    assert parsed[2].choices[0].logprobs.content[0].bytes == [72, 105]
    assert parsed[1].choices[0].delta.model_extra == {"reasoning_content": "think"}
    assert parsed[3].choices[0].finish_reason == "stop"
    assert parsed[3].model_extra["timings"]["predicted_n"] == 5
    assert parsed[4].choices == [] and parsed[4].usage.total_tokens == 17
    assert parsed[4].usage.completion_tokens_details.reasoning_tokens == 1


def test_non_stream_chat_completion_bytes_and_openai_type():
    e = LogprobEntry(b"Hi", -0.5, ())
    body = chat_completion("chatcmpl-1", "qwen3", 1700000000, content="Hi", reasoning_content="r",
                           finish_reason="stop", prompt_tokens=12, completion_tokens=5, timings=STATS,
                           logprobs=[e])
    assert sse_event(body) == (
        b'data: {"id":"chatcmpl-1","object":"chat.completion","created":1700000000,"model":"qwen3",'
        b'"choices":[{"index":0,"message":{"role":"assistant","content":"Hi","reasoning_content":"r"},'
        b'"logprobs":{"content":[{"token":"Hi","logprob":-0.5,"bytes":[72,105],"top_logprobs":[]}]},'
        b'"finish_reason":"stop"}],"usage":{"prompt_tokens":12,"completion_tokens":5,"total_tokens":17},'
        + TIMINGS + b'}\n\n')
    c = ChatCompletion.model_validate(body)
    assert c.choices[0].message.content == "Hi"
    assert c.choices[0].message.model_extra == {"reasoning_content": "r"}
    assert c.usage.total_tokens == 17


def test_chat_completion_with_tool_calls_loads():
    calls = [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]
    body = chat_completion("chatcmpl-1", "qwen3", 1, content=None, finish_reason="tool_calls", prompt_tokens=1,
                           completion_tokens=2, tool_calls=calls)
    c = ChatCompletion.model_validate(body)
    assert c.choices[0].message.tool_calls[0].function.arguments == "{\"x\": 1}"
    assert c.choices[0].message.content is None
    assert "reasoning_content" not in body["choices"][0]["message"]


def test_text_completion_stream_and_body():
    cc = CompletionChunks("cmpl-1", "qwen3", 1700000000)
    assert sse_event(cc.text("Hel")) == (
        b'data: {"id":"cmpl-1","object":"text_completion","created":1700000000,"model":"qwen3",'
        b'"choices":[{"text":"Hel","index":0,"logprobs":null,"finish_reason":null}]}\n\n')
    fin = cc.finish("length", STATS)
    assert fin["choices"] == [{"text": "", "index": 0, "logprobs": None, "finish_reason": "length"}]
    Completion.model_validate(fin)   # (a mid-stream chunk has finish_reason null, which only the client's
                                     # lenient stream parser accepts: see test_protocol_client.py)
    es = [LogprobEntry(b"He", -0.1, ((b"He", -0.1), (b"Ha", -2.0))), LogprobEntry(b"\xe4\xbd", -0.2),
          LogprobEntry(b"\xa0!", -0.3)]
    body = text_completion("cmpl-1", "qwen3", 1, text="ab" + "He你!", finish_reason="stop", prompt_tokens=3,
                           completion_tokens=3, logprobs=es, text_offset=2)
    lp = body["choices"][0]["logprobs"]
    assert lp == {"tokens": ["He", "bytes:\\xe4\\xbd", "bytes:\\xa0\\x21"], "token_logprobs": [-0.1, -0.2, -0.3],
                  "top_logprobs": [{"He": -0.1, "Ha": -2.0}, {}, {}], "text_offset": [2, 4, 4]}
    c = Completion.model_validate(body)
    assert c.choices[0].logprobs.text_offset == [2, 4, 4]


def test_stats_from_an_engine_finish_event():
    t = SimpleNamespace(prefill_ms=40.0, ttft_ms=52.5, decode_ms=[10.0, 10.0, 10.0, 10.0], total_ms=100.0,
                        tpot_ms=10.0, tok_s=100.0)
    fin = SimpleNamespace(prompt_tokens=12, completion_tokens=5, timings=t)
    assert GenerationStats.from_finish(fin) == STATS


def test_rates_of_empty_intervals_are_zero():
    s = GenerationStats(0, 0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    assert s.timings()["prompt_per_second"] == 0.0 and s.timings()["predicted_per_token_ms"] == 0.0
    assert GenerationStats(1, 1, float("nan"), 0, 0, 0, float("inf"), 0).metrics()["prefill_ms"] == 0.0


def test_ids_and_model_list():
    a, b = new_completion_id(), new_completion_id("cmpl")
    assert a.startswith("chatcmpl-") and b.startswith("cmpl-") and a[9:] != b[5:]
    from openai.types import Model
    ml = model_list(["qwen3-0.6b"], 1700000000)
    assert ml == {"object": "list", "data": [{"id": "qwen3-0.6b", "object": "model", "created": 1700000000,
                                              "owned_by": "kestrel"}]}
    Model.model_validate(ml["data"][0])
