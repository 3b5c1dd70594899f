"""Parse and validate POST /v1/messages and /v1/messages/count_tokens bodies (Anthropic's Messages API) into a
ChatRequest.

Policies:
- Bytes in, a request out, or an ApiError(400) naming the field in Anthropic's dotted path (`messages.0.content.1`;
  the body is rendered in Anthropic's error shape by anthropic_stream.error_body). Unknown fields are ignored
  (metadata, service_tier, container, anthropic-beta extras); `cache_control` on any block is accepted and ignored
  (our prefix reuse needs no markers: every request reuses the longest prefix it shares with a cached sequence).
- max_tokens is required (as Anthropic requires), a positive integer. It is not refused for exceeding the
  context (clients such as Claude Code send 32000 whatever the model): the server lowers it to the room the
  prompt leaves, and a generation that stops there ends with stop_reason "model_context_window_exceeded".
- system: a string or text blocks (joined with no separator) -> a system message first.
- messages: roles "user" and "assistant" only; content a string or blocks: text; image (source base64 with
  media_type + data, or url: what server/images.py accepts, so data: URIs and files under --image-dir, never the
  network), user turns only, models that take images only; tool_use (assistant: id, name, input object) ->
  the turn's tool_calls; tool_result (user: tool_use_id, content a string or text blocks, is_error) -> a tool
  message, placed before the turn's other content as Anthropic orders them; thinking (assistant) -> the turn's
  reasoning_content (the template puts it back inside <think>); redacted_thinking is dropped. Any other block type
  (document, search_result, server tool blocks) is a 400 naming the block.
- A final assistant message is a prefill, as Anthropic's: the prompt is the template's rendering with that turn
  cut right after its text (continue_final_message), and the answer continues it (the response holds only the
  new text). Its content must be text without trailing whitespace (Anthropic's 400), no tool_use; an empty one
  is dropped.
- tools: custom tools (`type` absent or "custom": name, description, input_schema) -> function tools; Anthropic's
  own tool types (bash_*, text_editor_*, web_search_*, ...) are a 400 naming the tool. tool_choice: auto / any
  (-> "required": a call is forced) / tool {name} (that call is forced) / none (tools dropped);
  disable_parallel_tool_use -> parallel_tool_calls false (absent: not given, so the generic tool format of
  templates without tools keeps its one-call default, protocol/generic_tools.py).
- thinking: {"type": "enabled", "budget_tokens": N} (or "adaptive") -> the template's enable_thinking on,
  {"type": "disabled"} -> off, absent -> the template's default (as llama.cpp's and Ollama's Anthropic routes do;
  with a forced tool choice, off, as every API here does for an output constraint). budget_tokens is checked
  (an integer >= 1) but not enforced: generation stops only at max_tokens. Enabled thinking with a forced tool
  choice is a 400, as Anthropic answers it.
- stop_sequences: strings (empty ones dropped), at most MAX_STOP_SEQUENCES. temperature / top_p / top_k as the
  other routes validate them (SamplingParams).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any, Mapping

from appliance.protocol.errors import ApiError
from appliance.protocol.fields import (
    check_type,
    get,
    invalid,
    load_json_object,
    require,
)
from appliance.protocol.messages import PART_PARAM, normalize_messages, normalize_tools
from appliance.protocol.requests import ChatRequest, _sampling
from appliance.protocol.structured import parse_tool_choice

MAX_STOP_SEQUENCES = 64
IMAGE_MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")
THINKING_TYPES = ("enabled", "disabled", "adaptive")
_TOOL_SCHEMA = re.compile(r"tools\[(\d+)\]\.function\.parameters")
_TOOL_PART = re.compile(r"tools\[(\d+)\](\.function\.)?")


@dataclass(frozen=True)
class AnthropicRequest:
    request: ChatRequest
    max_tokens: int | None           # as the client asked (request.max_tokens may be lowered to the context)
    prefill: bool = False            # the last message is the assistant's: render it open, continue its text

    @property
    def prefill_text(self) -> str | None:
        return self.request.messages[-1]["content"] if self.prefill else None


def continue_final_message(prompt: str, prefill: str) -> str:
    """The prompt rendered with the prefill as a closed last turn, cut right after the prefill's text (what
    transformers' continue_final_message does): the model continues the assistant's words."""
    i = prompt.rfind(prefill)
    if i < 0:
        raise invalid("messages", "The chat template changed the final assistant message; it cannot be continued "
                                  "(prefill).", code="invalid_value")
    return prompt[:i + len(prefill)]


def _blocks(v: Any, p: str) -> list[dict[str, Any]]:
    check_type(v, "array", p)
    for j, b in enumerate(v):
        check_type(b, "object", f"{p}.{j}")
        require(b, "type", "string", f"{p}.{j}.type")
    return v


def _unknown_block(kind: str, pp: str, allowed: tuple[str, ...]) -> ApiError:
    return invalid(f"{pp}.type", f"{pp}.type: unsupported content block type '{kind}'; supported here are "
                                 + ", ".join(f"'{a}'" for a in allowed) + ".", code="invalid_value")


def _text_blocks(v: Any, p: str, what: str) -> str:
    """A string, or text blocks joined (system prompts, tool results)."""
    if isinstance(v, str):
        return v
    parts = []
    for j, b in enumerate(_blocks(v, p)):
        if b["type"] != "text":
            raise _unknown_block(b["type"], f"{p}.{j}", ("text",)) if what != "tool_result" else invalid(
                f"{p}.{j}.type", f"{p}.{j}.type: '{b['type']}' blocks in a tool_result are not supported; send "
                                 f"text.", code="invalid_value")
        parts.append(require(b, "text", "string", f"{p}.{j}.text"))
    return "".join(parts)


def _image(b: Mapping[str, Any], pp: str) -> dict[str, Any]:
    src = require(b, "source", "object", f"{pp}.source")
    kind = require(src, "type", "string", f"{pp}.source.type")
    if kind == "base64":
        media = require(src, "media_type", "string", f"{pp}.source.media_type")
        if media not in IMAGE_MEDIA_TYPES:
            raise invalid(f"{pp}.source.media_type", f"{pp}.source.media_type: '{media}' is not one of "
                                                     + ", ".join(f"'{m}'" for m in IMAGE_MEDIA_TYPES) + ".",
                          code="invalid_value")
        url = f"data:{media};base64," + require(src, "data", "string", f"{pp}.source.data")
    elif kind == "url":
        url = require(src, "url", "string", f"{pp}.source.url")
    else:
        raise invalid(f"{pp}.source.type", f"{pp}.source.type: '{kind}' is not supported; use 'base64' (or "
                                           f"'url' with a data: URI).", code="invalid_value")
    return {"type": "image_url", "image_url": {"url": url}, PART_PARAM: pp}


def _message(msg: Any, i: int) -> list[dict[str, Any]]:
    """One Anthropic message -> chat messages (tool results first, as their own tool messages)."""
    p = f"messages.{i}"
    check_type(msg, "object", p)
    role = require(msg, "role", "string", f"{p}.role")
    if role not in ("user", "assistant"):
        raise invalid(f"{p}.role", f"{p}.role: Input should be 'user' or 'assistant', got '{role}' (the system "
                                   f"prompt goes in the top-level 'system' field).", code="invalid_value")
    content = msg.get("content")
    if content is None:
        raise invalid(f"{p}.content", f"{p}.content: Field required.", code="missing_required_parameter")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    allowed = ("text", "image", "tool_result") if role == "user" else \
        ("text", "tool_use", "thinking", "redacted_thinking")
    parts: list[dict[str, Any]] = []
    tool_msgs: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    thinking: list[str] = []
    for j, b in enumerate(_blocks(content, f"{p}.content")):
        pp, kind = f"{p}.content.{j}", b["type"]
        if kind not in allowed:
            raise _unknown_block(kind, pp, allowed)
        if kind == "text":
            parts.append({"type": "text", "text": require(b, "text", "string", f"{pp}.text")})
        elif kind == "image":
            parts.append(_image(b, pp))
        elif kind == "tool_result":
            tid = require(b, "tool_use_id", "string", f"{pp}.tool_use_id")
            text = _text_blocks(b.get("content", ""), f"{pp}.content", "tool_result")
            if get(b, "is_error", "boolean", f"{pp}.is_error", default=False):
                text = "Error: " + text
            tool_msgs.append({"role": "tool", "tool_call_id": tid, "content": text})
        elif kind == "tool_use":
            inp = require(b, "input", "object", f"{pp}.input")
            calls.append({"id": require(b, "id", "string", f"{pp}.id"), "type": "function",
                          "function": {"name": require(b, "name", "string", f"{pp}.name"), "arguments": inp}})
        elif kind == "thinking":
            thinking.append(require(b, "thinking", "string", f"{pp}.thinking"))
    out = list(tool_msgs)
    if parts or calls or thinking or not tool_msgs:
        m: dict[str, Any] = {"role": role}
        if any(x["type"] == "image_url" for x in parts):
            m["content"] = parts
        else:
            m["content"] = "".join(x["text"] for x in parts)
        if calls:
            m["tool_calls"] = calls
        if thinking:
            m["reasoning_content"] = "\n".join(thinking)
        out.append(m)
    return out


def to_chat_messages(data: Mapping[str, Any]) -> list[dict[str, Any]]:
    """system + messages -> OpenAI chat messages (checked afterwards by normalize_messages)."""
    out: list[dict[str, Any]] = []
    system = data.get("system")
    if system is not None:
        text = _text_blocks(system, "system", "system")
        if text:
            out.append({"role": "system", "content": text})
    raw = data.get("messages")
    if raw is None:
        raise invalid("messages", "messages: Field required.", code="missing_required_parameter")
    check_type(raw, "array", "messages")
    if not raw:
        raise invalid("messages", "messages: at least one message is required.", code="invalid_value")
    for i, msg in enumerate(raw):
        out.extend(_message(msg, i))
    if raw[-1].get("role") == "assistant":        # a prefill: the answer continues this text
        p, last = f"messages.{len(raw) - 1}", out[-1]
        if last.get("tool_calls"):
            raise invalid(f"{p}.content", f"{p}.content: a final assistant message (prefill) cannot hold tool_use "
                                          f"blocks.", code="invalid_value")
        if not isinstance(last["content"], str) or last["content"] != last["content"].rstrip():
            raise invalid(f"{p}.content", f"{p}.content: final assistant content cannot end with trailing "
                                          f"whitespace.", code="invalid_value")
        if not last["content"]:
            out.pop()                                 # nothing to continue: an ordinary generation prompt
    return out


def _tools(raw: Any) -> list[dict[str, Any]] | None:
    if raw is None:
        return None
    check_type(raw, "array", "tools")
    chat_tools = []
    for i, t in enumerate(raw):
        p = f"tools.{i}"
        check_type(t, "object", p)
        kind = get(t, "type", "string", f"{p}.type", default="custom")
        if kind != "custom":
            raise invalid(f"{p}.type", f"{p}.type: '{kind}' tools (Anthropic's own tools) are not supported by this "
                                       f"server; send custom tools (name, description, input_schema).",
                          code="invalid_value")
        name = require(t, "name", "string", f"{p}.name")
        fn: dict[str, Any] = {"name": name, "parameters": require(t, "input_schema", "object", f"{p}.input_schema")}
        desc = get(t, "description", "string", f"{p}.description")
        if desc is not None:
            fn["description"] = desc
        chat_tools.append({"type": "function", "function": fn})
    try:
        return normalize_tools(chat_tools)
    except ApiError as e:  # it names tools[i].function.x; ours is tools.i.x
        e.param, e.message = anthropic_path(e.param or ""), anthropic_path(e.message)
        raise


def _tool_choice(v: Any, tools: list[dict[str, Any]] | None):
    """(chat tool_choice, its OutputFormat, parallel) of Anthropic's tool_choice object."""
    if v is None:
        return None, None, True
    check_type(v, "object", "tool_choice")
    kind = require(v, "type", "string", "tool_choice.type")
    parallel = not get(v, "disable_parallel_tool_use", "boolean", "tool_choice.disable_parallel_tool_use",
                       default=False)
    if kind in ("auto", "none"):
        return kind, None, parallel
    if kind == "any":
        chat: Any = "required"
    elif kind == "tool":
        chat = {"type": "function", "function": {"name": require(v, "name", "string", "tool_choice.name")}}
    else:
        raise invalid("tool_choice.type", f"tool_choice.type: '{kind}' is not one of 'auto', 'any', 'tool', "
                                          f"'none'.", code="invalid_value")
    try:
        choice, fmt = parse_tool_choice(chat, tools, parallel)
    except ApiError as e:
        e.param, e.message = anthropic_path(e.param or ""), anthropic_path(e.message)
        raise
    if fmt is not None:      # the parts' paths as the client named them: tools.i.input_schema...
        fmt = replace(fmt, probes=tuple((anthropic_path(p), s) for p, s in fmt.probes))
    return choice, fmt, parallel


