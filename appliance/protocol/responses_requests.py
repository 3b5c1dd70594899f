"""Parse and validate POST /v1/responses bodies (OpenAI's Responses API, stateless) into a ChatRequest.

Policies:
- Bytes in, a request out, or an ApiError(400) in OpenAI's error shape naming the field. Unknown fields are
  ignored (include, truncation, user, safety_identifier, prompt_cache_key, service_tier, ...).
- Stateless: nothing is stored, so `previous_response_id`, `conversation`, `store: true`, `background: true` and
  `item_reference` items are a clear 400 (send the whole conversation as input items instead).
- input: a string (one user message) or items: messages (role user / assistant / system / developer; content a
  string or parts: input_text, input_image with a data: URI, output_text / refusal in assistant history),
  function_call, function_call_output, and reasoning items (their text goes back to the template as the next
  assistant turn's reasoning_content). Consecutive function_call items form one assistant turn.
- instructions -> a system message first. max_output_tokens -> max_tokens (>= 16, as OpenAI, up to the
  context). temperature / top_p as OpenAI; top_k / min_p / seed / penalties accepted as the chat route does.
- tools: function tools (flat: name, description, parameters, strict) -> chat tools; other tool types are 400.
  tool_choice: "auto" / "none" / "required" / {"type": "function", "name": N} (a forced call constrains
  decoding, as on the chat route).
- text.format and reasoning are parsed in `text_format` / `_reasoning`: text.format json_object / json_schema
  (flat: name, schema, strict) constrains decoding like chat's response_format; with a JSON format or a forced
  call and no reasoning.effort, thinking is off; reasoning.effort "none" turns it off too.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from appliance.protocol.errors import ApiError
from appliance.protocol.fields import check_type, get, invalid, load_json_object, require
from appliance.protocol.messages import PART_PARAM, normalize_messages, normalize_tools
from appliance.protocol.requests import ChatRequest, _sampling
from appliance.protocol.structured import OutputFormat, parse_response_format, parse_tool_choice, schema_format

MIN_OUTPUT_TOKENS = 16
STATEFUL = "This server is stateless and stores no responses; send the whole conversation as input items."


@dataclass(frozen=True)
class ResponsesRequest:
    request: ChatRequest
    echo: dict[str, Any] = field(default_factory=dict)   # request fields the response object repeats


def _text_of(parts: list, p: str, allowed: tuple[str, ...]) -> str | list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for j, part in enumerate(parts):
        pp = f"{p}[{j}]"
        check_type(part, "object", pp)
        kind = require(part, "type", "string", f"{pp}.type")
        if kind not in allowed:
            raise invalid(f"{pp}.type", f"Invalid content part type '{kind}' in '{pp}': supported here are "
                                        + ", ".join(f"'{a}'" for a in allowed) + ".", code="invalid_value")
        if kind == "input_image":
            url = get(part, "image_url", "string", f"{pp}.image_url")
            if url is None:
                raise invalid(f"{pp}.image_url", f"'{pp}' needs an 'image_url' (a data: URI); file_id is not "
                                                 f"supported.", code="unsupported_value")
            out.append({"type": "image_url", "image_url": {"url": url}, PART_PARAM: pp})
        else:
            out.append({"type": "text", "text": require(part, "refusal" if kind == "refusal" else "text", "string",
                                                        f"{pp}.text")})
    if any(x["type"] == "image_url" for x in out):
        return out
    return "".join(x["text"] for x in out)


def _message(item: Mapping[str, Any], p: str) -> dict[str, Any]:
    role = require(item, "role", "string", f"{p}.role")
    if role not in ("user", "assistant", "system", "developer"):
        raise invalid(f"{p}.role", f"Invalid value for '{p}.role': '{role}'. Supported values are: 'user', "
                                   f"'assistant', 'system' and 'developer'.", code="invalid_value")
    content = item.get("content")
    if isinstance(content, list):
        allowed = ("output_text", "refusal") if role == "assistant" else ("input_text", "input_image")
        content = _text_of(content, f"{p}.content", allowed)
    else:
        content = require(item, "content", "string", f"{p}.content")
    return {"role": role, "content": content}


def to_chat_messages(raw: Any, instructions: str | None) -> list[dict[str, Any]]:
    """Responses input items -> OpenAI chat messages (validated afterwards by normalize_messages)."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(raw, str):
        return messages + [{"role": "user", "content": raw}]
    check_type(raw, "array", "input")
    if not raw:
        raise invalid("input", "'input' must not be empty.", code="empty_array")
    reasoning: list[str] = []
    for i, item in enumerate(raw):
        p = f"input[{i}]"
        check_type(item, "object", p)
        kind = get(item, "type", "string", f"{p}.type", default="message")
        if kind == "message":
            m = _message(item, p)
            if m["role"] == "assistant" and reasoning:
                m["reasoning_content"] = "\n".join(reasoning)
                reasoning = []
            messages.append(m)
        elif kind == "function_call":
            call = {"id": require(item, "call_id", "string", f"{p}.call_id"), "type": "function",
                    "function": {"name": require(item, "name", "string", f"{p}.name"),
                                 "arguments": require(item, "arguments", "string", f"{p}.arguments")}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                m = {"role": "assistant", "content": None, "tool_calls": [call]}
                if reasoning:
                    m["reasoning_content"] = "\n".join(reasoning)
                    reasoning = []
                messages.append(m)
        elif kind == "function_call_output":
            out = item.get("output")
            text = _text_of(out, f"{p}.output", ("input_text",)) if isinstance(out, list) \
                else require(item, "output", "string", f"{p}.output")
            messages.append({"role": "tool", "tool_call_id": require(item, "call_id", "string", f"{p}.call_id"),
                             "content": text})
        elif kind == "reasoning":
            for j, c in enumerate(get(item, "content", "array", f"{p}.content", default=[])):
                check_type(c, "object", f"{p}.content[{j}]")
                reasoning.append(require(c, "text", "string", f"{p}.content[{j}].text"))
        elif kind == "item_reference":
            raise invalid(f"{p}.type", f"Item references are not supported. {STATEFUL}", code="unsupported_value")
        else:
            raise invalid(f"{p}.type", f"Invalid input item type '{kind}' in '{p}': supported are 'message', "
                                       f"'function_call', 'function_call_output' and 'reasoning'.",
                          code="invalid_value")
    return messages


def _tools(raw: Any) -> list[dict[str, Any]] | None:
    if raw is None:
        return None
    check_type(raw, "array", "tools")
    chat_tools = []
    for i, t in enumerate(raw):
        p = f"tools[{i}]"
        check_type(t, "object", p)
        kind = require(t, "type", "string", f"{p}.type")
        if kind != "function":
            raise invalid(f"{p}.type", f"Invalid value for '{p}.type': '{kind}'. Only 'function' tools are "
                                       f"supported by this server.", code="unsupported_value")
        fn = {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}
        chat_tools.append({"type": "function", "function": fn})
    try:
        return normalize_tools(chat_tools)
    except ApiError as e:  # it names tools[i].function.x; the Responses field is tools[i].x
        e.param = (e.param or "").replace(".function.", ".")
        e.message = e.message.replace(".function.", ".")
        raise


def text_format(data: Mapping[str, Any]) -> tuple[dict[str, Any], OutputFormat | None]:
    """`text.format` -> (its echo, the OutputFormat): {"type": "text"} (the default), {"type": "json_object"}, or
    {"type": "json_schema", "name": ..., "schema": {...}, "strict": ...} (the Responses API's flat shape)."""
    text = get(data, "text", "object", default={})
    fmt = get(text, "format", "object", "text.format", default={"type": "text"})
    if fmt.get("type") == "json_schema":
        return {"format": dict(fmt)}, schema_format(fmt.get("schema", {}), "text.format.schema")
    out = parse_response_format(fmt, "text.format")
    return {"format": {"type": fmt.get("type")}}, out


def _tool_choice(v: Any, tools: list[dict[str, Any]] | None, parallel: bool):
    """The Responses spelling ({"type": "function", "name": N}) through the chat route's parse_tool_choice."""
    if isinstance(v, dict) and v.get("type") == "function" and "function" not in v:
        v = {"type": "function", "function": {"name": v.get("name")}}
    try:
        choice, fmt = parse_tool_choice(v, tools, parallel)
    except ApiError as e:
        e.param = (e.param or "").replace("tool_choice.function.", "tool_choice.").replace(".function.", ".")
        e.message = e.message.replace(".function.parameters", ".parameters")
        raise
    if fmt is not None:      # the parts' paths name tools[i].parameters, the Responses field
        fmt = replace(fmt, probes=tuple((p.replace(".function.", "."), s) for p, s in fmt.probes))
    return choice, fmt


def _echo_tool_choice(raw: Any, parsed: str | None) -> Any:
    return raw if parsed == "function" else parsed or "auto"


def _reasoning(data: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(reasoning echo, template kwargs)."""
    r = get(data, "reasoning", "object", default={})
    effort = get(r, "effort", "string", "reasoning.effort")
    if effort is not None and effort not in ("none", "minimal", "low", "medium", "high", "xhigh"):
        raise invalid("reasoning.effort", f"Invalid value for 'reasoning.effort': '{effort}'.", code="invalid_value")
    kwargs = {"enable_thinking": False} if effort == "none" else {}
    return {"effort": effort, "summary": None}, kwargs


def parse_responses_request(body: bytes, *, defaults: Mapping[str, Any] | None = None,
                            context_length: int | None = None, images_supported: bool = False,
                            images_hint: str = "") -> ResponsesRequest:
    data = load_json_object(body)
    for key in ("previous_response_id", "conversation"):
        if data.get(key) is not None:
            raise invalid(key, f"'{key}' is not supported. {STATEFUL}", code="unsupported_parameter")
    if get(data, "store", "boolean", default=False):
        raise invalid("store", f"'store': true is not supported. {STATEFUL} Send 'store': false.",
                      code="unsupported_value")
    if get(data, "background", "boolean", default=False):
        raise invalid("background", "'background' responses are not supported; use stream: true.",
                      code="unsupported_value")
    if data.get("input") is None:
        raise invalid("input", "Missing required parameter: 'input'.", code="missing_required_parameter")
    instructions = get(data, "instructions", "string")
    messages = normalize_messages(to_chat_messages(data["input"], instructions), images_supported=images_supported,
                                  images_hint=images_hint)
    model = get(data, "model", "string")
    max_tokens = get(data, "max_output_tokens", "integer")
    if max_tokens is not None:
        if max_tokens < MIN_OUTPUT_TOKENS:
            raise invalid("max_output_tokens", f"Invalid 'max_output_tokens': integer below minimum value. "
                                               f"Expected a value >= {MIN_OUTPUT_TOKENS}, but got {max_tokens} "
                                               f"instead.", code="integer_below_min_value")
        if context_length is not None and max_tokens > context_length:
            raise invalid("max_output_tokens", f"'max_output_tokens' is too large: {max_tokens}. This model's "
                                               f"context length is {context_length} tokens.", code="invalid_value")
    top_logprobs = get(data, "top_logprobs", "integer")
    if top_logprobs:
        raise invalid("top_logprobs", "'top_logprobs' is not supported on /v1/responses by this server; use "
                                      "/v1/chat/completions.", code="unsupported_parameter")
    sampling = _sampling(data, defaults, {})
    tools = _tools(data.get("tools"))
    parallel = get(data, "parallel_tool_calls", "boolean", default=True)
    tool_choice, forced = _tool_choice(data.get("tool_choice"), tools, parallel)
    if tool_choice == "none":
        tools = None
    fmt, output_format = text_format(data)
    output_format = forced or output_format
    reasoning, kwargs = _reasoning(data)
    if output_format is not None and reasoning["effort"] is None:
        kwargs = {"enable_thinking": False}
    stream = get(data, "stream", "boolean", default=False)
    req = ChatRequest(messages=messages, sampling=sampling, model=model, max_tokens=max_tokens, stream=stream,
                      tools=tools, tool_choice=tool_choice if tools else None, template_kwargs=kwargs,
                      output_format=output_format,
                      parallel_tool_calls=get(data, "parallel_tool_calls", "boolean"))
    echo = {"instructions": instructions, "max_output_tokens": max_tokens,
            "metadata": get(data, "metadata", "object", default={}),
            "parallel_tool_calls": parallel,
            "reasoning": reasoning, "temperature": sampling.temperature, "text": fmt,
            "tool_choice": _echo_tool_choice(data.get("tool_choice"), tool_choice), "tools": list(data.get("tools") or []),
            "top_p": sampling.top_p, "user": get(data, "user", "string")}
    return ResponsesRequest(request=req, echo=echo)
