"""engine/grammar_probe.py over the real Qwen tokenizer (llguidance): schemas llguidance compiles but refuses once
it runs are a GrammarError naming the part before any generation, and schemas at the limits pass; tool
parameters' $refs resolve against the tool's own schema."""
from __future__ import annotations

import json

import llguidance
import pytest

from appliance.engine.constraint import GrammarError, constraint_for, grammar_for, grammar_tokenizer
from appliance.engine.grammar_probe import explain, prepared_constraint
from appliance.engine.tokenizer import Tokenizer
from appliance.protocol.structured import (
    MAX_DEPTH,
    MAX_ENUM_VALUES,
    MAX_PROPERTIES,
    parse_response_format,
    parse_tool_choice,
)

V = 151936
EOS = (151645, 151643)
P = "response_format.json_schema.schema"
LOOP = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
REGEX = "^((([a-z]{1,50}){1,50}){1,50})$"


def optional_properties(n: int) -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)}}


ANY_OF_300 = {"type": "array", "items": {"anyOf": [
    {"type": "object", "properties": {f"k{i}": {"type": "integer"}, "v": {"type": "string"}}} for i in range(300)]}}


@pytest.fixture(scope="module")
def tok(qwen_tokenizer_dir):
    t = Tokenizer.from_dir(qwen_tokenizer_dir)
    grammar_tokenizer(t, V, EOS)
    return t


def fmt_of(schema):
    return parse_response_format({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})


@pytest.mark.parametrize("schema, part, words", [
    (LOOP, P + ".$defs.a", "no JSON value can match it"),
    ({"$defs": LOOP["$defs"], "type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}, "required": ["x"]},
     P + ".$defs.a", "NoExtensionBias"),
    (optional_properties(600), P, "too wide for the constraint parser"),
    ({"type": "object", "properties": {"rows": {"type": "array", "items": optional_properties(600)}}},
     P + ".properties.rows.items", "Current row has 2407 items; max is 2000"),
    (ANY_OF_300, P + ".items", "too wide"),
    ({"type": "string", "pattern": REGEX}, P, "regular expression is too complex"),
    ({"type": "object", "properties": {"r": {"type": "string", "pattern": REGEX}}, "required": ["r"]},
     P + ".properties.r", "too many expressions constructed"),
])
@pytest.mark.parametrize("think", ["none", "optional"])
def test_what_llguidance_refuses_only_when_it_runs_is_refused_before(tok, schema, part, words, think):
    fmt = fmt_of(schema)
    constraint_for(fmt, tok, V, EOS, think)                   # compiles: the old check let it through
    with pytest.raises(GrammarError) as info:
        prepared_constraint(fmt, tok, V, EOS, think)
    assert info.value.part == part and words in str(info.value), (info.value.part, str(info.value))


def test_the_refused_schemas_did_fail_while_generating(tok):
    """The control: the same grammars fail within the first steps of a plain walk, the engine's path."""
    for schema, prefix in ((LOOP, ""), (optional_properties(600), "{"), (ANY_OF_300, "[{"),
                           ({"type": "string", "pattern": REGEX}, '"')):
        c = constraint_for(fmt_of(schema), tok, V, EOS).start()
        with pytest.raises(GrammarError):
            for t in tok.encode(prefix):
                c.allowed()
                c.accept(t)
            c.allowed()


def nested_objects(n: int) -> dict:
    s: dict = {"type": "integer"}
    for _ in range(n):
        s = {"type": "object", "properties": {"a": s}, "required": ["a"], "additionalProperties": False}
    return s


@pytest.mark.parametrize("schema", [
    nested_objects(MAX_DEPTH),
    {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(MAX_PROPERTIES)},
     "required": [f"p{i}" for i in range(MAX_PROPERTIES)], "additionalProperties": False},
    {"type": "object", "properties": {"e": {"enum": [f"v{i}" for i in range(MAX_ENUM_VALUES)]}}, "required": ["e"]},
    optional_properties(450),
    {"$defs": {"Link": {"type": "object", "properties": {"v": {"type": "integer"}, "next": {
        "anyOf": [{"$ref": "#/$defs/Link"}, {"type": "null"}]}}, "required": ["v", "next"]}}, "$ref": "#/$defs/Link"},
], ids=["32-levels", "5000-properties", "5000-enum-values", "450-optional", "recursive"])
def test_schemas_at_the_limits_pass(tok, schema):
    prepared_constraint(fmt_of(schema), tok, V, EOS)


def test_explain_keeps_llguidances_words():
    assert explain("NoExtensionBias <non-verbose/>") == ("no JSON value can match it (a $ref loop with no schema "
                                                         "behind it, for example) (NoExtensionBias)")
    assert explain("something else\n  entirely") == "something else entirely"


PYDANTIC_PARAMS = {"$defs": {"Loc": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {
    "type": "integer"}}, "required": ["city", "zip"], "additionalProperties": False}},
    "type": "object", "properties": {"loc": {"$ref": "#/$defs/Loc"}, "days": {"type": "integer"}},
    "required": ["loc", "days"], "additionalProperties": False}


def test_tool_parameters_refs_resolve_against_the_tools_own_schema(tok):
    """Pydantic's nested models are $defs at the parameters' root: each tool's arguments are their own root."""
    tools = [{"type": "function", "function": {"name": "weather", "parameters": PYDANTIC_PARAMS}},
             {"type": "function", "function": {"name": "other", "parameters": {
                 "$defs": {"Loc": {"type": "string"}}, "type": "object", "properties": {"l": {"$ref": "#/$defs/Loc"}},
                 "required": ["l"], "additionalProperties": False}}}]
    _, fmt = parse_tool_choice("required", tools)
    prepared_constraint(fmt, tok, V, EOS)
    llt = grammar_tokenizer(tok, V, EOS)

    def accepts(args: dict, name: str = "weather") -> bool:
        m = llguidance.LLMatcher(llt, grammar_for(fmt, tok, llt), log_level=0)
        text = f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'
        ids = tok.encode(text)
        return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()

    assert accepts({"loc": {"city": "Oslo", "zip": 150}, "days": 2})
    assert not accepts({"loc": {"city": "Oslo"}, "days": 2})              # Loc's own required zip
    assert accepts({"l": "Oslo"}, "other")                                # the other tool's Loc is a string
    assert not accepts({"l": {"city": "Oslo", "zip": 1}}, "other")
