"""Structured output requests: `response_format`, `tool_choice`, and the limits a JSON schema must keep.

Policies:
- response_format: {"type": "text"} (no constraint), {"type": "json_object"} (any JSON object), or
  {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}; the schema constrains
  decoding whether or not `strict` is set (as llama.cpp's server does). Ollama's `format` ("json" or a schema)
  and the Responses API's `text.format` map onto the same OutputFormat.
- tool_choice: "none" (tools dropped), "auto" (free text or calls, unconstrained), "required" (one or more
  calls to any of the tools; exactly one when parallel_tool_calls is false), or
  {"type": "function", "function": {"name": N}} (exactly one call to N). A forced choice constrains decoding to
  the Hermes `<tool_call>` blocks the chat template and our tool-call parser use, each call's arguments
  validated against that function's `parameters`.
- A schema is checked here before llguidance sees it, so a hostile one is a 400 naming its path, never an
  expensive compile: at most MAX_DEPTH levels of nested schemas (json_schema.py counts them), at most
  MAX_PROPERTIES properties and MAX_ENUM_VALUES enum / const values in all, the serialized schema <=
  MAX_SCHEMA_BYTES. What llguidance itself refuses (unknown formats, bad $ref, unsupported keywords) comes back
  as a 400 with its message, and so does what it refuses only once it runs: each OutputFormat carries its
  probe points (json_schema.probe_points: path and part), whose first steps the engine runs before admission.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from appliance.protocol.fields import check_type, get, invalid, require
from appliance.protocol.json_schema import data_depth, holds_schemas, probe_points, walk

MAX_DEPTH = 32
MAX_PROPERTIES = 5000
MAX_ENUM_VALUES = 5000
MAX_SCHEMA_BYTES = 256 * 1024


@dataclass(frozen=True)
class OutputFormat:
    """What a request constrains its output to. kind: 'json' (any JSON object), 'json_schema', 'tool_calls' (the
    template's <tool_call> blocks), 'generic_tool_calls' (protocol/generic_tools.py; schema: the response's or
    None)."""
    kind: str
    schema: Any = None                      # json_schema: the schema (dict or True)
    tools: tuple = ()                       # tool_calls: ((name, parameters schema), ...) allowed
    parallel: bool = True                   # tool_calls: more than one call allowed
    probes: tuple = ()                      # ((request path, part schema), ...): first steps before admission


def check_schema(schema: Any, param: str) -> Any:
    """The schema if it keeps the limits; else a 400 naming the first part that breaks one."""
    if isinstance(schema, bool):
        return schema
    check_type(schema, "object", param)
    if len(json.dumps(schema)) > MAX_SCHEMA_BYTES:
        raise invalid(param, f"'{param}' is too large: at most {MAX_SCHEMA_BYTES} bytes of JSON are supported.",
                      code="unsupported_value")
    counts = {"properties": 0, "enum": 0}
    for node, path, level in walk(schema, param):
        if level > MAX_DEPTH:
            raise _too_deep(path)
        if not isinstance(node, dict):
            continue
        for key, value in node.items():
            if not holds_schemas(key, value) and data_depth(value) > MAX_DEPTH:
                raise _too_deep(f"{path}.{key}")
        if isinstance(node.get("properties"), dict):
            counts["properties"] += len(node["properties"])
        counts["enum"] += (len(node["enum"]) if isinstance(node.get("enum"), list) else 0) + ("const" in node)
        for key, limit, what in (("properties", MAX_PROPERTIES, "properties"),
                                 ("enum", MAX_ENUM_VALUES, "enum / const values")):
            if counts[key] > limit:
                part = f"{path}.{key if key in node else 'const'}"
                raise invalid(part, f"The schema is too large at '{part}': at most {limit} {what} in all are "
                                    f"supported.", code="unsupported_value")
    return schema


def _too_deep(path: str):
    return invalid(path, f"The schema at '{path}' is nested too deeply: at most {MAX_DEPTH} levels of nested "
                         f"schemas (and of nesting in one value) are supported.", code="unsupported_value")


def schema_format(schema: Any, param: str) -> OutputFormat:
    """The OutputFormat of a JSON schema given as `param` (checked, with its probe points)."""
    schema = {} if schema is None else schema
    return OutputFormat("json_schema", check_schema(schema, param), probes=probe_points(schema, param))


def parse_response_format(rf: Any, param: str = "response_format") -> OutputFormat | None:
    if rf is None:
        return None
    check_type(rf, "object", param)
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return OutputFormat("json")
    if kind == "json_schema":
        js = require(rf, "json_schema", "object", f"{param}.json_schema")
        return schema_format(js.get("schema", {}), f"{param}.json_schema.schema")
    raise invalid(f"{param}.type", f"Invalid value for '{param}.type': {kind!r}. Supported values are: 'text', "
                                   f"'json_object' and 'json_schema'.", code="invalid_value")


def parse_tool_choice(v: Any, tools: list[dict[str, Any]] | None, parallel: bool = True
                      ) -> tuple[str | None, OutputFormat | None]:
    """(tool_choice as 'auto' | 'none' | 'required' | 'function' | None, the constraint a forced call needs)."""
    if v is None or v in ("auto", "none"):
        return v, None
    if isinstance(v, str) and v != "required":
        raise invalid("tool_choice", f"Invalid value for 'tool_choice': '{v}'. Supported values are: 'none', "
                                     f"'auto', 'required', or an object naming a function.", code="invalid_value")
    if not isinstance(v, (str, dict)):
        check_type(v, "string", "tool_choice")
    if not tools:
        raise invalid("tool_choice", "'tool_choice' is only allowed when 'tools' are specified.",
                      code="invalid_value")
    by_name = {t["function"]["name"]: t["function"].get("parameters") for t in tools}
    if v == "required":
        chosen = list(by_name)
    else:
        if v.get("type") != "function":
            raise invalid("tool_choice.type", f"Invalid value for 'tool_choice.type': {v.get('type')!r}. "
                                              f"Expected 'function'.", code="invalid_value")
        fn = require(v, "function", "object", "tool_choice.function")
        name = require(fn, "name", "string", "tool_choice.function.name")
        if name not in by_name:
            raise invalid("tool_choice.function.name", f"Invalid 'tool_choice': no function named '{name}' "
                                                       f"is in 'tools'.", code="invalid_value")
        chosen, parallel = [name], False
    specs: list[tuple[str, Any]] = []
    probes: tuple[tuple[str, Any], ...] = ()
    for name in chosen:
        i = next(i for i, t in enumerate(tools) if t["function"]["name"] == name)
        params = by_name[name]
        params = {"type": "object", "properties": {}} if params is None else params
        specs.append((name, check_schema(params, f"tools[{i}].function.parameters")))
        probes += probe_points(params, f"tools[{i}].function.parameters")
    return ("required" if v == "required" else "function"), OutputFormat("tool_calls", tools=tuple(specs),
                                                                         parallel=parallel, probes=probes)


def parallel_tool_calls(body: dict[str, Any]) -> bool:
    return get(body, "parallel_tool_calls", "boolean", default=True)
