"""Parse and validate /v1/chat/completions and /v1/completions request bodies.

Policies:
- Bytes in, a frozen request out, or an ApiError(400) naming the offending field (`param`), never another
  exception. Unknown fields are ignored, as OpenAI-compatible servers do.
- Sampling: the request's values over the model's defaults (generation_config.json), validated by
  SamplingParams; its SamplingParamError becomes a 400 with the same param. top_k = -1 means off (vLLM's
  spelling) and becomes 0 (ours).
- What we cannot honour is a clear 400, not silently ignored: n > 1, best_of > 1, non-empty logit_bias,
  echo with logprobs, suffix, several prompts in one request.
- response_format json_object / json_schema and a forced tool_choice become `output_format` (constrained
  decoding, protocol/structured.py); a forced tool call wins over response_format. With an output format the
  template's thinking defaults to off (a grammar starts at the first generated token; an explicit
  enable_thinking still wins).
- stop: a string or up to 4 strings, as OpenAI; empty strings are dropped (they would stop at once).
- max_tokens / max_completion_tokens (the latter wins): a positive integer no larger than the context;
  absent means "up to the context limit" for chat and 16 for /v1/completions (OpenAI's and vLLM's default).
- stream_options only with stream=true (as OpenAI). include_metrics / include_tokens default to the server's
  `stream_extensions` setting (the seed's deployment turns them on).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields as dc_fields
from typing import Any, Mapping

from appliance.engine.sampling import SamplingParamError, SamplingParams
from appliance.protocol import ToolFormat
from appliance.protocol.errors import ApiError
from appliance.protocol.fields import check_type, get, invalid, load_json_object
from appliance.protocol.messages import normalize_messages, normalize_tools
from appliance.protocol.structured import OutputFormat, parallel_tool_calls, parse_response_format, parse_tool_choice

MAX_STOP = 4
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# chat_template_kwargs may not replace what the server itself passes to the template
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "add_generation_prompt", "continue_final_message",
                                      "chat_template", "tokenize", "documents", "bos_token", "eos_token"})
_SAMPLING_FIELDS = {f.name for f in dc_fields(SamplingParams)}


@dataclass(frozen=True)
class StreamFlags:
    stream: bool = False
    include_usage: bool = False
    include_metrics: bool = False
    include_tokens: bool = False


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict[str, Any]]          # normalised, ready for the chat template
    sampling: SamplingParams
    model: str | None = None
    max_tokens: int | None = None           # None -> up to the context limit
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    include_metrics: bool = False
    include_tokens: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | None = None          # 'auto' | 'none' | 'required' | 'function' | None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    ignore_eos: bool = False
    output_format: OutputFormat | None = None   # constrained decoding (json_object / json_schema / forced tools)
    parallel_tool_calls: bool | None = None     # as the request gave it (None: not given)
    tool_format: ToolFormat = "template"    # how calls are written: the template's <tool_call> blocks, or
                                            # "generic" (protocol/generic_tools.py: templates without tools)

    @property
    def enable_thinking(self) -> bool:
        return self.template_kwargs.get("enable_thinking", True) is not False


@dataclass(frozen=True)
class CompletionRequest:
    prompt: str | list[int]                 # text, or token ids
    sampling: SamplingParams
    model: str | None = None
    max_tokens: int | None = COMPLETIONS_DEFAULT_MAX_TOKENS
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    include_metrics: bool = False
    include_tokens: bool = False
    echo: bool = False
    ignore_eos: bool = False


def _positive_int(body: Mapping[str, Any], key: str) -> int | None:
    v = get(body, key, "integer")
    if v is not None and v < 1:
        raise invalid(key, f"Invalid '{key}': integer below minimum value. Expected a value >= 1, but got {v} "
                           f"instead.", code="integer_below_min_value")
    return v


def _max_tokens(body: Mapping[str, Any], context_length: int | None, default: int | None) -> int | None:
    mct = _positive_int(body, "max_completion_tokens")
    mt = _positive_int(body, "max_tokens")
    value, key = (mct, "max_completion_tokens") if mct is not None else (mt, "max_tokens")
    if value is None:
        if default is not None and context_length is not None:
            return min(default, context_length)
        return default
    if context_length is not None and value > context_length:
        raise invalid(key, f"'{key}' is too large: {value}. This model's context length is {context_length} "
                           f"tokens.", code="invalid_value")
    return value


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    s = body.get("stop")
    if s is None:
        return ()
    if isinstance(s, str):
        items = [s]
    else:
        check_type(s, "array", "stop")
        if len(s) > MAX_STOP:
            raise invalid("stop", f"Invalid 'stop': array too long. Expected an array with maximum length "
                                  f"{MAX_STOP}, but got an array with length {len(s)} instead.",
                          code="array_above_max_length")
        items = [check_type(x, "string", f"stop[{i}]") for i, x in enumerate(s)]
    return tuple(dict.fromkeys(x for x in items if x))


def _sampling(body: Mapping[str, Any], defaults: Mapping[str, Any] | None, given: dict[str, Any]) -> SamplingParams:
    for key, kind in (("temperature", "number"), ("top_p", "number"), ("min_p", "number"), ("top_k", "integer"),
                      ("seed", "integer"), ("presence_penalty", "number"), ("frequency_penalty", "number"),
                      ("repetition_penalty", "number")):
        v = get(body, key, kind)
        if v is not None:
            given[key] = v
    if given.get("top_k") == -1:
        given["top_k"] = 0
    values = {k: v for k, v in (defaults or {}).items() if k in _SAMPLING_FIELDS}
    values.update(given)
    try:
        return SamplingParams(**values)
    except SamplingParamError as e:
        raise ApiError(400, str(e), param=e.param, code="invalid_value") from None


def _stream_flags(body: Mapping[str, Any], stream_extensions: bool) -> StreamFlags:
    stream = get(body, "stream", "boolean", default=False)
    opts = get(body, "stream_options", "object")
    if opts is None:
        return StreamFlags(stream, False, stream and stream_extensions, stream and stream_extensions)
    if not stream:
        raise invalid("stream_options", "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                      code="invalid_value")
    return StreamFlags(True,
                       get(opts, "include_usage", "boolean", "stream_options.include_usage", False),
                       get(opts, "include_metrics", "boolean", "stream_options.include_metrics", stream_extensions),
                       get(opts, "include_tokens", "boolean", "stream_options.include_tokens", stream_extensions))


def _common_rejects(body: Mapping[str, Any]) -> None:
    n = get(body, "n", "integer")
    if n is not None and n != 1:
        raise invalid("n", f"Invalid 'n': {n}. This server generates one choice per request; 'n' must be 1.",
                      code="unsupported_value")
    bias = get(body, "logit_bias", "object")
    if bias:
        raise invalid("logit_bias", "'logit_bias' is not supported by this server.", code="unsupported_parameter")


def parse_chat_request(body: bytes, *, defaults: Mapping[str, Any] | None = None,
                       context_length: int | None = None, images_supported: bool = False,
                       stream_extensions: bool = False, images_hint: str = "") -> ChatRequest:
    data = load_json_object(body)
    if data.get("messages") is None:
        _missing("messages")
    messages = normalize_messages(data["messages"], images_supported=images_supported, images_hint=images_hint)
    _common_rejects(data)
    model = get(data, "model", "string")
    max_tokens = _max_tokens(data, context_length, None)
    stop = _stop(data)
    flags = _stream_flags(data, stream_extensions)

    given: dict[str, Any] = {}
    logprobs = get(data, "logprobs", "boolean")
    if logprobs is not None:
        given["logprobs"] = logprobs
    top_logprobs = get(data, "top_logprobs", "integer")
    if top_logprobs is not None:
        given["top_logprobs"] = top_logprobs
    sampling = _sampling(data, defaults, given)

    output_format = parse_response_format(data.get("response_format"))
    tools = normalize_tools(data.get("tools"))
    tool_choice, forced = parse_tool_choice(data.get("tool_choice"), tools, parallel_tool_calls(data))
    if tool_choice == "none":
        tools = None
    output_format = forced or output_format

    kwargs = dict(get(data, "chat_template_kwargs", "object", default={}))
    bad = sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs))
    if bad:
        raise invalid("chat_template_kwargs", f"'chat_template_kwargs' may not set {', '.join(bad)}.",
                      code="invalid_value")
    thinking = get(data, "enable_thinking", "boolean")       # Qwen's top-level spelling of the same switch
    if thinking is not None:
        kwargs.setdefault("enable_thinking", thinking)
    if "enable_thinking" in kwargs:
        check_type(kwargs["enable_thinking"], "boolean", "chat_template_kwargs.enable_thinking")
    elif output_format is not None:
        kwargs["enable_thinking"] = False

    return ChatRequest(messages=messages, sampling=sampling, model=model, max_tokens=max_tokens, stop=stop,
                       stream=flags.stream, include_usage=flags.include_usage,
                       include_metrics=flags.include_metrics, include_tokens=flags.include_tokens,
                       tools=tools, tool_choice=tool_choice if tools else None, template_kwargs=kwargs,
                       ignore_eos=get(data, "ignore_eos", "boolean", default=False), output_format=output_format,
                       parallel_tool_calls=get(data, "parallel_tool_calls", "boolean"))


def _missing(key: str) -> None:
    raise invalid(key, f"Missing required parameter: '{key}'.", code="missing_required_parameter")


def _prompt(v: Any) -> str | list[int]:
    """A string or a list of token ids; a batch holding one of those is unwrapped, a larger batch refused."""
    if v is None:
        _missing("prompt")
    if isinstance(v, list) and v and all(isinstance(x, (str, list)) for x in v):
        if len(v) > 1:
            raise invalid("prompt", "Several prompts in one request are not supported; send one prompt per "
                                    "request.", code="unsupported_value")
        v = v[0]
    if isinstance(v, str):
        if not v:
            raise invalid("prompt", "'prompt' must not be empty.", code="invalid_value")
        return v
    check_type(v, "array", "prompt")
    if not v:
        raise invalid("prompt", "'prompt' must not be empty.", code="invalid_value")
    for i, t in enumerate(v):
        check_type(t, "integer", f"prompt[{i}]")
        if t < 0:
            raise invalid(f"prompt[{i}]", f"Invalid 'prompt[{i}]': token ids are non-negative, got {t}.",
                          code="invalid_value")
    return list(v)


def parse_completion_request(body: bytes, *, defaults: Mapping[str, Any] | None = None,
                             context_length: int | None = None,
                             stream_extensions: bool = False) -> CompletionRequest:
    data = load_json_object(body)
    prompt = _prompt(data.get("prompt"))
    _common_rejects(data)
    best_of = get(data, "best_of", "integer")
    if best_of is not None and best_of != 1:
        raise invalid("best_of", f"Invalid 'best_of': {best_of}. This server generates one choice per request.",
                      code="unsupported_value")
    if get(data, "suffix", "string"):
        raise invalid("suffix", "'suffix' (insertion) is not supported by this server.", code="unsupported_parameter")
    model = get(data, "model", "string")
    max_tokens = _max_tokens(data, context_length, COMPLETIONS_DEFAULT_MAX_TOKENS)
    stop = _stop(data)
    flags = _stream_flags(data, stream_extensions)
    echo = get(data, "echo", "boolean", default=False)

    given: dict[str, Any] = {}
    lp = get(data, "logprobs", "integer")          # legacy API: the number of alternatives (0 = chosen only)
    if lp is not None:
        if echo:
            raise invalid("echo", "'echo' together with 'logprobs' (prompt logprobs) is not supported.",
                          code="unsupported_value")
        if lp < 0:
            raise invalid("logprobs", f"Invalid 'logprobs': {lp}. Expected a value >= 0.", code="invalid_value")
        given["logprobs"] = True
        given["top_logprobs"] = lp
    try:
        sampling = _sampling(data, defaults, given)
    except ApiError as e:
        if e.param == "top_logprobs":      # our field name for the legacy 'logprobs' count
            e.param = "logprobs"
        raise
    return CompletionRequest(prompt=prompt, sampling=sampling, model=model, max_tokens=max_tokens, stop=stop,
                             stream=flags.stream, include_usage=flags.include_usage,
                             include_metrics=flags.include_metrics, include_tokens=flags.include_tokens,
                             echo=echo, ignore_eos=get(data, "ignore_eos", "boolean", default=False))