def anthropic_path(text: str) -> str:
    """The chat route's names of a tool's parts (`tools[0].function.parameters`) as this API's fields."""
    text = _TOOL_SCHEMA.sub(lambda m: f"tools.{m.group(1)}.input_schema", text)
    text = _TOOL_PART.sub(lambda m: f"tools.{m.group(1)}" + ("." if m.group(2) else ""), text)
    return text.replace("tool_choice.function.name", "tool_choice.name")


def _thinking(data: Mapping[str, Any]) -> bool | None:
    t = get(data, "thinking", "object")
    if t is None:
        return None
    kind = require(t, "type", "string", "thinking.type")
    if kind not in THINKING_TYPES:
        raise invalid("thinking.type", f"thinking.type: '{kind}' is not one of 'enabled', 'disabled', 'adaptive'.",
                      code="invalid_value")
    if kind == "enabled":
        budget = require(t, "budget_tokens", "integer", "thinking.budget_tokens")
        if budget < 1:
            raise invalid("thinking.budget_tokens", f"thinking.budget_tokens: must be >= 1, got {budget}.",
                          code="invalid_value")
    return kind != "disabled"


def _stop_sequences(data: Mapping[str, Any]) -> tuple[str, ...]:
    raw = get(data, "stop_sequences", "array", default=[])
    if len(raw) > MAX_STOP_SEQUENCES:
        raise invalid("stop_sequences", f"stop_sequences: at most {MAX_STOP_SEQUENCES} are supported, got "
                                        f"{len(raw)}.", code="invalid_value")
    items = [check_type(s, "string", f"stop_sequences.{i}") for i, s in enumerate(raw)]
    return tuple(dict.fromkeys(s for s in items if s))


