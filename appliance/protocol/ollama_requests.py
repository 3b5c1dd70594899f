"""Parse and validate Ollama API bodies (/api/chat, /api/generate) into the same ChatRequest the OpenAI routes use.

Policies:
- Bytes in, a request out, or an ApiError(400) naming the field; the route renders it in Ollama's error shape
  `{"error": "..."}`. Unknown top-level fields and unknown `options` are ignored, as Ollama does.
- Messages: Ollama's shape (`images` as base64 strings beside `content`, `tool_calls` with object arguments,
  `thinking`, `tool_name`) -> OpenAI's shape, then the same normalize_messages as /v1/chat/completions. A
  message's images come before its text (one image_url part each, as a data: URI).
- options -> sampling: temperature, top_p, top_k, min_p, seed, presence_penalty, frequency_penalty,
  repeat_penalty (-> repetition_penalty), stop, num_predict (-1 and -2: up to the context; 0 and other
  negatives are a 400), num_ctx (a smaller context for this request; larger is capped at the model's).
- think: true / a level string -> the template's enable_thinking on; false -> off; absent -> the template's
  default. Thinking is always split into the `thinking` field (newer Ollama's behaviour).
- format: "json" (any JSON object) or a JSON schema -> the request's output_format (constrained decoding, the
  same limits as OpenAI's response_format; errors name `format`); with a format and no `think`, thinking is off. keep_alive is accepted (a number or a duration string) and changes nothing: the model stays loaded.
- An empty `messages` (chat) or empty `prompt` without images (generate) is Ollama's load / unload request:
  answered at once, no generation.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any, Mapping

from appliance.protocol.errors import ApiError
from appliance.protocol.fields import check_type, get, invalid, load_json_object
from appliance.protocol.messages import PART_PARAM, normalize_messages, normalize_tools
from appliance.protocol.requests import ChatRequest, _sampling
from appliance.protocol.structured import OutputFormat, schema_format

MAX_STOP = 16
_DURATION = re.compile(r"^-?(\d+(\.\d*)?(ns|us|µs|ms|s|m|h))+$|^-?\d+(\.\d*)?$")
# Ollama option -> (our sampling field, JSON kind)
SAMPLING_OPTIONS = {"temperature": ("temperature", "number"), "top_p": ("top_p", "number"),
                    "top_k": ("top_k", "integer"), "min_p": ("min_p", "number"), "seed": ("seed", "integer"),
                    "presence_penalty": ("presence_penalty", "number"),
                    "frequency_penalty": ("frequency_penalty", "number"),
                    "repeat_penalty": ("repetition_penalty", "number")}


@dataclass(frozen=True)
class OllamaRequest:
    request: ChatRequest              # what the engine path needs (messages, sampling, limits, tools, template,
                                      # model, `format` as output_format, `think` as template_kwargs)
    num_ctx: int | None = None        # a smaller context for this request
    load_only: bool = False           # empty messages / prompt: Ollama's load (or unload) request
    unload: bool = False              # keep_alive 0 with nothing to generate
    # /api/generate only
    raw: bool = False
    prompt: str = ""
    context: tuple[int, ...] = ()


def image_data_uri(b64: str) -> str:
    """Ollama sends bare base64; the image type is sniffed from its first bytes (Pillow decodes by content)."""
    head = b64.lstrip()[:8]
    mime = ("image/png" if head.startswith("iVBOR") else "image/jpeg" if head.startswith("/9j/")
            else "image/webp" if head.startswith("UklGR") else "image/unknown")
    return f"data:{mime};base64,{b64}"


def _images(v: Any, param: str) -> list[dict[str, Any]]:
    imgs = get({"v": v}, "v", "array", param, default=[])
    parts = []
    for i, img in enumerate(imgs):
        check_type(img, "string", f"{param}[{i}]")
        parts.append({"type": "image_url", "image_url": {"url": image_data_uri(img)}, PART_PARAM: f"{param}[{i}]"})
    return parts


def _tool_calls(v: Any, param: str) -> list[dict[str, Any]]:
    out = []
    for k, call in enumerate(check_type(v, "array", param)):
        check_type(call, "object", f"{param}[{k}]")
        fn = get(call, "function", "object", f"{param}[{k}].function", default={})
        entry = {"type": "function", "function": {"name": fn.get("name"), "arguments": fn.get("arguments", {})}}
        if call.get("id") is not None:
            entry["id"] = call["id"]
        out.append(entry)
    return out


def to_openai_messages(raw: Any) -> list[dict[str, Any]]:
    """Ollama messages -> OpenAI chat messages (validated afterwards by normalize_messages)."""
    check_type(raw, "array", "messages")
    out = []
    for i, msg in enumerate(raw):
        p = f"messages[{i}]"
        check_type(msg, "object", p)
        m: dict[str, Any] = {"role": msg.get("role")}
        content = get(msg, "content", "string", f"{p}.content", default="")
        images = _images(msg.get("images"), f"{p}.images")
        m["content"] = images + [{"type": "text", "text": content}] if images else content
        if msg.get("tool_calls"):
            m["tool_calls"] = _tool_calls(msg["tool_calls"], f"{p}.tool_calls")
        thinking = get(msg, "thinking", "string", f"{p}.thinking")
        if thinking:
            m["reasoning_content"] = thinking
        name = get(msg, "tool_name", "string", f"{p}.tool_name")
        if name is not None:
            m["name"] = name
        out.append(m)
    return out


def _keep_alive(v: Any) -> float | str | None:
    """A number of seconds or a Go duration string ("5m", "1h30m", "-1"); returns it (only 0 matters to us)."""
    if v is None or isinstance(v, (int, float)) and not isinstance(v, bool):
        return v
    if isinstance(v, str) and _DURATION.match(v.strip()):
        return v
    raise invalid("keep_alive", f"Invalid 'keep_alive': {v!r}; use a number of seconds or a duration such as "
                                f"\"5m\".", code="invalid_value")


def _zero(keep_alive: Any) -> bool:
    if isinstance(keep_alive, str):
        return re.fullmatch(r"-?0+(\.0*)?(ns|us|µs|ms|s|m|h)?", keep_alive.strip()) is not None
    return keep_alive == 0


def response_format(data: Mapping[str, Any]) -> OutputFormat | None:
    """`format`: "" / absent -> none; "json" -> any JSON object; a JSON-schema object -> that schema."""
    f = data.get("format")
    if f is None or f == "":
        return None
    if f == "json":
        return OutputFormat("json")
    if not isinstance(f, dict):
        raise invalid("format", f"Invalid 'format': {f!r}; use \"json\" or a JSON schema object.",
                      code="invalid_value")
    return schema_format(f, "format")


def _options(data: Mapping[str, Any], defaults: Mapping[str, Any] | None, context_length: int | None):
    """(sampling, max_tokens, stop, num_ctx) from `options`; unknown options are ignored."""
    opts = get(data, "options", "object", default={})
    given: dict[str, Any] = {}
    sampling_body: dict[str, Any] = {}
    for name, (ours, kind) in SAMPLING_OPTIONS.items():
        v = get(opts, name, kind, f"options.{name}")
        if v is not None:
            sampling_body[ours] = v
    try:
        sampling = _sampling(sampling_body, defaults, given)
    except ApiError as e:  # it names our field: name Ollama's option instead
        param = e.param
        for name, (ours, _) in SAMPLING_OPTIONS.items():
            if param == ours:
                e.param = f"options.{name}"
        raise
    num_ctx = get(opts, "num_ctx", "integer", "options.num_ctx")
    if num_ctx is not None:
        if num_ctx < 1:
            raise invalid("options.num_ctx", f"Invalid 'options.num_ctx': {num_ctx}. Expected a value >= 1.",
                          code="invalid_value")
        if context_length is not None:
            num_ctx = min(num_ctx, context_length)
    limit = num_ctx or context_length
    n = get(opts, "num_predict", "integer", "options.num_predict")
    if n in (-1, -2):
        n = None                            # -1: until the model stops, -2: fill the context
    elif n is not None and n <= 0:
        raise invalid("options.num_predict", f"Invalid 'options.num_predict': {n}. Use a positive number of tokens, "
                                             f"-1 (until the model stops) or -2 (fill the context).",
                      code="invalid_value")
    if n is not None and limit is not None:
        n = min(n, limit)                   # Ollama stops at the context; we do the same
    stop_v = opts.get("stop")
    stop: tuple[str, ...] = ()
    if stop_v is not None:
        items = [stop_v] if isinstance(stop_v, str) else check_type(stop_v, "array", "options.stop")
        if len(items) > MAX_STOP:
            raise invalid("options.stop", f"'options.stop' holds {len(items)} strings; at most {MAX_STOP}.",
                          code="array_above_max_length")
        stop = tuple(dict.fromkeys(check_type(x, "string", f"options.stop[{i}]") for i, x in enumerate(items)
                                   if x != ""))
    return sampling, n, stop, num_ctx


def _think(data: Mapping[str, Any]) -> tuple[bool | str | None, dict[str, Any]]:
    think = data.get("think")
    if think is None:
        return None, {}
    if not isinstance(think, bool):
        if think not in ("high", "medium", "low"):
            raise invalid("think", f"Invalid 'think': {think!r}; use true, false, \"low\", \"medium\" or "
                                   f"\"high\".", code="invalid_value")
    return think, {"enable_thinking": think is not False}


def _common(data: Mapping[str, Any], defaults, context_length, messages, tools) -> OllamaRequest:
    model = get(data, "model", "string")
    if not model:
        raise invalid("model", "model is required", code="missing_required_parameter")
    stream = get(data, "stream", "boolean", default=True)       # Ollama streams unless told not to
    keep_alive = _keep_alive(data.get("keep_alive"))
    fmt = response_format(data)
    sampling, max_tokens, stop, num_ctx = _options(data, defaults, context_length)
    think, kwargs = _think(data)
    if fmt is not None and think is None:
        kwargs = {"enable_thinking": False}
    req = ChatRequest(messages=messages, sampling=sampling, model=model, max_tokens=max_tokens, stop=stop,
                      stream=stream, tools=tools, tool_choice="auto" if tools else None, template_kwargs=kwargs,
                      output_format=fmt)
    return OllamaRequest(request=req, num_ctx=num_ctx, unload=_zero(keep_alive))


def parse_ollama_chat(body: bytes, *, defaults: Mapping[str, Any] | None = None, context_length: int | None = None,
                      images_supported: bool = False, images_hint: str = "") -> OllamaRequest:
    data = load_json_object(body)
    raw = data.get("messages")
    if raw is None or raw == []:
        base = _common(data, defaults, context_length, [], None)
        return replace(base, load_only=True)
    messages = normalize_messages(to_openai_messages(raw), images_supported=images_supported, images_hint=images_hint)
    tools = normalize_tools(data.get("tools"))
    return _common(data, defaults, context_length, messages, tools)


def parse_ollama_generate(body: bytes, *, defaults: Mapping[str, Any] | None = None,
                          context_length: int | None = None, images_supported: bool = False,
                          images_hint: str = "") -> OllamaRequest:
    data = load_json_object(body)
    prompt = get(data, "prompt", "string", default="")
    system = get(data, "system", "string")
    raw = get(data, "raw", "boolean", default=False)
    if get(data, "suffix", "string"):
        raise invalid("suffix", "'suffix' (fill-in-the-middle) is not supported by this server.",
                      code="unsupported_parameter")
    if get(data, "template", "string"):
        raise invalid("template", "'template' overrides are not supported; the model's own chat template is "
                                  "used (or send raw: true with a formatted prompt).", code="unsupported_parameter")
    context = get(data, "context", "array", default=[])
    for i, t in enumerate(context):
        check_type(t, "integer", f"context[{i}]")
        if t < 0:
            raise invalid(f"context[{i}]", f"Invalid 'context[{i}]': token ids are non-negative.",
                          code="invalid_value")
    images = _images(data.get("images"), "images")
    if images and raw:
        raise invalid("images", "'images' need the chat template; they cannot be sent with raw: true.",
                      code="unsupported_value")
    load_only = not prompt and not images and not context
    messages: list[dict[str, Any]] = []
    if not raw and not load_only:
        if system:
            messages.append({"role": "system", "content": system})
        messages.append({"role": "user", "content": images + [{"type": "text", "text": prompt}] if images
                         else prompt})
        messages = normalize_messages(messages, images_supported=images_supported, images_hint=images_hint)
    base = _common(data, defaults, context_length, messages, None)
    return replace(base, raw=raw, prompt=prompt, context=tuple(context), load_only=load_only)
