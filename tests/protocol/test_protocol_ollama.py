"""The Ollama API's sans-I/O pieces: request parsing (options mapping, messages, think, format, load requests) and
the NDJSON assemblers, byte for byte, loaded by the official ollama client's own response types."""
from __future__ import annotations

import json

import ollama
import pytest

from appliance.protocol.errors import ApiError
from appliance.protocol.ollama_requests import image_data_uri, parse_ollama_chat, parse_ollama_generate
from appliance.protocol.ollama_stream import OllamaChatAssembler, OllamaGenerateAssembler, durations
from appliance.protocol.stats import GenerationStats

STATS = GenerationStats(prompt_tokens=4, completion_tokens=3, prefill_ms=5.0, ttft_ms=6.0, decode_ms=4.0,
                        total_ms=12.0, tpot_ms=2.0, tok_s=500.0, queue_ms=1.5)
T = "2026-01-02T03:04:05.000006Z"


def chat(**body) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}).encode()


def test_options_map_to_sampling_and_limits():
    o = parse_ollama_chat(chat(options={"temperature": 0, "top_p": 0.5, "top_k": 7, "min_p": 0.1, "seed": 3,
                                        "repeat_penalty": 1.2, "presence_penalty": 0.5, "frequency_penalty": 0.25,
                                        "num_predict": 9, "stop": ["x", "", "y"], "num_ctx": 100000,
                                        "mirostat": 2, "num_gpu": 99}),
                          defaults={"temperature": 0.6, "top_k": 20}, context_length=4096)
    s = o.request.sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.seed) == (0, 0.5, 7, 0.1, 3)
    assert (s.repetition_penalty, s.presence_penalty, s.frequency_penalty) == (1.2, 0.5, 0.25)
    assert o.request.max_tokens == 9 and o.request.stop == ("x", "y") and o.num_ctx == 4096
    assert o.request.stream is True                              # Ollama streams by default
    d = parse_ollama_chat(chat(stream=False), defaults={"temperature": 0.6, "top_k": 20}, context_length=4096)
    assert d.request.sampling.temperature == 0.6 and d.request.sampling.top_k == 20 and not d.request.stream
    for n in (-1, -2):
        assert parse_ollama_chat(chat(options={"num_predict": n}), context_length=64).request.max_tokens is None
    assert parse_ollama_chat(chat(options={"num_predict": 10**9}), context_length=64).request.max_tokens == 64


@pytest.mark.parametrize("body, param", [
    ({"options": {"temperature": "hot"}}, "options.temperature"),
    ({"options": {"top_k": 1.5}}, "options.top_k"),
    ({"options": {"repeat_penalty": -1}}, "options.repeat_penalty"),
    ({"options": {"num_predict": 0}}, "options.num_predict"),
    ({"options": {"num_predict": -5}}, "options.num_predict"),   # only -1 and -2 mean something (issue 22)
    ({"options": {"num_predict": -3}}, "options.num_predict"),
    ({"options": {"num_ctx": 0}}, "options.num_ctx"),
    ({"options": {"stop": 3}}, "options.stop"),
    ({"options": []}, "options"),
    ({"format": {"type": "object", "properties": {"a": {"enum": list(range(6000))}}}}, "format.properties.a.enum"),
    ({"format": ["json"]}, "format"),
    ({"format": "yaml"}, "format"),
    ({"think": "maybe"}, "think"),
    ({"keep_alive": "soon"}, "keep_alive"),
    ({"model": ""}, "model"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "x", "images": ["aGk="]}]}, "messages[0].images[0]"),  # as sent
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
])
def test_bad_fields_are_400_naming_the_field(body, param):
    with pytest.raises(ApiError) as e:
        parse_ollama_chat(chat(**body), context_length=4096)
    assert e.value.status == 400 and e.value.param == param and e.value.message


