"""Typed reads of JSON request fields, each failure an ApiError(400) naming the field.

Policy: types are JSON's as OpenAI's API checks them: an integer field rejects 1.5 and true; a number field
accepts integers; null means "not given" everywhere (OpenAI's optional fields are nullable). Messages read like
OpenAI's: "Invalid type for 'max_tokens': expected an integer, but got a string instead."
"""
from __future__ import annotations

import json
import re
from typing import Any, Mapping

from appliance.protocol.errors import ApiError

_EXPECT = {"integer": "an integer", "number": "a number", "boolean": "a boolean", "string": "a string",
           "array": "an array", "object": "an object"}


def json_kind(v: Any) -> str:
    """How OpenAI names the type of a JSON value in its errors."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, int):
        return "an integer"
    if isinstance(v, float):
        return "a decimal number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "an array"
    return "an object"


def _matches(v: Any, kind: str) -> bool:
    if kind == "integer":
        return isinstance(v, int) and not isinstance(v, bool)
    if kind == "number":
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if kind == "boolean":
        return isinstance(v, bool)
    if kind == "string":
        return isinstance(v, str)
    if kind == "array":
        return isinstance(v, list)
    if kind == "object":
        return isinstance(v, dict)
    raise ValueError(kind)


def invalid(param: str, message: str, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def check_type(v: Any, kind: str, param: str) -> Any:
    if not _matches(v, kind):
        raise invalid(param, f"Invalid type for '{param}': expected {_EXPECT[kind]}, but got {json_kind(v)} instead.",
                      code="invalid_type")
    return v


def get(obj: Mapping[str, Any], key: str, kind: str, param: str | None = None, default: Any = None) -> Any:
    """obj[key] checked against `kind`; absent or null -> default."""
    v = obj.get(key)
    if v is None:
        return default
    return check_type(v, kind, param or key)


def require(obj: Mapping[str, Any], key: str, kind: str, param: str | None = None) -> Any:
    v = obj.get(key)
    if v is None:
        raise invalid(param or key, f"Missing required parameter: '{param or key}'.", code="missing_required_parameter")
    return check_type(v, kind, param or key)


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _has_lone_surrogate(v: Any) -> bool:
    try:
        json.dumps(v, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def load_json_object(body: bytes) -> dict[str, Any]:
    """The request body as a JSON object (UTF-8 only, no NaN/Infinity, an object at the top)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"The request body is not valid UTF-8 (byte {e.start}).", code="invalid_body") from None
    if not text.strip():
        raise ApiError(400, "The request body is empty; send a JSON object.", code="invalid_body")
    try:
        data = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:
        raise ApiError(400, f"We could not parse the JSON body of your request ({e}). The body must be a "
                            f"JSON object.", code="invalid_json") from None
    # a \uD800-\uDFFF escape not paired into one character is not Unicode text: nothing downstream
    # (tokenizer, UTF-8 output) can carry it. Only bodies with such an escape pay for the full check.
    if _SURROGATE_ESCAPE.search(text) and _has_lone_surrogate(data):
        raise ApiError(400, "The request body contains an unpaired UTF-16 surrogate escape (\\uD800-\\uDFFF); "
                            "strings must be valid Unicode.", code="invalid_body")
    if not isinstance(data, dict):
        raise ApiError(400, f"The request body must be a JSON object, got {json_kind(data)}.", code="invalid_body")
    return data
