"""Output schemas against the real CLI server (`python -m appliance` on a tiny random Qwen3 with the real Qwen
tokenizer), over raw HTTP: what llguidance compiles but refuses once it runs is a 400 naming the part before
any 200 (chat stream and non-stream, Ollama's `format`, Responses' `text.format`); the documented limits hold at
the limit and one past it; and a forced tool call whose parameters are a Pydantic model with a nested model
($defs / $ref) comes back parsed, on Chat and Responses, through the openai client."""
from __future__ import annotations

import json
import subprocess
from typing import Annotated

import openai
import pytest
from pydantic import BaseModel, Field

from tests.support.live_server import RawClient, chat_body, request_bytes, start_cli_server

LOOP = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
WIDE_OBJECT = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(600)}}
ANY_OF_300 = {"type": "array", "items": {"anyOf": [
    {"type": "object", "properties": {f"k{i}": {"type": "integer"}, "v": {"type": "string"}}} for i in range(300)]}}
REGEX = {"type": "object", "properties": {"r": {"type": "string", "pattern": "^((([a-z]{1,50}){1,50}){1,50})$"}},
         "required": ["r"]}
# (schema, the part named after the schema's own path, words of the message)
REFUSED = [(LOOP, ".$defs.a", "no JSON value can match it"),
           (WIDE_OBJECT, "", "too wide for the constraint parser"),
           (ANY_OF_300, ".items", "too wide for the constraint parser"),
           (REGEX, ".properties.r", "regular expression is too complex")]
IDS = ["ref-loop", "600-optional-properties", "items-anyOf-300-objects", "exploding-regex"]


@pytest.fixture(scope="module")
def port(tiny_qwen3_tied):
    proc, port = start_cli_server(tiny_qwen3_tied, "--queue", "8", stdout=subprocess.DEVNULL)
    yield port
    proc.kill()
    proc.wait()
    proc.stderr.close()


def post(port: int, path: str, body: dict) -> tuple[int, str | None, bytes]:
    """(status, Content-Type, the whole body as sent) of one request on its own connection."""
    c = RawClient(port, timeout=120)
    try:
        c.send(request_bytes("POST", path, body, {"Connection": "close"}))
        r = c.read_head()
        return r.status, r.header("content-type"), c.read_body(r)
    finally:
        c.close()


def chat(schema, **extra) -> dict:
    return chat_body("Reply with the data.", **{"max_tokens": 4, "temperature": 1.0, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}, **extra})


def assert_openai_400(status, ctype, raw, param, words):
    assert status == 400 and ctype.startswith("application/json"), (status, raw[:300])
    err = json.loads(raw)["error"]
    assert err["param"] == param and err["code"] == "invalid_schema", err
    assert words in err["message"] and f"'{param}'" in err["message"], err


def assert_still_serving(port):
    status, _, raw = post(port, "/v1/chat/completions", chat_body("Hi", max_tokens=2))
    assert status == 200 and json.loads(raw)["choices"][0]["finish_reason"] in ("length", "stop")


@pytest.mark.parametrize("schema, part, words", REFUSED, ids=IDS)
@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
def test_chat_refuses_before_the_200(port, schema, part, words, stream):
    status, ctype, raw = post(port, "/v1/chat/completions", chat(schema, stream=stream))
    assert b"data:" not in raw                                  # no event stream was started
    assert_openai_400(status, ctype, raw, "response_format.json_schema.schema" + part, words)
    assert_still_serving(port)


@pytest.mark.parametrize("schema, part, words", REFUSED, ids=IDS)
def test_ollama_format_refuses_before_the_200(port, schema, part, words):
    for stream in (False, True):
        status, ctype, raw = post(port, "/api/chat", {"model": "m", "stream": stream, "format": schema,
                                                      "messages": [{"role": "user", "content": "Data."}],
                                                      "options": {"num_predict": 4}})
        assert status == 400 and ctype.startswith("application/json"), (status, raw[:300])
        err = json.loads(raw)["error"]
        assert isinstance(err, str) and f"'format{part}'" in err and words in err, err


