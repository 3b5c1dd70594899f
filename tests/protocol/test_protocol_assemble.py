"""ChatAssembler / CompletionAssembler: engine events -> exact SSE bytes and non-stream bodies; a round trip
through Qwen3's real chat template and tokenizer recovers reasoning, content and tool calls."""
from __future__ import annotations

import itertools
import json

import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from appliance.protocol.assemble import ChatAssembler, CompletionAssembler
from appliance.protocol.chunks import ChatChunks, CompletionChunks
from appliance.protocol.logprobs import LogprobEntry
from appliance.protocol.stats import GenerationStats

STATS = GenerationStats(4, 3, 5.0, 6.0, 4.0, 12.0, 2.0, 500.0)


def events(raw: bytes | list[bytes]) -> list:
    """The JSON of SSE events: of one bytes (a token's event), or of a list from start() / finish(), whose every
    item must be exactly one event (Generation writes each on its own)."""
    if isinstance(raw, list):
        assert all(x.count(b"\n\n") == 1 and x.endswith(b"\n\n") for x in raw), raw
        raw = b"".join(raw)
    if not raw:
        return []
    assert raw.endswith(b"\n\n")
    out = []
    for block in raw[:-2].split(b"\n\n"):
        assert block.startswith(b"data: ")
        body = block[6:]
        out.append("[DONE]" if body == b"[DONE]" else json.loads(body))
    return out


def ids():
    n = itertools.count()
    return lambda: f"call_{next(n)}"


def test_chat_stream_bytes_one_event_per_token():
    a = ChatAssembler(ChatChunks("c", "m", 1, include_usage=True), include_metrics=True, include_tokens=True)
    head = b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,'
    assert a.start() == [head + b'"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],"usage":null}\n\n']
    assert a.token("<think>") == b""
    assert a.token("\nhm") == head + b'"delta":{"reasoning_content":"hm"},"logprobs":null,"finish_reason":null}],"usage":null}\n\n'
    assert a.token("</think>\n\nHi") == head + b'"delta":{"content":"Hi"},"logprobs":null,"finish_reason":null}],"usage":null}\n\n'
    tail = events(a.finish("length", "!", STATS, [1, 2, 3, 4], [5, 6, 7]))
    assert [e if e == "[DONE]" else (e.get("object"), e.get("choices")) for e in tail] == [
        ("chat.completion.chunk", [{"index": 0, "delta": {"content": "!"}, "logprobs": None, "finish_reason": None}]),
        ("chat.completion.chunk", [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}]),
        ("chat.completion.chunk", []),
        ("chat.completion.metrics", None),
        ("chat.completion.tokens", None),
        "[DONE]"]
    assert tail[1]["timings"]["predicted_n"] == 3 and tail[2]["usage"]["total_tokens"] == 7
    assert tail[4]["tokens"] == [1, 2, 3, 4, 5, 6, 7]
    # "<think>", "\nhm" and "</think>..." were spent in the think block
    assert tail[2]["usage"]["completion_tokens_details"] == {"reasoning_tokens": 3}


def test_minimal_stream_tail_is_finish_then_done():
    a = ChatAssembler(ChatChunks("c", "m", 1), reasoning=False)
    assert a.token("<think>") != b""        # no splitting: the tag is content
    tail = a.finish("stop", "", STATS)
    assert len(events(tail)) == len(tail)      # one event per item
    raw = b"".join(tail)
    assert raw.endswith(b'"finish_reason":"stop"}],"timings":' + json.dumps(
        STATS.timings(), separators=(",", ":")).encode() + b'}\n\ndata: [DONE]\n\n')
    assert raw.count(b"data: ") == 2


def test_held_back_tokens_pass_their_logprobs_on():
    a = ChatAssembler(ChatChunks("c", "m", 1), logprobs=True)
    e1, e2, e3 = LogprobEntry(b"<", -1.0), LogprobEntry(b"b", -2.0), LogprobEntry(b"c", -3.0)
    assert a.token("<", e1) == b""                       # could start <think>
    ev = events(a.token("b", e2))[0]
    assert ev["choices"][0]["delta"] == {"content": "<b"}
    assert [x["token"] for x in ev["choices"][0]["logprobs"]["content"]] == ["<", "b"]
    assert a.token("\xe4", None) != b""
    body = a.response("stop", "", STATS)
    assert [x["logprob"] for x in body["choices"][0]["logprobs"]["content"]] == [-1.0, -2.0]
    a2 = ChatAssembler(ChatChunks("c", "m", 1), logprobs=True)
    assert a2.token("", e3) == b""                       # e.g. half a character
    fin = events(a2.finish("stop", "", STATS))
    assert fin[0]["choices"][0]["logprobs"]["content"][0]["token"] == "c"   # released before the finish chunk
    ChatCompletionChunk.model_validate(fin[0])


