"""The generic tool format for chat templates without a tool section: the request as such a template gets it
(system prompt, tool turns as text, the grammar), the prompt SmolLM2's own template renders from it, the grammar
over a real tokenizer, and GenericToolCallParser's pieces for every shape, split and cut."""
from __future__ import annotations

import itertools
import json

import llguidance
import pytest

from appliance.engine.chat_template import ChatTemplate
from appliance.engine.constraint import grammar_for, grammar_tokenizer
from appliance.engine.tokenizer import Tokenizer
from appliance.protocol.generic_tool_calls import GenericToolCallParser
from appliance.protocol.generic_tools import generic_tool_request, tool_turns_as_text
from appliance.protocol.requests import parse_chat_request
from appliance.protocol.structured import OutputFormat

# SmolLM2-135M-Instruct's template (its GGUF's tokenizer.chat_template): no tool section
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
                                            "parameters": PARAMS}}
TIME = {"type": "function", "function": {"name": "get_time"}}
USER = [{"role": "user", "content": "Weather in Paris?"}]
TOOLS_TEXT = ('You can call tools. Each line below is one tool: its name, what it does, and the JSON Schema of its '
              'arguments.\n{"name": "get_weather", "description": "Current weather of a city", "parameters": '
              '{"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}\n'
              '{"name": "get_time"}\n\nAnswer with one JSON object and nothing else.')
ONE = '{"tool_call": {"name": "<tool name>", "arguments": {...}}}'


def request(**body):
    return generic_tool_request(parse_chat_request(json.dumps({"messages": USER, **body}).encode()))


def test_templates_are_probed_for_a_tool_section(qwen3_chat_template):
    assert ChatTemplate(qwen3_chat_template).renders_tools is True
    assert ChatTemplate(SMOLLM2_TEMPLATE).renders_tools is False
    assert ChatTemplate("{{ raise_exception('no') }}").renders_tools is False


def test_auto_lists_the_tools_and_allows_a_response():
    req = request(tools=[WEATHER, TIME])
    assert req.tool_format == "generic" and req.template_kwargs == {"enable_thinking": False}
    assert req.messages == [{"role": "system", "content": TOOLS_TEXT + f' To call a tool: {ONE}. To reply to the '
                                                                      f'user: {{"response": "<your reply>"}}'},
                            *USER]
    empty = {"type": "object", "properties": {}}
    assert req.output_format == OutputFormat("generic_tool_calls", schema={"type": "string"},
                                             tools=(("get_weather", PARAMS), ("get_time", empty)), parallel=False,
                                             probes=(("tools[0].function.parameters", PARAMS),
                                                     ("tools[1].function.parameters", empty)))


def test_required_named_parallel_and_response_format():
    req = request(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=True,
                  messages=[{"role": "system", "content": "Be brief."}, *USER])
    many = '{"tool_calls": [{"name": "<tool name>", "arguments": {...}}]}'
    assert req.messages[0] == {"role": "system", "content": f"Be brief.\n\n{TOOLS_TEXT} Call a tool: {many} (one "
                                                            f"or more calls)"}
    assert req.output_format.schema is None and req.output_format.parallel is True
    named = request(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}},
                    parallel_tool_calls=True)
    assert named.messages[0]["content"].endswith(
        ' Call the tool get_weather: {"tool_call": {"name": "get_weather", "arguments": {...}}}')
    assert named.output_format == OutputFormat("generic_tool_calls", tools=(("get_weather", PARAMS),), parallel=False,
                                               probes=(("tools[0].function.parameters", PARAMS),))
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
    fmt = request(tools=[WEATHER], response_format={"type": "json_schema", "json_schema": {"schema": schema}})
    assert fmt.output_format.schema == schema
    assert fmt.messages[0]["content"].endswith(
        '. To reply to the user: {"response": <your reply: JSON following the schema {"type": "object", '
        '"properties": {"ok": {"type": "boolean"}}}>}')
    assert request(tools=[WEATHER], response_format={"type": "json_object"}).output_format.schema == \
        {"type": "object"}
    explicit = request(tools=[WEATHER], chat_template_kwargs={"enable_thinking": True})
    assert explicit.template_kwargs == {"enable_thinking": True}


