"""Structured output end to end: the openai client's parse/stream helpers and LangChain against the real server on a
tiny random Qwen3 at temperature 1.0 (random weights: only the constraint can make the output valid)."""
from __future__ import annotations

import json
from enum import Enum
from typing import Annotated, Literal, Optional, Union

import openai
import pytest
from pydantic import BaseModel, Field

from tests.support.live_server import LiveServer

# A random model does not close a string by itself (its closing quote is one token in ~150k), so the schemas
# bound their strings; everything else (numbers, enums, arrays, nesting, recursion) ends by the grammar alone.
S = Annotated[str, Field(max_length=8)]


class Color(str, Enum):
    red = "red"
    green = "green"


class Inner(BaseModel):
    a: int
    b: S


class Link(BaseModel):
    value: int
    next: Optional["Link"]


class Level3(BaseModel):
    leaf: bool


class Level2(BaseModel):
    inner: Level3
    tag: S


class M1(BaseModel):
    name: S


class M2(BaseModel):
    n: int


class M3(BaseModel):
    ok: bool


class M4(BaseModel):
    x: float


class M5(BaseModel):
    color: Literal["red", "green", "blue"]


class M6(BaseModel):
    color: Color


class M7(BaseModel):
    tags: list[S] = Field(max_length=3)


class M8(BaseModel):
    nums: list[int] = Field(max_length=4)


class M9(BaseModel):
    inner: Inner


class M10(BaseModel):
    items: list[Inner] = Field(max_length=2)


class M11(BaseModel):
    maybe: Optional[int]


class M12(BaseModel):
    either: Union[int, S]


class M13(BaseModel):
    top: Level2
    count: int


class M14(BaseModel):
    a: int
    b: bool
    c: S
    d: float
    e: Literal["x", "y"]
    f: Optional[bool]


class M15(BaseModel):
    flags: list[bool] = Field(min_length=1, max_length=3)


class M16(BaseModel):
    level: Literal[1, 2, 3]


class M17(BaseModel):
    chain: Link


class M18(BaseModel):
    percent: int = Field(ge=0, le=100)


class M19(BaseModel):
    maybe_inner: Optional[Inner]


class M20(BaseModel):
    code: str = Field(pattern=r"^[a-z]{2,5}-[0-9]{1,3}$")
    matrix: list[Annotated[list[int], Field(max_length=2)]] = Field(max_length=2)


SCHEMAS = [M1, M2, M3, M4, M5, M6, M7, M8, M9, M10, M11, M12, M13, M14, M15, M16, M17, M18, M19, M20]
MESSAGES = [{"role": "user", "content": "Reply with the data."}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "unit": {"type": "string", "enum": ["c", "f"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "unit", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"type": "string", "enum": ["utc", "cet"]}},
             "required": ["zone"], "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def server(tiny_qwen3_tied):
    with LiveServer(tiny_qwen3_tied, queue=8) as s:
        yield s


@pytest.fixture()
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120) as c:
        yield c


@pytest.mark.parametrize("model", SCHEMAS, ids=[m.__name__ for m in SCHEMAS])
def test_parse_validates_at_temperature_1(client, model):
    for seed in (1, 2):
        resp = client.chat.completions.parse(model="m", messages=MESSAGES, response_format=model, temperature=1.0,
                                             seed=seed, max_tokens=400)
        msg = resp.choices[0].message
        assert resp.choices[0].finish_reason == "stop", msg.content
        assert isinstance(msg.parsed, model)
        assert model.model_validate_json(msg.content) == msg.parsed


def test_unconstrained_random_output_is_not_json(client):
    """The control: the same model and prompt without a constraint does not produce the JSON."""
    resp = client.chat.completions.create(model="m", messages=MESSAGES, temperature=1.0, seed=1, max_tokens=40)
    with pytest.raises(ValueError):
        M1.model_validate_json(resp.choices[0].message.content or "")


def test_json_object_mode(client):
    """json_object: every answer that ends is a JSON object, and one cut off by max_tokens is the start of one. A
    random model's strings rarely end (see S above), so about half of these seeds run into max_tokens."""
    stopped = 0
    for seed in range(10):
        resp = client.chat.completions.create(model="m", messages=MESSAGES, temperature=1.0, seed=seed,
                                              max_tokens=120, response_format={"type": "json_object"})
        content = resp.choices[0].message.content
        if resp.choices[0].finish_reason == "stop":
            stopped += 1
            assert isinstance(json.loads(content), dict)
        else:
            assert content.startswith('{"') and resp.usage.completion_tokens == 120
    assert stopped >= 1