def test_tool_call_stream_and_response_match():
    toks = ["<think>\nneed weather\n</think>\n\n", "<tool_call>", "\n{\"name\": \"w\", \"arguments\": ",
            "{\"c\": 1}}\n</tool_call>", "\n<tool_call>\n{\"name\": \"v\", \"arguments\": {}}\n</tool_call>"]
    s = ChatAssembler(ChatChunks("c", "m", 1), tools=True, new_id=ids())
    evs = [events(s.token(t)) for t in toks]
    evs = [e for e in evs if e]
    deltas = [e[0]["choices"][0]["delta"] for e in evs]
    assert deltas == [{"reasoning_content": "need weather"},
                      {"tool_calls": [{"index": 0, "id": "call_0", "type": "function",    # announced with the
                                       "function": {"name": "w", "arguments": "{\"c\": 1}"}}]},   # token of `{`
                      {"tool_calls": [{"index": 1, "id": "call_1", "type": "function",
                                       "function": {"name": "v", "arguments": "{}"}}]}]
    for e in evs:
        ChatCompletionChunk.model_validate(e[0])
    fin = events(s.finish("stop", "", STATS))
    assert fin[0]["choices"][0]["finish_reason"] == "tool_calls"

    n = ChatAssembler(ChatChunks("c", "m", 1), tools=True, new_id=ids())
    for t in toks:
        n.token(t)
    body = n.response("stop", "", STATS)
    c = ChatCompletion.model_validate(body)
    assert c.choices[0].finish_reason == "tool_calls" and c.choices[0].message.content is None
    assert [(t.id, t.function.name, t.function.arguments) for t in c.choices[0].message.tool_calls] == \
        [("call_0", "w", "{\"c\": 1}"), ("call_1", "v", "{}")]
    assert body["choices"][0]["message"]["reasoning_content"] == "need weather"


def test_non_stream_plain_and_no_reasoning_field_without_think():
    a = ChatAssembler(ChatChunks("c", "m", 1))
    for t in ["Hel", "lo"]:
        a.token(t)
    body = a.response("length", " you", STATS)
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hello you"}
    assert "completion_tokens_details" not in body["usage"]
    assert body["choices"][0]["finish_reason"] == "length" and body["timings"] == STATS.timings()


def test_completion_stream_with_echo_and_logprobs():
    a = CompletionAssembler(CompletionChunks("x", "m", 1, include_usage=True), echo="Say:", logprobs=True)
    assert events(a.start())[0]["choices"][0]["text"] == "Say:"
    e1, e2, e3 = LogprobEntry(b" \xe4\xbd", -0.5), LogprobEntry(b"\xa0", -0.25), LogprobEntry(b"!", -0.1)
    assert a.token("", e1) == b""
    ev = events(a.token(" 你", e2))[0]["choices"][0]
    assert ev["text"] == " 你"
    assert ev["logprobs"] == {"tokens": ["bytes:\\x20\\xe4\\xbd", "bytes:\\xa0"], "token_logprobs": [-0.5, -0.25],
                              "top_logprobs": [{}, {}], "text_offset": [4, 5]}
    ev = events(a.token("!", e3))[0]["choices"][0]
    assert ev["logprobs"]["text_offset"] == [6]
    tail = events(a.finish("stop", "", STATS))
    assert tail[0]["choices"][0]["finish_reason"] == "stop" and tail[1]["usage"]["completion_tokens"] == 3
    assert tail[2] == "[DONE]"


def test_completion_non_stream():
    a = CompletionAssembler(CompletionChunks("x", "m", 1))
    assert a.start() == []
    a.token("a")
    a.token("b")
    body = a.response("length", "c", STATS)
    assert body["choices"][0] == {"text": "abc", "index": 0, "logprobs": None, "finish_reason": "length"}


@pytest.fixture(scope="module")
def hf_tokenizer(qwen_tokenizer_dir, qwen3_chat_template):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(qwen_tokenizer_dir)
    tok.chat_template = qwen3_chat_template
    return tok


