"""XmlToolCallParser: Qwen3.5 / Qwen3-Coder `<function=...>` blocks -> OpenAI tool_calls, incrementally; and the
forced-call grammar of the same form. The call texts are written byte for byte as Qwen3.5's published template
(tests/fixtures/qwen3_5) renders an assistant's calls."""
from __future__ import annotations

import itertools
import json

import pytest

from appliance.protocol.xml_tool_calls import XmlToolCallParser

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "unit": {"enum": ["c", "f"]},
    "where": {"type": "object"}}}}},
         {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}}]
CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nSão \"Paulo\"\\\n2\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n<parameter=unit>\nc\n</parameter>\n"
        "<parameter=where>\n{\"lat\": 1.5, \"tags\": [\"a\"]}\n</parameter>\n</function>\n</tool_call>")
CALL_ARGS = '{"city":"São \\"Paulo\\"\\\\\\n2","days":3,"unit":"c","where":{"lat":1.5,"tags":["a"]}}'


def ids():
    n = itertools.count()
    return lambda: f"call_{next(n)}"


def run(chunks, tools=TOOLS):
    """(content, [(name, arguments)], the args fragments) of the chunks; the ("done", call) markers come once per
    call, in order, and the streamed fragments of each call join to its arguments."""
    p = XmlToolCallParser(ids(), tools)
    pieces = [x for c in chunks for x in p.push(c)] + p.flush()
    done = [v for k, v in pieces if k == "done"]
    assert done == p.calls and all(a is b for a, b in zip(done, p.calls))
    streamed: list[str] = []
    for kind, value in pieces:
        if kind == "call":
            assert value["function"]["arguments"] == ""
            streamed.append("")
        elif kind == "args":
            streamed[-1] += value
    assert streamed == [c["function"]["arguments"] for c in p.calls]
    content = "".join(v for k, v in pieces if k == "content")
    return content, [(c["function"]["name"], c["function"]["arguments"]) for c in p.calls], pieces


def splits(text):
    """The text whole, char by char, and cut in two at every point."""
    yield [text]
    yield list(text)
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]


def test_the_templates_call_parses_to_typed_compact_arguments_at_any_split():
    for chunks in splits(CALL):
        content, calls, _ = run(chunks)
        assert content == "" and calls == [("get_weather", CALL_ARGS)], chunks
    assert json.loads(CALL_ARGS) == {"city": 'São "Paulo"\\\n2', "days": 3, "unit": "c",
                                     "where": {"lat": 1.5, "tags": ["a"]}}


