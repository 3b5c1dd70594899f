"""Tools for models whose chat template has no tool section (SmolLM2's, many Llama-family GGUFs'): the request
side of llama.cpp's "generic" tool calling. The output side is protocol/generic_tool_calls.py.

Policies:
- The choice: such a template renders the messages and drops `tools` without a word, so a request with tools
  used to reach the model exactly as one without (same prompt tokens) and agents got plain text. We do what
  llama.cpp's server does for these templates instead of refusing as Ollama does (400 "<model> does not support
  tools"): the appliance serves small models to agents (Home Assistant, LangChain, the openai SDK) that send
  tools on every request, so a 400 would make the default model (SmolLM2) unusable for them, while constrained
  decoding (llguidance) makes the generic format's output parseable by construction, however small the model.
  So /api/show lists `tools` among every model's capabilities.
- Which templates: ChatTemplate.renders_tools (a probe tool's name must reach the rendered prompt). Templates
  that render tools (Qwen3's) are untouched: their own format, their own parser, no added prompt.
- The prompt: a system message (appended to the request's first system message, else placed first) lists each
  tool as one line of JSON (name, description, parameters) and names the answer's shape, see
  generic_tool_calls.py; the model's earlier calls are rendered in that shape in their assistant turns, and
  tool results become user turns `{"tool_response": {"tool": name, "tool_call_id": id, "content": ...}}`, since
  the template renders neither (this also holds for a request without tools whose history has calls).
- The grammar (OutputFormat "generic_tool_calls"): tool_choice "auto" allows `{"response": "..."}` or calls;
  "required" and a named function allow calls only (a named function: exactly one call to it). One call is
  `{"tool_call": ...}`; only a request that sets parallel_tool_calls: true gets `{"tool_calls": [...]}` (one or
  more): llama.cpp's default, since a small model given a list repeats its call until max_tokens. A
  response_format (json_object / json_schema, Ollama's `format`) with tools becomes the response's schema
  (content is then that JSON value's text), as llama.cpp does. As with any output format, thinking defaults off.
"""
from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from appliance.protocol.requests import ChatRequest
from appliance.protocol.structured import OutputFormat, parse_tool_choice

STRING_RESPONSE = {"type": "string"}


def has_tool_turns(messages: list[dict[str, Any]]) -> bool:
    return any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)


def generic_tool_request(req: ChatRequest) -> ChatRequest:
    """The request as a template without a tool section needs it: its tools in a system message, its tool turns
    as text, and the generic format's grammar; unchanged when it has neither tools nor tool turns."""
    if not req.tools and not has_tool_turns(req.messages):
        return req
    many = req.parallel_tool_calls is True and req.tool_choice != "function"
    messages = tool_turns_as_text(req.messages, many)
    if not req.tools:
        return replace(req, messages=messages)
    if req.tool_choice in ("required", "function"):
        calls, response, probes = req.output_format, None, ()
    else:
        calls = parse_tool_choice("required", req.tools)[1]
        response = response_schema(req.output_format)
        probes = req.output_format.probes if req.output_format is not None else ()
    assert calls is not None  # parse_tool_choice gives a tool choice its OutputFormat
    fmt = OutputFormat("generic_tool_calls", schema=response, tools=calls.tools, parallel=many,
                       probes=calls.probes + probes)
    prompt = system_prompt(req.tools, fmt, forced=calls.tools[0][0] if req.tool_choice == "function" else None)
    kwargs = {"enable_thinking": False, **req.template_kwargs}
    return replace(req, messages=with_system(messages, prompt), output_format=fmt, template_kwargs=kwargs,
                   tool_format="generic")


def response_schema(fmt: OutputFormat | None) -> Any:
    """What `{"response": ...}` holds: a string, or the request's own JSON output format."""
    if fmt is None:
        return STRING_RESPONSE
    return {"type": "object"} if fmt.kind == "json" else fmt.schema


def _example(fmt: OutputFormat, name: str) -> str:
    call = '{"name": "%s", "arguments": {...}}' % name
    return '{"tool_calls": [%s]}' % call if fmt.parallel else '{"tool_call": %s}' % call


def system_prompt(tools: list[dict[str, Any]], fmt: OutputFormat, forced: str | None = None) -> str:
    """The generic format's instructions: the tools, one JSON line each, and the answer's shape."""
    lines = [json.dumps({k: t["function"][k] for k in ("name", "description", "parameters") if k in t["function"]},
                        ensure_ascii=False) for t in tools]
    text = ("You can call tools. Each line below is one tool: its name, what it does, and the JSON Schema of its "
            "arguments.\n" + "\n".join(lines) + "\n\nAnswer with one JSON object and nothing else.")
    if forced is not None:
        return text + f" Call the tool {forced}: {_example(fmt, forced)}"
    calls = _example(fmt, "<tool name>")
    many = " (one or more calls)" if fmt.parallel else ""
    if fmt.schema is None:
        return text + f" Call a tool: {calls}{many}"
    reply = ('{"response": "<your reply>"}' if fmt.schema == STRING_RESPONSE else
             '{"response": <your reply: JSON following the schema %s>}' % json.dumps(fmt.schema, ensure_ascii=False))
    return text + f" To call a tool: {calls}{many}. To reply to the user: {reply}"


def with_system(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    if messages and messages[0].get("role") == "system" and isinstance(messages[0].get("content"), str):
        first = messages[0]
        joined = f"{first['content']}\n\n{text}" if first["content"] else text
        return [{**first, "content": joined}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def _arguments(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def tool_turns_as_text(messages: list[dict[str, Any]], many: bool) -> list[dict[str, Any]]:
    """Assistant tool calls as the generic format's JSON in their content; tool results as user turns."""
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            items = [{"name": c["function"]["name"], "arguments": _arguments(c["function"].get("arguments", {}))}
                     for c in calls]
            names.update((c["id"], c["function"]["name"]) for c in calls if c.get("id"))
            obj = {"tool_calls": items} if many or len(items) > 1 else {"tool_call": items[0]}
            text = m.get("content") if isinstance(m.get("content"), str) else ""
            m = {k: v for k, v in m.items() if k != "tool_calls"}
            m["content"] = (text + "\n" if text else "") + json.dumps(obj, ensure_ascii=False)
        elif m.get("role") == "tool":
            result: dict[str, Any] = {}
            name = m.get("name") or names.get(m.get("tool_call_id", ""))
            if name:
                result["tool"] = name
            if m.get("tool_call_id"):
                result["tool_call_id"] = m["tool_call_id"]
            result["content"] = m.get("content", "")
            m = {"role": "user", "content": json.dumps({"tool_response": result}, ensure_ascii=False)}
        out.append(m)
    return out