def test_round_trip_through_the_real_template_and_tokenizer(hf_tokenizer):
    """Render an assistant turn with Qwen3's own template (transformers), tokenize it with the real tokenizer,
    stream the tokens back through the assembler: the turn's fields come back out."""
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "weather",
                                               "parameters": {"type": "object"}}}]
    turn = {"role": "assistant", "reasoning_content": "用户想知道天气。\nCall the tool.",
            "content": "Let me check.",
            "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                                                             "arguments": {"city": "Zürich"}}}]}
    msgs = [{"role": "user", "content": "天气?"}, turn]
    before = hf_tokenizer.apply_chat_template(msgs[:1], tools=tools, tokenize=False, add_generation_prompt=True)
    full = hf_tokenizer.apply_chat_template(msgs, tools=tools, tokenize=False)
    assert full.startswith(before)
    generated = full[len(before):].removesuffix("<|im_end|>\n")
    ids = hf_tokenizer.encode(generated, add_special_tokens=False)
    # per-token text the way an incremental detokenizer releases it (whole characters only)
    texts, prev = [], ""
    for i in range(1, len(ids) + 1):
        s = hf_tokenizer.decode(ids[:i])
        if s.endswith("\ufffd"):
            texts.append("")
            continue
        texts.append(s[len(prev):])
        prev = s
    assert "".join(texts) == generated
    for stream in (True, False):
        a = ChatAssembler(ChatChunks("c", "m", 1), tools=True, new_id=ids_factory())
        raw = b"".join(a.start() + [a.token(t) for t in texts])
        if stream:
            evs = events(raw + b"".join(a.finish("stop", "", STATS)))
            chunks = [ChatCompletionChunk.model_validate(e) for e in evs[:-1]]
            reasoning = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks)
            content = "".join(c.choices[0].delta.content or "" for c in chunks)
            state = ChatCompletionStreamState()          # the openai client's own accumulation
            for chunk in chunks:
                state.handle_chunk(chunk)
            calls = state.get_final_completion().choices[0].message.tool_calls
            assert len([tc for c in chunks for tc in (c.choices[0].delta.tool_calls or []) if tc.id]) == 1
            finish = chunks[-1].choices[0].finish_reason
        else:
            c = ChatCompletion.model_validate(a.response("stop", "", STATS))
            reasoning = c.choices[0].message.model_extra["reasoning_content"]
            content, calls, finish = c.choices[0].message.content, c.choices[0].message.tool_calls, \
                c.choices[0].finish_reason
        assert reasoning == turn["reasoning_content"]
        assert content == turn["content"]
        assert [(tc.function.name, json.loads(tc.function.arguments)) for tc in calls] == \
            [("get_weather", {"city": "Zürich"})]
        assert finish == "tool_calls"


def ids_factory():
    return ids()


def test_for_request_wires_the_parsed_flags():
    from appliance.protocol.requests import parse_chat_request, parse_completion_request
    req = parse_chat_request(json.dumps({
        "messages": [{"role": "user", "content": "x"}], "stream": True, "logprobs": True,
        "stream_options": {"include_usage": True, "include_tokens": True},
        "tools": [{"type": "function", "function": {"name": "f"}}]}).encode())
    a = ChatAssembler.for_request(req, model="m", created=5, in_reasoning=True)
    assert a.chunks.completion_id.startswith("chatcmpl-") and a.chunks.include_usage
    assert a.router.calls == [] and a.router._tools is not None and a._logprobs and a.include_tokens and not a.include_metrics
    assert events(a.token("r</think>", LogprobEntry(b"r", -1.0)))[0]["choices"][0]["delta"] == \
        {"reasoning_content": "r"}
    creq = parse_completion_request(b'{"prompt": "p", "echo": true, "stream": true}')
    c = CompletionAssembler.for_request(creq, model="m", created=5, echo_text="p")
    assert c.chunks.completion_id.startswith("cmpl-") and c.echo == "p" and not c._logprobs


# The grammar-forced call of issue 22 cut by max_tokens (Qwen3 template, tiny random model): the tokens as decoded
CUT_IN_NAME = ["\n", "<tool_call>", "\n", '{"', "name", '":', ' "', "get", "_weather"]
CUT_IN_TAG = CUT_IN_NAME + ['",', ' "', "arguments", '":', ' {"', "city", '":', ' "', "Paris", '"}}', "\n", "</",
                            "tool", "_"]


def test_call_cut_by_max_tokens_leaks_no_markup_stream_and_non_stream():
    for toks, calls in ((CUT_IN_NAME, []), (CUT_IN_TAG, [("get_weather", '{"city": "Paris"}')])):
        s = ChatAssembler(ChatChunks("c", "m", 1), tools=True, new_id=ids())
        evs = [e for t in toks for e in events(s.token(t))] + events(s.finish("length", "", STATS))
        for e in evs[:-1]:
            ChatCompletionChunk.model_validate(e)
        deltas = [e["choices"][0]["delta"] for e in evs[:-1]]
        assert [d for d in deltas if "content" in d] == []
        assert evs[-2]["choices"][0]["finish_reason"] == "length" and evs[-1] == "[DONE]"
        if calls:
            fragments = ['{"', "city", '":', ' "', "Paris", '"}']      # the `}` of the block and `\n</tool_`: none
            assert deltas == [{"tool_calls": [{"index": 0, "id": "call_0", "type": "function",
                                               "function": {"name": "get_weather", "arguments": '{"'}}]},
                              *({"tool_calls": [{"index": 0, "function": {"arguments": f}}]} for f in fragments[1:]),
                              {}]
        else:
            assert deltas == [{}]

        n = ChatAssembler(ChatChunks("c", "m", 1), tools=True, new_id=ids())
        for t in toks:
            n.token(t)
        body = n.response("length", "", STATS)
        msg = body["choices"][0]["message"]
        assert body["choices"][0]["finish_reason"] == "length"
        assert msg["content"] == ("" if not calls else None)
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls", [])] == calls
        ChatCompletion.model_validate(body)