def _parse(data: Mapping[str, Any], defaults: Mapping[str, Any] | None, images_supported: bool,
           max_tokens: int | None, stream: bool) -> AnthropicRequest:
    messages = normalize_messages(to_chat_messages(data), images_supported=images_supported)
    sampling = _sampling({k: data.get(k) for k in ("temperature", "top_p", "top_k")}, defaults, {})
    tools = _tools(data.get("tools"))
    choice, forced, parallel = _tool_choice(data.get("tool_choice"), tools)
    if choice == "none":
        tools = None
    thinking = _thinking(data)
    if forced is not None and thinking:
        raise invalid("thinking", "Thinking may not be enabled when tool_choice forces tool use.",
                      code="invalid_value")
    kwargs: dict[str, Any] = {}
    if thinking is not None or forced is not None:
        kwargs["enable_thinking"] = bool(thinking)
    req = ChatRequest(messages=messages, sampling=sampling, model=get(data, "model", "string"),
                      max_tokens=max_tokens, stop=_stop_sequences(data), stream=stream, tools=tools,
                      tool_choice=choice if tools else None, template_kwargs=kwargs, output_format=forced,
                      parallel_tool_calls=False if tools and not parallel else None)
    return AnthropicRequest(req, max_tokens, prefill=messages[-1]["role"] == "assistant")


def parse_messages_request(body: bytes, *, defaults: Mapping[str, Any] | None = None,
                           images_supported: bool = False) -> AnthropicRequest:
    data = load_json_object(body)
    if data.get("max_tokens") is None:
        raise invalid("max_tokens", "max_tokens: Field required.", code="missing_required_parameter")
    max_tokens = check_type(data["max_tokens"], "integer", "max_tokens")
    if max_tokens < 1:
        raise invalid("max_tokens", f"max_tokens: must be >= 1, got {max_tokens}.", code="invalid_value")
    stream = get(data, "stream", "boolean", default=False)
    return _parse(data, defaults, images_supported, max_tokens, stream)


def parse_count_tokens_request(body: bytes, *, images_supported: bool = False) -> AnthropicRequest:
    """count_tokens' body: the same fields less max_tokens / stream / sampling (ignored if sent)."""
    data = load_json_object(body)
    return _parse(data, None, images_supported, None, False)
