"""The Responses API end to end: the official openai client (responses.create stream and non-stream, the
responses.stream helper, a function-tool round trip, input_image) against the real server on tiny real
checkpoints, and the event stream checked byte for byte on the wire. The scripted checkpoint
(tests/support/scripted_model.py) thinks and calls a tool with thinking on, and answers with thinking off."""
from __future__ import annotations

import base64
import json
import re

import openai
import pytest

from tests.support.live_server import LiveServer, RawClient, request_bytes
from tests.support.scripted_model import ANSWER, THINKING
from tests.support.tiny_vl import cached_qwen3_vl, image_bytes

WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
NO_THINKING = {"effort": "none"}

# response.created ... response.completed for input "Weather?" with thinking off, as sent on the wire; ids and
# timestamps are replaced by {RESP}, {MSG}, {T} and the served model's name by {MODEL}.
EXPECTED_WIRE = (
    'event: response.created\ndata: {"type":"response.created","sequence_number":0,"response":{"id":"{'
    'RESP}","object":"response","created_at":{T},"status":"in_progress","background":false,"completed'
    '_at":null,"error":null,"incomplete_details":null,"instructions":null,"max_output_tokens":16,"mod'
    'el":"{MODEL}","output":[],"parallel_tool_calls":true,"previous_response_id":null,"reasoning":{"e'
    'ffort":"none","summary":null},"store":false,"temperature":0,"text":{"format":{"type":"text"}},"t'
    'ool_choice":"auto","tools":[],"top_p":0.95,"truncation":"disabled","usage":null,"user":null,"met'
    'adata":{}}}\n\n'
    'event: response.in_progress\ndata: {"type":"response.in_progress","sequence_number":1,"response":'
    '{"id":"{RESP}","object":"response","created_at":{T},"status":"in_progress","background":false,"c'
    'ompleted_at":null,"error":null,"incomplete_details":null,"instructions":null,"max_output_tokens"'
    ':16,"model":"{MODEL}","output":[],"parallel_tool_calls":true,"previous_response_id":null,"reason'
    'ing":{"effort":"none","summary":null},"store":false,"temperature":0,"text":{"format":{"type":"te'
    'xt"}},"tool_choice":"auto","tools":[],"top_p":0.95,"truncation":"disabled","usage":null,"user":n'
    'ull,"metadata":{}}}\n\n'
    'event: response.output_item.added\ndata: {"type":"response.output_item.added","sequence_number":2'
    ',"output_index":0,"item":{"id":"{MSG}","type":"message","status":"in_progress","role":"assistant'
    '","content":[]}}\n\n'
    'event: response.content_part.added\ndata: {"type":"response.content_part.added","sequence_number"'
    ':3,"item_id":"{MSG}","output_index":0,"content_index":0,"part":{"type":"output_text","text":"","'
    'annotations":[],"logprobs":[]}}\n\n'
    'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","sequence_number":4'
    ',"item_id":"{MSG}","output_index":0,"content_index":0,"delta":" Sunny","logprobs":[]}\n\n'
    'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","sequence_number":5'
    ',"item_id":"{MSG}","output_index":0,"content_index":0,"delta":" in","logprobs":[]}\n\n'
    'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","sequence_number":6'
    ',"item_id":"{MSG}","output_index":0,"content_index":0,"delta":" Paris","logprobs":[]}\n\n'
    'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","sequence_number":7'
    ',"item_id":"{MSG}","output_index":0,"content_index":0,"delta":" today","logprobs":[]}\n\n'
    'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","sequence_number":8'
    ',"item_id":"{MSG}","output_index":0,"content_index":0,"delta":".","logprobs":[]}\n\n'
    'event: response.output_text.done\ndata: {"type":"response.output_text.done","sequence_number":9,"'
    'item_id":"{MSG}","output_index":0,"content_index":0,"text":" Sunny in Paris today.","logprobs":['
    ']}\n\n'
    'event: response.content_part.done\ndata: {"type":"response.content_part.done","sequence_number":1'
    '0,"item_id":"{MSG}","output_index":0,"content_index":0,"part":{"type":"output_text","text":" Sun'
    'ny in Paris today.","annotations":[],"logprobs":[]}}\n\n'
    'event: response.output_item.done\ndata: {"type":"response.output_item.done","sequence_number":11,'
    '"output_index":0,"item":{"id":"{MSG}","type":"message","status":"completed","role":"assistant","'
    'content":[{"type":"output_text","text":" Sunny in Paris today.","annotations":[],"logprobs":[]}]'
    '}}\n\n'
    'event: response.completed\ndata: {"type":"response.completed","sequence_number":12,"response":{"i'
    'd":"{RESP}","object":"response","created_at":{T},"status":"completed","background":false,"comple'
    'ted_at":{T},"error":null,"incomplete_details":null,"instructions":null,"max_output_tokens":16,"m'
    'odel":"{MODEL}","output":[{"id":"{MSG}","type":"message","status":"completed","role":"assistant"'
    ',"content":[{"type":"output_text","text":" Sunny in Paris today.","annotations":[],"logprobs":[]'
    '}]}],"parallel_tool_calls":true,"previous_response_id":null,"reasoning":{"effort":"none","summar'
    'y":null},"store":false,"temperature":0,"text":{"format":{"type":"text"}},"tool_choice":"auto","t'
    'ools":[],"top_p":0.95,"truncation":"disabled","usage":{"input_tokens":14,"input_tokens_details":'
    '{"cached_tokens":0,"cache_write_tokens":0},"output_tokens":6,"output_tokens_details":{"reasoning'
    '_tokens":0},"total_tokens":20},"user":null,"metadata":{}}}\n\n'
)


