"""The Responses API's sans-I/O pieces: request parsing into the chat path, and the event stream of
ResponsesAssembler (the documented order, sequence numbers, reasoning / message / function_call items) loaded by
the official openai client's own event and response types."""
from __future__ import annotations

import itertools
import json

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from appliance.protocol.errors import ApiError
from appliance.protocol.responses_requests import parse_responses_request
from appliance.protocol.responses_stream import ResponsesAssembler
from appliance.protocol.stats import GenerationStats

STATS = GenerationStats(prompt_tokens=4, completion_tokens=3, prefill_ms=5.0, ttft_ms=6.0, decode_ms=4.0,
                        total_ms=12.0, tpot_ms=2.0, tok_s=500.0)
EVENT = TypeAdapter(ResponseStreamEvent)


def body(**kw) -> bytes:
    return json.dumps({"model": "m", "input": "hi", **kw}).encode()


def assembler(**kw) -> ResponsesAssembler:
    n = itertools.count(1)
    return ResponsesAssembler("m", 1700000000, {"temperature": 0.0, "top_p": 1.0}, clock=lambda: 1700000001.5,
                              new_id=lambda prefix: f"{prefix}_{next(n)}", **kw)


def parse_events(blobs: list[bytes]) -> list[dict]:
    out = []
    for blob in blobs:
        for ev in filter(None, blob.split(b"\n\n")):
            head, data = ev.split(b"\n", 1)
            obj = json.loads(data[len(b"data: "):])
            assert head == b"event: " + obj["type"].encode()
            EVENT.validate_python(obj)
            out.append(obj)
    return out


def test_input_items_become_chat_messages():
    r = parse_responses_request(json.dumps({"model": "m", "instructions": "Be brief.", "max_output_tokens": 64,
        "temperature": 0.2, "top_p": 0.9, "reasoning": {"effort": "none"}, "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "What is "},
                                         {"type": "input_image", "image_url": "data:image/png;base64,AAAA"},
                                         {"type": "input_text", "text": "this?"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
            {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{\"a\":1}"},
            {"type": "function_call", "call_id": "call_2", "name": "g", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "42"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "It is 42."}]},
            {"role": "developer", "content": "More."}],
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": True}]}).encode(),
        images_supported=True, context_length=4096)
    m = r.request.messages
    assert [x["role"] for x in m] == ["system", "user", "assistant", "tool", "assistant", "system"]
    assert m[1]["content"][1] == {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"},
                                  "_param": "input[0].content[1]"}   # the field errors about it name
    assert [c["function"]["name"] for c in m[2]["tool_calls"]] == ["f", "g"] and m[2]["reasoning_content"] == "hm"
    assert m[3] == {"role": "tool", "content": "42", "tool_call_id": "call_1"}
    assert r.request.max_tokens == 64 and r.request.sampling.temperature == 0.2
    assert r.request.template_kwargs == {"enable_thinking": False}
    assert r.request.tools == [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert r.echo["instructions"] == "Be brief." and r.echo["tools"][0]["strict"] is True
    s = parse_responses_request(body(stream=True))
    assert s.request.messages == [{"role": "user", "content": "hi"}] and s.request.stream


@pytest.mark.parametrize("extra, param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"store": True}, "store"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"background": True}, "background"),
    ({"input": None}, "input"),
    ({"input": []}, "input"),
    ({"input": 5}, "input"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": [{"type": "file_search_call"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
     "input[0].content[0].image_url"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"max_output_tokens": 8}, "max_output_tokens"),
    ({"max_output_tokens": 10**6}, "max_output_tokens"),
    ({"temperature": "warm"}, "temperature"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "function"}]}, "tools[0].name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": []}}}, "text.format.schema"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}},
     "tool_choice.name"),
    ({"reasoning": {"effort": "max"}}, "reasoning.effort"),
    ({"top_logprobs": 3}, "top_logprobs"),
])
def test_bad_requests_are_400_naming_the_field(extra, param):
    with pytest.raises(ApiError) as e:
        parse_responses_request(body(**extra), context_length=4096)
    assert e.value.status == 400 and e.value.param == param and e.value.type == "invalid_request_error"


