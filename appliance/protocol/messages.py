"""Chat messages: OpenAI's request shape -> the plain dicts a chat template renders.

Policies:
- Roles: system, developer (rendered as system: Qwen's templates know no developer role), user, assistant, tool.
- Content: a string, or a list of text parts joined with no separator (what the Qwen3-VL template does with a
  part list). Image parts are kept as parts only when the model takes images (issue 6); otherwise, and for any
  other non-text part, the request is a 400 naming the part.
- A part made by another API's converter (Ollama's `images`, Responses' `input_image`) carries the field the
  client sent it as (PART_PARAM: `messages[0].images[0]`, `input[0].content[1]`); errors about the part, here
  and when its image is decoded (server/images.py), name that field, never our internal `content[j]`.
- Assistant turns may carry tool_calls (then content may be null) and reasoning_content (the template puts it
  back inside <think>); tool turns carry the tool's output as content.
"""
from __future__ import annotations

from typing import Any

from appliance.protocol.fields import check_type, get, invalid, require

ROLES = ("system", "developer", "user", "assistant", "tool")
IMAGE_PART_TYPES = ("image_url",)
PART_PARAM = "_param"   # key of a converted part: the client's name for it


def part_param(part: dict[str, Any], default: str) -> str:
    """The client's name for a content part: the one a converter recorded, else `default`."""
    given = part.get(PART_PARAM)
    return given if isinstance(given, str) else default


def _content(msg: dict[str, Any], p: str, role: str, images_supported: bool,
             images_hint: str = "") -> str | list[dict[str, Any]]:
    c = msg.get("content")
    if c is None:
        if role == "assistant" and msg.get("tool_calls"):
            return ""
        raise invalid(f"{p}.content", f"Missing required parameter: '{p}.content'.",
                      code="missing_required_parameter")
    if isinstance(c, str):
        return c
    check_type(c, "array", f"{p}.content")
    parts: list[dict[str, Any]] = []
    has_image = False
    for j, part in enumerate(c):
        pp = f"{p}.content[{j}]"
        check_type(part, "object", pp)
        pp = part_param(part, pp)
        kind = require(part, "type", "string", f"{pp}.type")
        if kind == "text":
            parts.append({"type": "text", "text": require(part, "text", "string", f"{pp}.text")})
        elif kind in IMAGE_PART_TYPES:
            if not images_supported:
                raise invalid(pp, f"Invalid content part '{pp}': this model does not accept images; "
                                  + (f"{images_hint}." if images_hint else "send text parts only."),
                              code="unsupported_content")
            if role != "user":
                raise invalid(pp, f"Invalid content part '{pp}': images are only accepted in user messages.",
                              code="unsupported_content")
            image = require(part, "image_url", "object", f"{pp}.image_url")
            url = require(image, "url", "string", f"{pp}.image_url.url")
            parts.append({"type": "image_url", "image_url": {"url": url}})
            if PART_PARAM in part:
                parts[-1][PART_PARAM] = pp
            has_image = True
        else:
            raise invalid(pp, f"Invalid content part type '{kind}' in '{pp}': only 'text'"
                              + (" and 'image_url'" if images_supported else "") + " parts are supported.",
                          code="unsupported_content")
    if has_image:
        return parts
    return "".join(p_["text"] for p_ in parts)


def _tool_calls(msg: dict[str, Any], p: str) -> list[dict[str, Any]]:
    calls = get(msg, "tool_calls", "array", f"{p}.tool_calls", default=[])
    out = []
    for k, call in enumerate(calls):
        cp = f"{p}.tool_calls[{k}]"
        check_type(call, "object", cp)
        fn = require(call, "function", "object", f"{cp}.function")
        name = require(fn, "name", "string", f"{cp}.function.name")
        args = fn.get("arguments", "{}")
        if not isinstance(args, (str, dict)):
            check_type(args, "string", f"{cp}.function.arguments")
        entry: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": args}}
        if call.get("id") is not None:
            entry = {"id": check_type(call["id"], "string", f"{cp}.id"), **entry}
        out.append(entry)
    return out


def normalize_messages(raw: Any, *, images_supported: bool = False, images_hint: str = "") -> list[dict[str, Any]]:
    check_type(raw, "array", "messages")
    if not raw:
        raise invalid("messages", "'messages' must contain at least one message.", code="empty_array")
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(raw):
        p = f"messages[{i}]"
        check_type(msg, "object", p)
        role = require(msg, "role", "string", f"{p}.role")
        if role not in ROLES:
            raise invalid(f"{p}.role", f"Invalid value for '{p}.role': '{role}'. Supported values are: "
                                       + ", ".join(f"'{r}'" for r in ROLES) + ".", code="invalid_value")
        m: dict[str, Any] = {"role": "system" if role == "developer" else role,
                             "content": _content(msg, p, role, images_supported, images_hint)}
        name = get(msg, "name", "string", f"{p}.name")
        if name is not None:
            m["name"] = name
        if role == "assistant":
            calls = _tool_calls(msg, p)
            if calls:
                m["tool_calls"] = calls
            rc = get(msg, "reasoning_content", "string", f"{p}.reasoning_content")
            if rc is not None:
                m["reasoning_content"] = rc
        if role == "tool":
            tcid = get(msg, "tool_call_id", "string", f"{p}.tool_call_id")
            if tcid is not None:
                m["tool_call_id"] = tcid
        out.append(m)
    return out


def normalize_tools(raw: Any) -> list[dict[str, Any]] | None:
    """OpenAI function tools, kept in OpenAI's shape (Qwen's templates render each with tojson)."""
    tools = check_type(raw, "array", "tools") if raw is not None else None
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        p = f"tools[{i}]"
        check_type(t, "object", p)
        kind = require(t, "type", "string", f"{p}.type")
        if kind != "function":
            raise invalid(f"{p}.type", f"Invalid value for '{p}.type': '{kind}'. Only 'function' tools are "
                                       f"supported.", code="invalid_value")
        fn = require(t, "function", "object", f"{p}.function")
        name = require(fn, "name", "string", f"{p}.function.name")
        if not name:
            raise invalid(f"{p}.function.name", f"'{p}.function.name' must not be empty.", code="invalid_value")
        f: dict[str, Any] = {"name": name}
        desc = get(fn, "description", "string", f"{p}.function.description")
        if desc is not None:
            f["description"] = desc
        params = get(fn, "parameters", "object", f"{p}.function.parameters")
        if params is not None:
            f["parameters"] = params
        out.append({"type": "function", "function": f})
    return out