def test_forced_named_tool_call(client):
    for seed in range(4):
        resp = client.chat.completions.create(
            model="m", messages=MESSAGES, tools=TOOLS, temperature=1.0, seed=seed, max_tokens=200,
            tool_choice={"type": "function", "function": {"name": "get_weather"}})
        calls = resp.choices[0].message.tool_calls
        assert len(calls) == 1 and calls[0].function.name == "get_weather"
        args = json.loads(calls[0].function.arguments)
        assert set(args) == {"city", "unit", "days"} and args["unit"] in ("c", "f") and 1 <= args["days"] <= 7
        assert len(args["city"]) <= 10 and calls[0].id.startswith("call_") and calls[0].type == "function"


def test_required_tool_choice_calls_some_tool(client):
    names = set()
    for seed in range(6):
        resp = client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS, temperature=1.0,
                                              seed=seed, max_tokens=300, tool_choice="required")
        calls = resp.choices[0].message.tool_calls
        assert calls and resp.choices[0].finish_reason == "tool_calls"
        for c in calls:
            names.add(c.function.name)
            args = json.loads(c.function.arguments)
            assert set(args) == ({"zone"} if c.function.name == "get_time" else {"city", "unit", "days"})
    assert names <= {"get_weather", "get_time"}


def _stream_calls(client, **kw):
    chunks = list(client.chat.completions.create(model="m", messages=MESSAGES, stream=True, **kw))
    calls: dict[int, dict] = {}
    for ch in chunks:
        for tc in (ch.choices[0].delta.tool_calls if ch.choices else None) or []:
            if tc.index not in calls:                       # the first delta of a call names it
                assert tc.id and tc.type == "function" and tc.function.name
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "args": tc.function.arguments or ""}
            else:
                assert tc.id is None and tc.function.name is None
                calls[tc.index]["args"] += tc.function.arguments
    return chunks, [calls[i] for i in sorted(calls)]


def test_streamed_fragments_reassemble_to_the_non_stream_arguments(client):
    n_fragmented = 0
    for seed in range(4):
        kw = dict(tools=TOOLS, temperature=1.0, seed=seed, max_tokens=300, tool_choice="required")
        chunks, streamed = _stream_calls(client, **kw)
        whole = client.chat.completions.create(model="m", messages=MESSAGES, **kw).choices[0].message.tool_calls
        assert [(c["name"], c["args"]) for c in streamed] == [(c.function.name, c.function.arguments) for c in whole]
        n_fragmented += sum(1 for ch in chunks for tc in (ch.choices[0].delta.tool_calls if ch.choices else None)
                            or [] if tc.id is None)
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert n_fragmented > 4                                # arguments really arrive in pieces


def test_openai_stream_helpers_accept_the_tool_call_stream(client):
    class GetWeather(BaseModel):
        city: S
        unit: Literal["c", "f"]

    tool = openai.pydantic_function_tool(GetWeather)
    kw = dict(model="m", messages=MESSAGES, tools=[tool], temperature=1.0, seed=5, max_tokens=200,
              tool_choice={"type": "function", "function": {"name": "GetWeather"}})
    with client.chat.completions.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_completion()
    call = final.choices[0].message.tool_calls[0]
    assert isinstance(call.function.parsed_arguments, GetWeather)
    assert any(e.type == "tool_calls.function.arguments.delta" for e in events)
    done = [e for e in events if e.type == "tool_calls.function.arguments.done"]
    assert len(done) == 1 and done[0].arguments == call.function.arguments
    whole = client.chat.completions.parse(**kw).choices[0].message.tool_calls[0]
    assert whole.function.arguments == call.function.arguments and whole.function.parsed_arguments is not None

    with client.chat.completions.stream(model="m", messages=MESSAGES, response_format=M14, temperature=1.0,
                                        seed=3, max_tokens=300) as stream:
        parsed = stream.get_final_completion().choices[0].message.parsed
    assert isinstance(parsed, M14)


def test_responses_api_text_format_and_forced_tool(client):
    """The Responses API: client.responses.parse(text_format=Model), and a forced function call."""
    for seed in (1, 2):
        r = client.responses.parse(model="m", input="Reply with the data.", text_format=M13, temperature=1.0,
                                   max_output_tokens=300, extra_body={"seed": seed})
        assert isinstance(r.output_parsed, M13) and r.status == "completed"
    r = client.responses.create(model="m", input="Weather?", temperature=1.0, max_output_tokens=200,
                                tools=[{"type": "function", **TOOLS[0]["function"]}],
                                tool_choice={"type": "function", "name": "get_weather"})
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert set(json.loads(calls[0].arguments)) == {"city", "unit", "days"}