def test_message_event_sequence_bytes():
    a = assembler()
    blobs = a.start() + [a.token("Hel"), a.token(""), a.token("lo")] + a.finish("stop", "!", STATS)
    assert blobs[2] == (b'event: response.output_item.added\ndata: {"type":"response.output_item.added",'
                        b'"sequence_number":2,"output_index":0,"item":{"id":"msg_2","type":"message","status":'
                        b'"in_progress","role":"assistant","content":[]}}\n\n'
                        b'event: response.content_part.added\ndata: {"type":"response.content_part.added",'
                        b'"sequence_number":3,"item_id":"msg_2","output_index":0,"content_index":0,"part":'
                        b'{"type":"output_text","text":"","annotations":[],"logprobs":[]}}\n\n'
                        b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
                        b'"sequence_number":4,"item_id":"msg_2","output_index":0,"content_index":0,"delta":"Hel",'
                        b'"logprobs":[]}\n\n')
    assert blobs[3] == b""                               # a token that releases no text sends nothing
    events = parse_events(blobs)
    assert [(e["type"], e["sequence_number"]) for e in events] == [(t, i) for i, t in enumerate([
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed"])]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    assert events[0]["response"]["id"] == "resp_1" and events[0]["response"]["completed_at"] is None
    assert [e["delta"] for e in events if e["type"].endswith(".delta")] == ["Hel", "lo", "!"]
    assert events[7]["text"] == "Hello!" and events[9]["item"]["status"] == "completed"
    final = Response.model_validate(events[-1]["response"])
    assert final.output_text == "Hello!" and final.status == "completed" and final.completed_at == 1700000001
    assert final.usage.input_tokens == 4 and final.usage.output_tokens == 3 and final.usage.total_tokens == 7


def test_reasoning_and_function_call_items():
    a = assembler(in_reasoning=True, tools=True)
    blobs = a.start()
    for piece in ["plan", "</think>", "\n\n", "Calling.", "<tool_call>", '{"name": "f", "arguments": {"x": 1}}',
                  "</tool_call>"]:
        blobs.append(a.token(piece))
    blobs += a.finish("stop", "", STATS)
    events = parse_events(blobs)
    kinds = [e["type"] for e in events]
    assert kinds == ["response.created", "response.in_progress",
                     "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
                     "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
                     "response.output_item.added", "response.content_part.added", "response.output_text.delta",
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.output_item.added", "response.function_call_arguments.delta",
                     "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = Response.model_validate(events[-1]["response"])
    assert [o.type for o in final.output] == ["reasoning", "message", "function_call"]
    assert final.output[0].content[0].text == "plan" and final.output_text == "Calling."
    call = final.output[2]
    assert (call.name, json.loads(call.arguments), call.call_id, call.id) == ("f", {"x": 1}, "call_4", "fc_5")
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.added"] == [0, 1, 2]
    assert final.usage.output_tokens_details.reasoning_tokens == 2


def test_incomplete_and_non_stream_object():
    a = assembler()
    blobs = a.start() + [a.token("Cut")] + a.finish("length", " off", STATS)
    events = parse_events(blobs)
    assert events[-1]["type"] == "response.incomplete"
    r = Response.model_validate(events[-1]["response"])
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete" and r.output_text == "Cut off"

    b = assembler()
    b.token("Hi")
    obj = b.response("stop", "", STATS)
    assert Response.model_validate(obj).output_text == "Hi" and obj["status"] == "completed"
    assert obj["store"] is False and obj["previous_response_id"] is None


def test_error_event():
    a = assembler()
    a.start()
    ev = parse_events([a.error_event(ApiError(500, "boom"))])[0]
    assert ev == {"type": "error", "sequence_number": 2, "code": "server_error", "message": "boom", "param": None}


def test_text_format_and_forced_tool_choice_are_output_formats():
    from appliance.protocol.structured import OutputFormat

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    r = parse_responses_request(body(text={"format": {"type": "json_schema", "name": "x", "schema": schema,
                                                      "strict": True}}), context_length=4096)
    assert r.request.output_format == OutputFormat("json_schema", schema, probes=(("text.format.schema", schema),))
    assert r.request.template_kwargs == {"enable_thinking": False}
    assert r.echo["text"] == {"format": {"type": "json_schema", "name": "x", "schema": schema, "strict": True}}
    r = parse_responses_request(body(text={"format": {"type": "json_object"}}, reasoning={"effort": "high"}),
                                context_length=4096)
    assert r.request.output_format == OutputFormat("json") and r.request.template_kwargs == {}
    tools = [{"type": "function", "name": "f", "parameters": schema}]
    r = parse_responses_request(body(tools=tools, tool_choice={"type": "function", "name": "f"}), context_length=4096)
    assert r.request.output_format == OutputFormat("tool_calls", tools=(("f", schema),), parallel=False,
                                                   probes=(("tools[0].parameters", schema),))
    assert r.echo["tool_choice"] == {"type": "function", "name": "f"}
    assert parse_responses_request(body(), context_length=4096).request.output_format is None


def test_function_call_cut_by_max_output_tokens():
    """The call's arguments are what the model produced inside the call; no `</tool_` in them, no message item."""
    for tool_format, toks in (("template", ["\n", "<tool_call>", '\n{"name": "get_weather", "arguments": ',
                                            '{"city": "Paris"}', "}\n</", "tool_"]),
                              ("generic", ['{"tool_call": {"name": "get_weather", "arguments": ', '{"city": "Par'])):
        a = assembler(tools=True, tool_format=tool_format)
        blobs = a.start() + [a.token(t) for t in toks] + a.finish("length", "", STATS)
        events = parse_events(blobs)
        assert [e["type"] for e in events] == [
            "response.created", "response.in_progress", "response.output_item.added",
            "response.function_call_arguments.delta", "response.function_call_arguments.done",
            "response.output_item.done", "response.incomplete"]
        final = Response.model_validate(events[-1]["response"])
        args = '{"city": "Paris"}' if tool_format == "template" else '{"city": "Par'
        assert [(o.type, o.name, o.arguments, o.status) for o in final.output] == \
            [("function_call", "get_weather", args, "incomplete")]
        assert final.incomplete_details.reason == "max_output_tokens"