HISTORY = [*USER,
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                 "arguments": '{"city": "Paris"}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]


def test_tool_turns_become_text_the_template_renders():
    req = request(messages=HISTORY, tools=[WEATHER])
    assert req.messages[1:] == [
        *USER,
        {"role": "assistant", "content": '{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}'},
        {"role": "user", "content": '{"tool_response": {"tool": "get_weather", "tool_call_id": "call_1", '
                                    '"content": "18 C"}}'}]
    none = request(messages=HISTORY, tools=[WEATHER], tool_choice="none")    # tools dropped, the history kept
    assert none.tool_format == "template" and none.output_format is None and none.messages == req.messages[1:]
    two = [{"role": "assistant", "content": "Both.", "tool_calls": [
        {"type": "function", "function": {"name": "a", "arguments": {"x": 1}}},
        {"type": "function", "function": {"name": "b", "arguments": "not json"}}]},
        {"role": "tool", "name": "a", "content": "1"}]
    assert tool_turns_as_text(two, many=False) == [
        {"role": "assistant", "content": 'Both.\n{"tool_calls": [{"name": "a", "arguments": {"x": 1}}, '
                                         '{"name": "b", "arguments": "not json"}]}'},
        {"role": "user", "content": '{"tool_response": {"tool": "a", "content": "1"}}'}]
    plain = parse_chat_request(json.dumps({"messages": USER}).encode())
    assert generic_tool_request(plain) is plain


def test_smollm2_template_renders_the_tools_and_the_turns():
    req = request(messages=HISTORY, tools=[WEATHER])
    prompt = ChatTemplate(SMOLLM2_TEMPLATE).render(req.messages, tools=req.tools, add_generation_prompt=True,
                                                   **req.template_kwargs)
    assert prompt == (
        "<|im_start|>system\n" + TOOLS_TEXT.replace('\n{"name": "get_time"}', "") +
        f' To call a tool: {ONE}. To reply to the user: {{"response": "<your reply>"}}<|im_end|>\n'
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        '<|im_start|>assistant\n{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}<|im_end|>\n'
        '<|im_start|>user\n{"tool_response": {"tool": "get_weather", "tool_call_id": "call_1", "content": "18 C"}}'
        "<|im_end|>\n<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def tok(qwen_tokenizer_dir):
    return Tokenizer.from_dir(qwen_tokenizer_dir)


def accepts(tok, fmt, text: str) -> bool:
    llt = grammar_tokenizer(tok, 151936, (151645, 151643))
    m = llguidance.LLMatcher(llt, grammar_for(fmt, tok, llt), log_level=0)
    ids = tok.encode(text)
    return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()


def test_grammar_is_the_generic_format(tok):
    auto = request(tools=[WEATHER, TIME]).output_format
    call = '{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}'
    assert accepts(tok, auto, call) and accepts(tok, auto, '{"response": "Hi \\"you\\"\\n"}')
    assert accepts(tok, auto, '{"tool_call": {"name": "get_time", "arguments": {}}}')
    assert not accepts(tok, auto, '{"tool_call": {"name": "get_date", "arguments": {}}}')
    assert not accepts(tok, auto, '{"tool_call": {"name": "get_weather", "arguments": {}}}')   # city required
    assert not accepts(tok, auto, 'Hi') and not accepts(tok, auto, '{"tool_calls": [' + call[14:-1] + ']}')
    required = request(tools=[WEATHER], tool_choice="required", parallel_tool_calls=True).output_format
    two = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "A"}}, ' \
          '{"name": "get_weather", "arguments": {"city": "B"}}]}'
    assert accepts(tok, required, two) and not accepts(tok, required, '{"response": "no"}')
    fmt = request(tools=[WEATHER], response_format={"type": "json_object"}).output_format
    assert accepts(tok, fmt, '{"response": {"a": 1}}') and not accepts(tok, fmt, '{"response": "text"}')
    refs = {"type": "function", "function": {"name": "t", "parameters": {   # Pydantic's $defs resolve per tool
        "$defs": {"C": {"enum": ["x"]}}, "type": "object", "properties": {"c": {"$ref": "#/$defs/C"}}}}}
    fmt = request(tools=[WEATHER, refs]).output_format
    assert accepts(tok, fmt, '{"tool_call": {"name": "t", "arguments": {"c": "x"}}}')
    assert not accepts(tok, fmt, '{"tool_call": {"name": "t", "arguments": {"c": "y"}}}')