def test_messages_images_tools_and_think():
    o = parse_ollama_chat(json.dumps({"model": "m", "think": True, "keep_alive": "5m", "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "what is this?", "images": ["iVBORw0KGgo="]},
        {"role": "assistant", "content": "", "thinking": "hmm",
         "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]},
        {"role": "tool", "content": "42", "tool_name": "f"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}).encode(),
        images_supported=True)
    m = o.request.messages
    assert m[1]["content"] == [{"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="},
                                "_param": "messages[1].images[0]"},   # the field errors about it name
                               {"type": "text", "text": "what is this?"}]
    assert m[2]["tool_calls"][0]["function"] == {"name": "f", "arguments": {"a": 1}}
    assert m[2]["reasoning_content"] == "hmm" and m[3] == {"role": "tool", "content": "42", "name": "f"}
    assert o.request.template_kwargs == {"enable_thinking": True} and o.request.tools[0]["function"]["name"] == "f"
    assert parse_ollama_chat(chat(think=False)).request.template_kwargs == {"enable_thinking": False}
    assert parse_ollama_chat(chat()).request.template_kwargs == {}
    assert image_data_uri("/9j/4AAQ").startswith("data:image/jpeg;base64,")


def test_load_and_unload_requests():
    assert parse_ollama_chat(b'{"model": "m", "messages": []}').load_only
    u = parse_ollama_chat(b'{"model": "m", "messages": [], "keep_alive": 0}')
    assert u.load_only and u.unload
    assert parse_ollama_generate(b'{"model": "m", "keep_alive": "0s"}').unload
    assert not parse_ollama_generate(b'{"model": "m", "prompt": "x", "keep_alive": "-1m"}').load_only


def test_generate_request():
    g = parse_ollama_generate(b'{"model": "m", "prompt": "hi", "system": "sys", "context": [1, 2]}')
    assert [x["role"] for x in g.request.messages] == ["system", "user"] and g.context == (1, 2)
    r = parse_ollama_generate(b'{"model": "m", "prompt": "<|im_start|>x", "raw": true}')
    assert r.raw and r.request.messages == [] and r.prompt == "<|im_start|>x"
    for body, param in [(b'{"model": "m", "prompt": "x", "suffix": "y"}', "suffix"),
                        (b'{"model": "m", "prompt": "x", "template": "{{ .Prompt }}"}', "template"),
                        (b'{"model": "m", "prompt": "x", "context": [-1]}', "context[0]"),
                        (b'{"model": "m", "prompt": "x", "raw": true, "images": ["aGk="]}', "images"),
                        (b'{"model": "m", "prompt": 5}', "prompt")]:
        with pytest.raises(ApiError) as e:
            parse_ollama_generate(body, images_supported=True)
        assert e.value.status == 400 and e.value.param == param


def test_chat_stream_bytes():
    a = OllamaChatAssembler("m", tools=True, clock=lambda: T, new_id=lambda: "call_1")
    out = a.start()
    for piece in ["<think>", "why", "</think>", "Hi", "<tool_call>", '{"name": "f", "arguments": {"x": 1}}',
                  "</tool_call>"]:
        out.append(a.token(piece))
    out += a.finish("stop", "", STATS)
    head = f'{{"model":"m","created_at":"{T}",'
    assert out == [
        head.encode() + b'"message":{"role":"assistant","content":""},"done":false}\n',
        b"",
        head.encode() + b'"message":{"role":"assistant","content":"","thinking":"why"},"done":false}\n',
        b"",
        head.encode() + b'"message":{"role":"assistant","content":"Hi"},"done":false}\n',
        b"", b"",
        head.encode() + b'"message":{"role":"assistant","content":"","tool_calls":[{"id":"call_1","function":'
                        b'{"index":0,"name":"f","arguments":{"x":1}}}]},"done":false}\n',
        head.encode() + b'"message":{"role":"assistant","content":""},"done":true,"done_reason":"stop",'
                        b'"total_duration":13500000,"load_duration":1500000,"prompt_eval_count":4,'
                        b'"prompt_eval_duration":5000000,"eval_count":3,"eval_duration":4000000}\n']
    for line in filter(None, out):
        ollama.ChatResponse.model_validate(json.loads(line))


def test_chat_stream_bytes_in_the_generic_tool_format():
    """A template without a tool section: the JSON reply's text and the JSON call, as Ollama sends them."""
    head = f'{{"model":"m","created_at":"{T}",'.encode()
    for pieces, lines in (
            (['{"response": "', "Hi", ' \\"you\\"', '"}'],
             [b'"message":{"role":"assistant","content":"Hi"},"done":false}\n',
              b'"message":{"role":"assistant","content":" \\"you\\""},"done":false}\n']),
            (['{"tool_call": {"name": "f", "arguments": ', '{"x": 1}', "}}"],
             [b'"message":{"role":"assistant","content":"","tool_calls":[{"id":"call_1","function":'
              b'{"index":0,"name":"f","arguments":{"x":1}}}]},"done":false}\n'])):
        a = OllamaChatAssembler("m", tools=True, tool_format="generic", clock=lambda: T, new_id=lambda: "call_1")
        out = [x for x in (a.token(p) for p in pieces) if x] + a.finish("stop", "", STATS)[:-1]
        assert out == [head + line for line in lines]


def test_chat_and_generate_non_stream_objects():
    a = OllamaChatAssembler("m", in_reasoning=True, clock=lambda: T)
    for piece in ["plan", "</think>", "\n\nDone"]:
        a.token(piece)
    r = ollama.ChatResponse.model_validate(a.response("length", "!", STATS))
    assert r.message.thinking == "plan" and r.message.content == "Done!" and r.done_reason == "length"
    assert r.eval_count == 3 and r.prompt_eval_duration == 5_000_000 and r.total_duration == 13_500_000

    g = OllamaGenerateAssembler("m", [7, 8], clock=lambda: T)
    lines = [*g.start(), g.token("A"), *g.finish("stop", "B", STATS, [7, 8], [1, 2])]
    assert lines[-2] == f'{{"model":"m","created_at":"{T}","response":"B","done":false}}\n'.encode()
    last = json.loads(lines[-1])
    assert last["context"] == [7, 8, 1, 2] and last["response"] == "" and last["done"] is True
    assert "".join(json.loads(x)["response"] for x in lines) == "AB"
    g2 = OllamaGenerateAssembler("m", [7], clock=lambda: T)
    g2.token("A")
    body = g2.response("stop", "B", STATS, completion_ids=[5])
    assert body["response"] == "AB" and body["context"] == [7, 5]
    assert durations(STATS)["eval_duration"] == 4_000_000


def test_format_is_an_output_format_and_turns_thinking_off_unless_asked():
    from appliance.protocol.structured import OutputFormat

    o = parse_ollama_chat(chat(format="json"), context_length=4096)
    assert o.request.output_format == OutputFormat("json") and o.request.template_kwargs == {"enable_thinking": False}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    o = parse_ollama_chat(chat(format=schema, think=True), context_length=4096)
    assert o.request.output_format == OutputFormat("json_schema", schema, probes=(("format", schema),))
    assert o.request.template_kwargs == {"enable_thinking": True}
    assert parse_ollama_chat(chat(), context_length=4096).request.output_format is None