def closed(schema):
    """A Pydantic JSON schema with additionalProperties false on every object (an open object lets a random model
    add keys whose names never end)."""
    if isinstance(schema, dict):
        out = {k: closed(v) for k, v in schema.items()}
        if out.get("type") == "object":
            out["additionalProperties"] = False
        return out
    return [closed(v) for v in schema] if isinstance(schema, list) else schema


def test_ollama_client_format_schema_and_json(server):
    """Ollama's `format` (what Home Assistant's AI Task sends): a schema, and "json"."""
    import ollama

    client = ollama.Client(host=server.url)
    for seed in (1, 2, 3):
        r = client.chat(model="m", messages=MESSAGES, format=closed(M14.model_json_schema()),
                        options={"temperature": 1.0, "seed": seed, "num_predict": 300})
        assert r.done_reason == "stop" and isinstance(M14.model_validate_json(r.message.content), M14)
        chunks = list(client.generate(model="m", prompt="Data:", format=closed(M9.model_json_schema()), stream=True,
                                      options={"temperature": 1.0, "seed": seed, "num_predict": 300}))
        assert isinstance(M9.model_validate_json("".join(c.response for c in chunks)), M9)
    r = client.chat(model="m", messages=MESSAGES, format="json", options={"temperature": 1.0, "seed": 0,
                                                                         "num_predict": 120})
    assert r.message.content.startswith("{")


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(server, method):
    from langchain_openai import ChatOpenAI

    class Person(BaseModel):
        """A person."""
        name: S = Field(description="the name")
        age: int = Field(ge=0, le=120)
        role: Literal["admin", "user"]

    llm = ChatOpenAI(base_url=server.url + "/v1", api_key="none", model="m", temperature=1.0, max_tokens=200,
                     max_retries=0, seed=7)
    out = llm.with_structured_output(Person, method=method).invoke("Describe a person.")
    assert isinstance(out, Person) and 0 <= out.age <= 120


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"d": {"type": "string", "format": "no-such-format"}}}}}},
     "response_format", "no-such-format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}}, "response_format", "missing"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"e": {"enum": list(range(6000))}}}}}},
     "response_format.json_schema.schema.properties.e.enum", "enum"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": json.loads(
        '{"type": "array", "items": ' * 40 + '{}' + '}' * 40)}}}, "response_format.json_schema.schema", "nested"),
    ({"tools": TOOLS[:1], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name", "nope"),
    ({"tool_choice": "required"}, "tool_choice", "tools"),
])
def test_bad_schemas_are_a_400_naming_the_part(client, body, param, words):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2, **body)
    err = info.value.body
    assert info.value.status_code == 400 and err["param"].startswith(param) and words in err["message"], err
    ok = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)
    assert ok.choices[0].finish_reason in ("length", "stop")      # the server is fine afterwards


def test_thinking_on_thinks_first_then_follows_the_constraint(scripted_qwen3):
    """Thinking explicitly on: the grammar lets the model's own <think> block through (the scripted checkpoint
    thinks "Let me check"), then holds it to the forced call / the schema; thinking left unset is off."""
    from tests.support.scripted_model import THINKING

    with LiveServer(scripted_qwen3, queue=2) as s, \
            openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=120) as c:
        on = {"chat_template_kwargs": {"enable_thinking": True}}
        r = c.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS, temperature=0, max_tokens=120,
                                      tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                      extra_body=on)
        msg = r.choices[0].message
        assert msg.model_extra["reasoning_content"] == THINKING
        assert [t.function.name for t in msg.tool_calls] == ["get_weather"]
        assert set(json.loads(msg.tool_calls[0].function.arguments)) == {"city", "unit", "days"}
        r = c.chat.completions.parse(model="m", messages=MESSAGES, response_format=M5, temperature=0,
                                     max_tokens=120, extra_body=on)
        assert r.choices[0].message.model_extra["reasoning_content"] == THINKING
        assert isinstance(r.choices[0].message.parsed, M5)
        r = c.chat.completions.parse(model="m", messages=MESSAGES, response_format=M5, temperature=0, max_tokens=120)
        assert "reasoning_content" not in (r.choices[0].message.model_extra or {})
        assert isinstance(r.choices[0].message.parsed, M5)