def ids():
    n = itertools.count()
    return lambda: f"call_{next(n)}"


def run(pieces: list[str]) -> tuple[list, GenericToolCallParser]:
    p = GenericToolCallParser(ids())
    out = [x for piece in pieces for x in p.push(piece)] + p.flush()
    return out, p


def call(i, name):
    return ("call", {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": ""}})


def test_string_response_streams_its_decoded_text():
    out, p = run(['{"', 'response', '": "', 'Hi', ' \\"you', '\\"\\', 'n', 'é\\u00e9', '"}'])
    assert out == [("content", "Hi"), ("content", ' "you'), ("content", '"'), ("content", "\n"),
                   ("content", "éé")] and p.calls == []


def test_calls_stream_their_arguments_and_end_with_them():
    out, p = run(['{"tool_call": {"name": "get_weather", "arguments": ', '{"city": ', '"Paris"}', '}}'])
    assert out == [call(0, "get_weather"), ("args", '{"city": '), ("args", '"Paris"}'), ("done", p.calls[0])]
    assert p.calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    out, p = run(['{"tool_calls": [{"name": "a", "arguments": {"x": [1, "]}"]}}, {"name": "b", "arguments": {}}]}'])
    assert [c["function"] for c in p.calls] == [{"name": "a", "arguments": '{"x": [1, "]}"]}'},
                                                {"name": "b", "arguments": "{}"}]
    assert [k for k, _ in out] == ["call", "args", "done", "call", "args", "done"]
    out, p = run(['{"response": {"ok": true}}'])
    assert out == [("content", '{"ok": true}')]


SHAPES = [('{"response": "Sunny \\u2600 in \\"Paris\\""}', "Sunny \u2600 in \"Paris\"", []),
          ('{"tool_call": {"name": "f", "arguments": {"q": "a}b"}}}', "", [("f", '{"q": "a}b"}')]),
          ('{ "tool_calls" : [ {"name": "f", "arguments": {}} , {"name": "g", "arguments": {"n": 1}} ] }', "",
           [("f", "{}"), ("g", '{"n": 1}')]),
          ('{"response": [1, 2]}', "[1, 2]", [])]


@pytest.mark.parametrize("text, content, calls", SHAPES)
def test_every_split_gives_the_same_content_and_calls(text, content, calls):
    for cut in range(len(text) + 1):
        for cut2 in (cut, min(cut + 4, len(text))):
            out, p = run([text[:cut], text[cut:cut2], text[cut2:]])
            assert "".join(v for k, v in out if k == "content") == content
            assert [(c["function"]["name"], c["function"]["arguments"]) for c in p.calls] == calls
            assert "".join(v for k, v in out if k == "args") == "".join(a for _, a in calls)


@pytest.mark.parametrize("text, content, calls", [
    ('{"tool_call": {"name": "get_weather", "arguments": {"city": "Pa', "", [("get_weather", '{"city": "Pa')]),
    ('{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}', "",
     [("get_weather", '{"city": "Paris"}')]),
    ('{"tool_call": {"name": "get_wea', "", []),
    ('{"tool_calls": [{"name": "f", "arguments": {}}, {"name": "g", "argu', "", [("f", "{}")]),
    ('{"tool_', "", []),
    ('{"response": "cut \\u00', "cut ", []),
    ("Plain text, not the format", "Plain text, not the format", []),
])
def test_cut_by_max_tokens(text, content, calls):
    """No markup in content; a call's arguments are exactly what the model produced of them."""
    for cut in range(len(text) + 1):
        out, p = run([text[:cut], text[cut:]])
        assert "".join(v for k, v in out if k == "content") == content
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in p.calls] == calls
        assert [v for k, v in out if k == "done"] == p.calls