def test_a_string_value_streams_as_it_decodes_and_holds_back_a_newline_and_a_partial_tag():
    p = XmlToolCallParser(ids(), TOOLS)
    assert p.push("<tool_call>\n<function=get_weather>\n") == [
        ("call", {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": ""}})]
    assert p.push("<parameter=city>\nPar") == [("args", '{"city":"Par')]
    assert p.push("is\n") == [("args", "is")]                 # the newline may be the template's
    assert p.push("</para") == []                            # ... and this the start of the closing tag
    assert p.push("meter>\n<parameter=days>\n1") == [("args", '","days":')]   # a number comes whole
    assert p.push("2\n</parameter>\n</function>") == [("args", "12}"), ("done", p.calls[0])]
    assert p.push("\n</tool_call>") == [] and p.flush() == []
    assert p.calls[0]["function"]["arguments"] == '{"city":"Paris","days":12}'


def test_a_newline_inside_a_string_value_is_released_when_text_follows():
    content, calls, _ = run(["<tool_call>\n<function=get_weather>\n<parameter=city>\nline1\n", "line2\n\n",
                             "</parameter>\n</function>\n</tool_call>"])
    assert calls == [("get_weather", '{"city":"line1\\nline2\\n"}')]


def test_types_follow_the_schema_and_undeclared_values_are_json_when_they_parse():
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n<parameter=days>\nsoon\n"
            "</parameter>\n<parameter=extra>\n[1, true]\n</parameter>\n<parameter=note>\nhi there\n</parameter>\n"
            "</function>\n</tool_call>")
    _, calls, _ = run([text])
    assert calls == [("get_weather", '{"city":"42","days":"soon","extra":[1,true],"note":"hi there"}')]
    _, calls, _ = run([text], tools=None)                   # no schemas: every value is JSON when it parses
    assert calls == [("get_weather", '{"city":42,"days":"soon","extra":[1,true],"note":"hi there"}')]


def test_content_before_calls_and_several_calls():
    text = ("Let me check.\n\n<tool_call>\n<function=noop>\n</function>\n</tool_call>\n<tool_call>\n"
            "<function=get_weather>\n<parameter=days>\n2\n</parameter>\n</function>\n<function=noop>\n</function>\n"
            "</tool_call>")
    for chunks in splits(text):
        content, calls, _ = run(chunks)
        assert content == "Let me check." and calls == [("noop", "{}"), ("get_weather", '{"days":2}'),
                                                        ("noop", "{}")], chunks


@pytest.mark.parametrize("text", ["Use <tool_call>wisely</tool_call> please.", "a < b <tool_call>\n{}</tool_call>"])
def test_a_block_that_is_not_a_call_is_content(text):
    for chunks in splits(text):
        content, calls, _ = run(chunks)
        assert content == text and calls == [], chunks


def test_plain_content_untouched():
    for chunks in splits("No tools <here>, x </parameter> y\n"):
        content, calls, _ = run(chunks)
        assert content == "No tools <here>, x </parameter> y\n" and calls == []


def test_cut_anywhere_keeps_a_prefix_of_the_arguments_and_no_markup():
    text = "Sure.\n" + CALL
    tag = range(len("Sure.\n") + 1, len("Sure.\n<tool_call>"))
    for n in range(len(text)):
        content, calls, _ = run([text[:n]])
        if n in tag:                  # a cut inside the tag's text: text, as ToolCallParser has it (a tokenizer
            assert content == text[:n] and calls == []      # with <tool_call> as one token never cuts there)
            continue
        assert "<" not in content and content in ("", "Sure.", "Sure.\n"[:n]), (n, content)
        assert len(calls) <= 1
        if calls:
            assert calls[0][0] == "get_weather" and CALL_ARGS.startswith(calls[0][1]), (n, calls)
        else:
            assert n < len("Sure.\n<tool_call>\n<function=get_weather>")
    content, calls, _ = run([text[:-len("\n</tool_call>")]])
    assert calls == [("get_weather", CALL_ARGS)] and content == "Sure."


def test_a_cut_block_that_cannot_become_a_call_stays_content():
    content, calls, _ = run(["see <tool_call> for details"])
    assert content == "see <tool_call> for details" and calls == []


def test_the_forced_call_grammar_takes_the_templates_form_only():
    from appliance.engine.constraint import xml_tool_calls_rules

    tools = (("get_weather", TOOLS[0]["function"]["parameters"] | {"required": ["city"]}), ("noop", {}))
    rules = xml_tool_calls_rules(tools, parallel=False)
    assert 'param_0_0: "<parameter=city>\\n" XML_TEXT\n' in rules
    assert 'param_0_2: "<parameter=unit>\\n" ("c" | "f") "\\n</parameter>\\n"\n' in rules
    assert 'function_0: "<function=get_weather>\\n" param_0_0 param_0_1? param_0_2? param_0_3? "</function>"\n' in rules
    assert 'function_1: "<function=noop>\\n"  "</function>"\n' in rules
    assert rules.startswith('body: call\ncall: "<tool_call>" "\\n" function "\\n" "</tool_call>"\n')


def test_the_grammar_and_the_parser_agree_on_which_parameters_are_text():
    from appliance.engine import constraint
    from appliance.protocol import xml_tool_calls

    schemas = [{"type": "string"}, {"enum": ["a", "b"]}, {"const": "x"}, {"enum": ["a", 1]}, {"enum": []},
               {"type": "integer"}, {"type": ["string", "null"]}, {}, True, None, {"const": 3}]
    for schema in schemas:
        assert constraint.is_string_schema(schema) == xml_tool_calls.is_string_schema(schema), schema


def test_the_template_probe_finds_the_xml_form_and_its_object_arguments():
    import os

    from appliance.engine.chat_template import ChatTemplate, ChatTemplateError

    fixtures = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures")
    qwen3_5, qwen3 = (ChatTemplate(open(os.path.join(fixtures, d, "chat_template.jinja"), encoding="utf-8").read())
                      for d in ("qwen3_5", "qwen3"))
    assert qwen3_5.call_style == ("xml", True) and qwen3.call_style == ("json", False)
    args = {"city": "Paris", "days": 3}

    def chat(arguments):
        return [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    text = qwen3_5.render(chat(json.dumps(args)), enable_thinking=False)
    assert text == qwen3_5.render(chat(args), enable_thinking=False)
    assert "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n" \
           "</parameter>\n</function>\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nsunny\n" in text
    _, calls, _ = run([text.split("</think>\n\n")[1].split("<|im_end|>")[0]])   # and it parses back
    assert calls == [("get_weather", '{"city":"Paris","days":3}')]
    for bad in ("[1]", "{", "3"):
        with pytest.raises(ChatTemplateError, match="must be a JSON object"):
            qwen3_5.render(chat(bad))
    assert '"arguments": {"city": "Paris", "days": 3}' in qwen3.render(chat(json.dumps(args)))  # Qwen3: unchanged
