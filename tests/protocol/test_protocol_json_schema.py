"""protocol/json_schema.py and structured.check_schema: schema levels, the limits at and one past them, and the
probe points whose first grammar steps run before admission."""
from __future__ import annotations

import pytest

from appliance.protocol.errors import ApiError
from appliance.protocol.json_schema import MAX_PROBES, WIDE, cyclic_defs, data_depth, probe_points, walk
from appliance.protocol.structured import (
    MAX_DEPTH,
    MAX_ENUM_VALUES,
    MAX_PROPERTIES,
    check_schema,
    parse_response_format,
    parse_tool_choice,
)

P = "response_format.json_schema.schema"
LOOP = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}


def nested(n: int, wrap, s=None) -> dict:
    """n levels of `wrap` around an integer's schema (or around s), which is n levels deep."""
    s = {"type": "integer"} if s is None else s
    for _ in range(n):
        s = wrap(s)
    return s


def refused(schema, param=P) -> ApiError:
    with pytest.raises(ApiError) as info:
        check_schema(schema, param)
    assert info.value.status == 400 and info.value.code == "unsupported_value"
    return info.value


def an_object(s):
    return {"type": "object", "properties": {"a": s}, "required": ["a"]}


@pytest.mark.parametrize("wrap", [
    an_object,
    lambda s: {"type": "array", "items": s},
    lambda s: {"anyOf": [s, {"type": "null"}]},
    lambda s: {"allOf": [s]},
    lambda s: {"type": "object", "additionalProperties": s},
], ids=["properties", "items", "anyOf", "allOf", "additionalProperties"])
def test_levels_are_nested_schemas_at_the_limit_and_one_past(wrap):
    assert check_schema(nested(MAX_DEPTH, wrap), P)
    err = refused(nested(MAX_DEPTH + 1, wrap))
    assert "nested too deeply" in err.message and f"at most {MAX_DEPTH} levels" in err.message
    assert err.param.startswith(P + ".") and err.param in err.message


def test_32_nested_objects_fit_where_keyword_containers_used_to_count():
    levels = [level for _node, _path, level in walk(nested(MAX_DEPTH, an_object), P)]
    assert max(levels) == MAX_DEPTH == 32 and len(levels) == MAX_DEPTH + 1
    err = refused(nested(MAX_DEPTH + 1, an_object))
    assert err.param == P + ".properties.a" * (MAX_DEPTH + 1)


def test_data_values_are_held_to_as_many_levels_of_their_own():
    deep = nested(MAX_DEPTH, lambda v: [v], 1)       # [[...[1]...]]: 32 lists
    assert data_depth(deep) == MAX_DEPTH and data_depth(1) == 0 and data_depth({"a": [1]}) == 2
    assert check_schema({"const": deep, "default": deep}, P)
    err = refused({"type": "object", "properties": {"x": {"enum": [[deep]]}}})
    assert err.param == P + ".properties.x.enum"


def test_properties_and_enum_values_in_all_at_the_limit_and_one_past():
    half = MAX_PROPERTIES // 2
    two = {"type": "object", "properties": {
        "a": {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(half)}},
        "b": {"type": "object", "properties": {f"q{i}": {"type": "integer"} for i in range(MAX_PROPERTIES - half - 2)}}}}
    assert check_schema(two, P)                                       # 2 + 2498 + 2500 = 5000
    two["properties"]["b"]["properties"]["one_more"] = {}
    err = refused(two)
    assert "at most 5000 properties" in err.message and err.param.endswith(".properties")
    enums = {"anyOf": [{"enum": list(range(MAX_ENUM_VALUES - 1))}, {"const": "x"}]}
    assert check_schema(enums, P)
    enums["anyOf"].append({"const": "y"})
    err = refused(enums)
    assert err.param == P + ".anyOf[2].const" and "enum / const values" in err.message


def test_keys_named_like_keywords_inside_data_are_not_counted():
    data = {"properties": {f"k{i}": i for i in range(MAX_PROPERTIES + 1)}}
    assert check_schema({"type": "object", "default": data, "examples": [data]}, P)


def test_probe_points_deepest_first_the_whole_schema_last():
    wide = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(WIDE)}}
    narrow = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(WIDE - 1)}}
    schema = {"type": "object", "properties": {
        "w": {"type": "array", "items": wide}, "n": narrow,
        "code": {"type": "string", "pattern": "^[a-z]+$"},
        "u": {"anyOf": [{"type": "object", "properties": {"k": {}}} for _ in range(WIDE // 2)]}}}
    points = probe_points(schema, P)
    assert [p for p, _ in points] == [P + ".properties.w.items", P + ".properties.code", P + ".properties.u", P]
    assert points[0][1] is wide and points[-1][1] is schema


def test_probe_points_follow_defs_on_ref_cycles_with_the_roots_defs_attached():
    points = probe_points(LOOP, P)
    assert [p for p, _ in points] == [P + ".$defs.a", P + ".$defs.b", P]
    assert points[0][1] == {"$ref": "#/$defs/b", "$defs": LOOP["$defs"]}
    assert cyclic_defs(LOOP) == {("$defs", "a"), ("$defs", "b")}
    pydantic = {"$defs": {"Link": {"type": "object", "properties": {"next": {"anyOf": [{"$ref": "#/$defs/Link"},
                                                                                     {"type": "null"}]}}},
                          "Loc": {"type": "object", "properties": {"city": {"type": "string"}}}},
                "type": "object", "properties": {"chain": {"$ref": "#/$defs/Link"}, "loc": {"$ref": "#/$defs/Loc"}}}
    assert cyclic_defs(pydantic) == {("$defs", "Link")}
    assert [p for p, _ in probe_points(pydantic, "format")] == ["format.$defs.Link", "format"]
    old = {"definitions": {"A": {"anyOf": [{"$ref": "#/definitions/A"}]}}, "$ref": "#/definitions/A"}
    assert [p for p, _ in probe_points(old, "format")] == ["format.definitions.A", "format"]


def test_parts_that_refer_elsewhere_are_left_to_the_whole_schema():
    schema = {"type": "object", "properties": {
        "a": {"type": "string", "pattern": "^a$", "x": {"$ref": "#/properties/b"}},
        "b": {"type": "string", "pattern": "^b$", "$id": "urn:b"},
        "c": {"type": "string", "pattern": "^c$", "not": {"$ref": "#"}}}}
    assert [p for p, _ in probe_points(schema, P)] == [P]


def test_probe_points_are_capped():
    schema = {"type": "object", "properties": {f"s{i}": {"type": "string", "pattern": "^x$"} for i in range(100)}}
    points = probe_points(schema, P)
    assert len(points) == MAX_PROBES and points[-1] == (P, schema)


def test_output_formats_carry_their_probe_points():
    fmt = parse_response_format({"type": "json_schema", "json_schema": {"name": "x", "schema": LOOP}})
    assert [p for p, _ in fmt.probes] == [P + ".$defs.a", P + ".$defs.b", P]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
             {"type": "function", "function": {"name": "g", "parameters": LOOP}}]
    _, fmt = parse_tool_choice("required", tools)
    assert [p for p, _ in fmt.probes] == ["tools[0].function.parameters", "tools[1].function.parameters.$defs.a",
                                          "tools[1].function.parameters.$defs.b", "tools[1].function.parameters"]