@pytest.fixture(scope="module")
def server(scripted_qwen3):
    with LiveServer(scripted_qwen3) as s:
        yield s


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def test_event_stream_byte_for_byte(server):
    c = RawClient(server.port)
    c.send(request_bytes("POST", "/v1/responses", {"model": "m", "input": "Weather?", "reasoning": NO_THINKING,
                                                   "temperature": 0, "stream": True, "max_output_tokens": 16}))
    r = c.read_head()
    c.read_events(r)
    c.close()
    assert r.status == 200 and r.header("content-type") == "text/event-stream; charset=utf-8"
    wire = b"".join(e for _, e in r.events).decode()
    resp_id = re.search(r'"id":"(resp_[0-9a-f]{24})"', wire).group(1)
    msg_id = re.search(r'"id":"(msg_[0-9a-f]{24})"', wire).group(1)
    created = re.search(r'"created_at":(\d+)', wire).group(1)
    completed = re.search(r'"completed_at":(\d+)', wire).group(1)
    assert int(completed) >= int(created)
    expected = EXPECTED_WIRE.replace("{RESP}", resp_id).replace("{MSG}", msg_id)
    expected = expected.replace("{MODEL}", server.api_cfg.model_name).replace('"completed_at":{T}',
                                                                               f'"completed_at":{completed}')
    assert wire == expected.replace("{T}", created)
    assert len(r.events) == 13                     # one event per write, five deltas for five text tokens


def test_create_non_stream_and_stream(client):
    r = client.responses.create(model="m", input="Weather?", reasoning=NO_THINKING, temperature=0)
    assert r.status == "completed" and r.output_text == ANSWER and r.usage.output_tokens == 6
    assert [o.type for o in r.output] == ["message"] and r.id.startswith("resp_")
    events = list(client.responses.create(model="m", input="Weather?", reasoning=NO_THINKING, temperature=0,
                                          stream=True))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == ANSWER
    assert events[-1].response.output_text == ANSWER
    details = events[-1].response.usage.input_tokens_details      # the same prompt again: its KV was reused
    assert 0 < details.cached_tokens < r.usage.input_tokens
    cut = client.responses.create(model="m", input=[{"role": "user", "content": "Weather?"}],
                                  reasoning=NO_THINKING, temperature=0, max_output_tokens=16,
                                  instructions="Answer briefly.")
    assert cut.instructions == "Answer briefly." and cut.usage.input_tokens > r.usage.input_tokens


def test_stream_helper_reasoning_and_function_call_round_trip(client):
    with client.responses.stream(model="m", input="Weather in Paris?", tools=[WEATHER], temperature=0) as stream:
        kinds = [e.type for e in stream]
        first = stream.get_final_response()
    assert "response.reasoning_text.delta" in kinds and "response.function_call_arguments.done" in kinds
    assert [o.type for o in first.output] == ["reasoning", "function_call"]
    assert first.output[0].content[0].text == THINKING
    call = first.output[1]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert first.usage.output_tokens_details.reasoning_tokens > 0

    # the round trip: the model's output items and the tool's result go back as input; thinking off, it answers
    follow = client.responses.create(
        model="m", tools=[WEATHER], temperature=0, reasoning=NO_THINKING,
        input=[{"role": "user", "content": "Weather in Paris?"}, *[o.model_dump(exclude_none=True) for o in first.output],
               {"type": "function_call_output", "call_id": call.call_id, "output": "18 C and sunny"}])
    assert follow.output_text == ANSWER
    assert follow.usage.input_tokens > first.usage.input_tokens


def test_errors_and_stateless_refusals(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="m", input="x", previous_response_id="resp_123")
    assert e.value.body["param"] == "previous_response_id" and "stateless" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="m", input="x", store=True)
    assert e.value.body["param"] == "store"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="m", input="x", text={"format": {"type": "json_schema", "name": "x", "schema": {
            "type": "object", "properties": {"when": {"type": "string", "format": "no-such-format"}}}}})
    assert e.value.body["param"] == "text.format" and "no-such-format" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="m", input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}])
    assert "does not accept images" in e.value.body["message"]


def test_input_image_on_tiny_qwen3_vl_matches_chat_completions(tmp_path_factory):
    png = image_bytes(120, 90, "PNG", seed=6)
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    with LiveServer(cached_qwen3_vl(tmp_path_factory)) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="none")
        r = c.responses.create(model="vl", temperature=0, max_output_tokens=16, input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": url}, {"type": "input_text", "text": "Describe."}]}])
        cc = c.chat.completions.create(model="vl", temperature=0, max_tokens=16, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Describe."}]}])
        assert r.output_text == (cc.choices[0].message.content or "")
        assert r.usage.input_tokens == cc.usage.prompt_tokens and r.usage.output_tokens == cc.usage.completion_tokens
        text_only = c.responses.create(model="vl", temperature=0, max_output_tokens=16, input="Describe.")
        assert r.usage.input_tokens > text_only.usage.input_tokens + 4
        # a bad image is named as the client sent it (input[0].content[1]), not as the chat message it became
        with pytest.raises(openai.BadRequestError) as e:
            c.responses.create(model="vl", instructions="Be brief.", input=[{"role": "user", "content": [
                {"type": "input_text", "text": "Describe."},
                {"type": "input_image", "image_url": "data:image/png;base64,bm90IGEgcGljdHVyZQ=="}]}])
        err = e.value.body
        assert err["code"] == "invalid_image" and err["param"] == "input", err
        assert "Invalid image in 'input[0].content[1]'" in err["message"], err
