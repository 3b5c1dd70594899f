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
  expensive compile: nesting depth <= MAX_DEPTH, at most MAX_PROPERTIES properties and MAX_ENUM_VALUES enum /
  const values in all, the serialized schema <= MAX_SCHEMA_BYTES. What llguidance itself refuses (unknown
  formats, bad $ref, unsupported keywords) comes back as a 400 with its message.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from appliance.protocol.fields import check_type, get, invalid, require

MAX_DEPTH = 32
MAX_PROPERTIES = 5000
MAX_ENUM_VALUES = 5000
MAX_SCHEMA_BYTES = 256 * 1024


@dataclass(frozen=True)
class OutputFormat:
    """What a request constrains its output to. kind: 'json' (any JSON object), 'json_schema', 'tool_calls'."""
    kind: str
    schema: Any = None                      # json_schema: the schema (dict or True)
    tools: tuple = ()                       # tool_calls: ((name, parameters schema), ...) allowed
    parallel: bool = True                   # tool_calls: more than one call allowed


def check_schema(schema: Any, param: str) -> Any:
    """The schema if it keeps the limits; else a 400 naming the first part that breaks one."""
    if isinstance(schema, bool):
        return schema
    check_type(schema, "object", param)
    if len(json.dumps(schema)) > MAX_SCHEMA_BYTES:
        raise invalid(param, f"'{param}' is too large: at most {MAX_SCHEMA_BYTES} bytes of JSON are supported.",
                      code="unsupported_value")
    counts = {"properties": 0, "enum": 0}
    stack = [(schema, param, 0)]
    while stack:
        node, path, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise invalid(path, f"The schema at '{path}' is nested too deeply: at most {MAX_DEPTH} levels are "
                                f"supported.", code="unsupported_value")
        if isinstance(node, dict):
            for key, kind, limit in (("properties", dict, MAX_PROPERTIES), ("enum", list, MAX_ENUM_VALUES)):
                if isinstance(node.get(key), kind):
                    counts[key] += len(node[key])
                    if counts[key] > limit:
                        raise invalid(f"{path}.{key}", f"The schema is too large at '{path}.{key}': at most {limit} "
                                                       f"{key} entries in all are supported.",
                                      code="unsupported_value")
            stack.extend((v, f"{path}.{k}", depth + 1) for k, v in node.items())
        elif isinstance(node, list):
            stack.extend((v, f"{path}[{i}]", depth + 1) for i, v in enumerate(node))
    return schema


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
        schema = js.get("schema", {})
        if schema is None:
            schema = {}
        return OutputFormat("json_schema", check_schema(schema, f"{param}.json_schema.schema"))
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
    specs = []
    for name in chosen:
        i = next(i for i, t in enumerate(tools) if t["function"]["name"] == name)
        params = by_name[name]
        params = {"type": "object", "properties": {}} if params is None else params
        specs.append((name, check_schema(params, f"tools[{i}].function.parameters")))
    return ("required" if v == "required" else "function"), OutputFormat("tool_calls", tools=tuple(specs),
                                                                         parallel=parallel)


def parallel_tool_calls(body: dict[str, Any]) -> bool:
    return get(body, "parallel_tool_calls", "boolean", default=True)