@pytest.mark.parametrize("schema, part, words", REFUSED, ids=IDS)
def test_responses_text_format_refuses_before_the_200(port, schema, part, words):
    for stream in (False, True):
        status, ctype, raw = post(port, "/v1/responses", {
            "model": "m", "input": "Data.", "stream": stream, "max_output_tokens": 16,
            "text": {"format": {"type": "json_schema", "name": "x", "schema": schema}}})
        assert b"event:" not in raw and b"data:" not in raw
        assert_openai_400(status, ctype, raw, "text.format.schema" + part, words)


def nested_objects(n: int) -> dict:
    s: dict = {"type": "boolean"}
    for _ in range(n):
        s = {"type": "object", "properties": {"a": s}, "required": ["a"], "additionalProperties": False}
    return s


def test_32_levels_of_nested_objects_at_the_limit_and_one_past(port):
    status, _, raw = post(port, "/v1/chat/completions", chat(nested_objects(32), max_tokens=400))
    body = json.loads(raw)
    assert status == 200, body
    assert body["choices"][0]["message"]["content"].startswith('{"a": {"a": {"a": ')
    status, ctype, raw = post(port, "/v1/chat/completions", chat(nested_objects(33)))
    err = json.loads(raw)["error"]
    assert status == 400 and err["param"] == "response_format.json_schema.schema" + ".properties.a" * 33, err
    assert "nested too deeply: at most 32 levels" in err["message"]


def test_5000_properties_and_enum_values_at_the_limit_and_one_past(port):
    def schema(n_props: int, n_enum: int) -> dict:
        props = {f"p{i}": {"type": "integer"} for i in range(n_props - 1)}
        props["e"] = {"enum": [f"v{i}" for i in range(n_enum)]}
        return {"type": "object", "properties": props, "required": sorted(props), "additionalProperties": False}

    status, _, raw = post(port, "/v1/chat/completions", chat(schema(5000, 5000)))
    assert status == 200 and json.loads(raw)["choices"][0]["message"]["content"].startswith('{"p0":')
    for n_props, n_enum, what in ((5001, 10, "5000 properties"), (10, 5001, "5000 enum / const values")):
        status, _, raw = post(port, "/v1/chat/completions", chat(schema(n_props, n_enum)))
        err = json.loads(raw)["error"]
        assert status == 400 and f"at most {what} in all" in err["message"], err


S = Annotated[str, Field(max_length=8)]       # a random model closes a string only when made to


class Loc(BaseModel):
    city: S
    zip: int = Field(ge=0, le=99999)


class Weather(BaseModel):
    """Weather for a place."""
    loc: Loc
    days: int = Field(ge=1, le=7)


@pytest.fixture()
def client(port):
    with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120) as c:
        yield c


def test_the_tool_schema_is_pydantics_refs_to_defs():
    params = openai.pydantic_function_tool(Weather)["function"]["parameters"]
    assert params["properties"]["loc"] == {"$ref": "#/$defs/Loc"} and "Loc" in params["$defs"]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "Weather"}}],
                         ids=["required", "named"])
def test_chat_forced_call_with_a_nested_pydantic_model(client, choice):
    for seed in (1, 2):
        r = client.chat.completions.parse(model="m", messages=[{"role": "user", "content": "Weather?"}],
                                          tools=[openai.pydantic_function_tool(Weather)], tool_choice=choice,
                                          temperature=1.0, seed=seed, max_tokens=200)
        assert r.choices[0].finish_reason == "tool_calls"
        call = r.choices[0].message.tool_calls[0]
        assert call.function.name == "Weather" and isinstance(call.function.parsed_arguments, Weather)
        assert Weather.model_validate_json(call.function.arguments) == call.function.parsed_arguments


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "Weather"}], ids=["required", "named"])
def test_responses_forced_call_with_a_nested_pydantic_model(client, choice):
    for seed in (1, 2):
        r = client.responses.parse(model="m", input="Weather?", tools=[openai.pydantic_responses_function_tool(Weather)],
                                   tool_choice=choice, temperature=1.0, max_output_tokens=200,
                                   extra_body={"seed": seed})
        calls = [o for o in r.output if o.type == "function_call"]
        assert len(calls) == 1 and calls[0].name == "Weather"
        assert isinstance(calls[0].parsed_arguments, Weather)
        assert Weather.model_validate_json(calls[0].arguments) == calls[0].parsed_arguments
