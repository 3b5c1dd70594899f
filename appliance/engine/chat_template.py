"""ChatTemplate: the model's own Jinja chat template, rendered the way transformers renders it.

Policies:
- Templates are untrusted code from a model download: they run in jinja2's ImmutableSandboxedEnvironment
  with exactly the helpers transformers gives them (trim_blocks, lstrip_blocks, loopcontrols, tojson without
  ASCII escaping, raise_exception, strftime_now, a namespace that refuses underscore names) and nothing more,
  under a time, step and size budget per render (template_sandbox.py). A template that breaks the sandbox or
  its budget on a plain conversation is refused at load (`vet`, UnsafeTemplateError: one line, exit 2); one
  that does so only on some request's messages fails that request (400).
- The data a template sees is prepared as transformers' apply_chat_template prepares it: keys whose value is
  None are dropped from messages, only plain JSON data is passed, `thinking`/`reasoning` are aliased to
  `reasoning_content`, and the tokenizer's named special tokens (bos_token, eos_token, ...) are variables.
  Extra keyword arguments (enable_thinking, ...) pass through as variables and override those.
- Where the template comes from, first found wins (transformers' order): chat_template.jinja (plus named
  templates in additional_chat_templates/), tokenizer_config.json `chat_template` (a string or a list of
  {name, template}), chat_template.json. With several named templates, `tool_use` is used when tools are
  given and it exists, else `default`.
- Whether a template renders tools at all (renders_tools) is probed once, as llama.cpp's minja does: a user
  message with one made-up tool is rendered and the tool's name must appear in the text. Templates that fail
  the probe get the generic tool format (protocol/generic_tools.py).
- How the template writes an assistant's tool calls (call_style) is probed once the same way, by rendering one
  made-up call with its arguments as an object and as a JSON string: "xml" when it comes out as `<function=NAME>`
  with `<parameter=P>` blocks (Qwen3.5's and Qwen3-Coder's templates; protocol/xml_tool_calls.py parses them),
  else "json" (Qwen3's Hermes blocks); and whether only object arguments reach the text (Qwen3.5's template
  iterates `arguments|items`, as llama.cpp's caps probe calls requires_object_arguments). For such a template a
  call's arguments given as a JSON string (as OpenAI clients send them) are decoded to their object before
  rendering, as llama.cpp does; a string that is not a JSON object is a ChatTemplateError (a 400).
- Any failure while rendering (a raise_exception() in the template, a type error on malformed messages, a
  sandbox violation) surfaces as ChatTemplateError, a ValueError the server turns into a 400.
"""
from __future__ import annotations

import functools
import json
import os
from datetime import datetime
from typing import Any, Mapping, Sequence

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils

from appliance.engine.template_sandbox import BudgetedSandbox, TemplateRefused, run_budgeted
from appliance.engine.tokenizer import NAMED_SPECIAL_TOKENS, _token_content

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_PROBE_TOOL = "kestrel_probe_tool"
_PROBE_ARG, _PROBE_VALUE = "kestrel_probe_arg", "kestrel_probe_value"


class ChatTemplateError(ValueError):
    """The chat template could not be loaded or rendered for these messages."""


class UnsafeTemplateError(ChatTemplateError):
    """The chat template broke the sandbox or its budget (template_sandbox.py)."""


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja's namespace() that refuses underscore-prefixed attributes (no reaching CPython internals)."""

    def __init__(*args, **kwargs):  # same signature trick as jinja2.utils.Namespace
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attribute {name!r}")


class _TemplateDict:
    """`dict` for templates: calling and fromkeys only."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker): renders its body as is."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


def make_environment() -> BudgetedSandbox:
    env = BudgetedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.set_filter("tojson", _tojson)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


def plain_data(value: Any) -> Any:
    """Rebuild value out of plain JSON types (str/int/float/bool/None/dict/list/tuple) only."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain_data(k): plain_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain_data(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain_data(v) for v in value)
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        return plain_data(value.item())
    return f"<{type(value).__name__}>"


def prepare_messages(messages: Any) -> list[dict]:
    """Messages as the template sees them: plain dicts, None-valued keys dropped, reasoning aliases filled."""
    if not isinstance(messages, (list, tuple)):
        raise ChatTemplateError("messages must be a list of objects")
    out = []
    for m in messages:
        if not isinstance(m, Mapping):
            raise ChatTemplateError(f"each message must be an object, got {type(m).__name__}")
        m = plain_data({k: v for k, v in m.items() if v is not None})
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


class ChatTemplate:
    """One model's chat template(s): render(messages, tools, add_generation_prompt, **kwargs) -> prompt text."""

    def __init__(self, template: str | Mapping[str, str], special_tokens: Mapping[str, str | None] | None = None):
        templates = {"default": template} if isinstance(template, str) else dict(template)
        if not templates or not all(isinstance(t, str) for t in templates.values()):
            raise ChatTemplateError("chat template must be a string or a mapping of names to strings")
        env = make_environment()
        self._compiled = {}
        for name, source in templates.items():
            try:
                self._compiled[name] = env.compile_source(source)
            except TemplateRefused as e:
                raise UnsafeTemplateError(f"chat template {name!r} refused: {e}") from None
            except jinja2.TemplateSyntaxError as e:
                raise ChatTemplateError(f"chat template {name!r} does not compile: {e} (line {e.lineno})") from e
            except (RecursionError, SyntaxError, MemoryError, OverflowError) as e:  # nesting past the compiler's
                raise UnsafeTemplateError(f"chat template {name!r} does not compile: nested too deeply "
                                          f"({type(e).__name__})") from None
        self.sources: dict[str, str] = templates
        self.special_tokens: dict[str, str] = {k: v for k, v in (special_tokens or {}).items() if v is not None}

    @classmethod
    def from_dir(cls, model_dir: str, special_tokens: Mapping[str, str | None] | None = None) -> "ChatTemplate":
        """Load the template of a Hugging Face model directory; special tokens default to tokenizer_config's."""
        cfg = {}
        cfg_path = os.path.join(model_dir, "tokenizer_config.json")
        if os.path.isfile(cfg_path):
            with open(cfg_path, encoding="utf-8") as f:
                cfg = json.load(f)
        if special_tokens is None:
            special_tokens = {k: _token_content(cfg.get(k)) for k in NAMED_SPECIAL_TOKENS}
        templates = _templates_in_dir(model_dir, cfg)
        if templates is None:
            raise ChatTemplateError(f"{model_dir}: no chat template (chat_template.jinja or tokenizer_config.json)")
        return cls(templates, special_tokens)

    def source_for(self, tools: Any = None) -> str:
        return self.sources[self._pick(tools)]

    def _pick(self, tools: Any) -> str:
        if len(self._compiled) == 1:
            return next(iter(self._compiled))
        if tools is not None and "tool_use" in self._compiled:
            return "tool_use"
        if "default" in self._compiled:
            return "default"
        raise ChatTemplateError(f"several chat templates and none named 'default': {sorted(self._compiled)}")

    def vet(self) -> None:
        """At load: render a plain conversation (and the tool probe) once; UnsafeTemplateError when that breaks
        the sandbox or the budget. Ordinary template errors (a raise_exception on these messages) do not count."""
        user = [{"role": "user", "content": "Hi"}]
        chat = [{"role": "system", "content": "Be brief."}, *user, {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "Bye"}]
        for messages, tools in ((user, None), (chat, None), (user, [_probe_tool()])):
            try:
                self.render(messages, tools=tools, add_generation_prompt=True)
            except UnsafeTemplateError:
                raise
            except ChatTemplateError:
                pass
        for probed in ("renders_tools", "call_style"):
            self.__dict__.pop(probed, None)
            getattr(self, probed)   # probed now, not by the first request

    @functools.cached_property
    def renders_tools(self) -> bool:
        """The template puts a request's tools into the prompt (probed once with a made-up tool)."""
        try:
            text = self.render([{"role": "user", "content": "Hi"}], tools=[_probe_tool()], add_generation_prompt=True)
        except ChatTemplateError:
            return False
        return _PROBE_TOOL in text

    @functools.cached_property
    def call_style(self) -> tuple[str, bool]:
        """(how the template writes an assistant's tool calls: "xml" | "json", whether it needs their arguments as
        objects), probed once with a made-up call."""
        texts = []
        for args in ({_PROBE_ARG: _PROBE_VALUE}, json.dumps({_PROBE_ARG: _PROBE_VALUE})):
            call = {"id": "call_0", "type": "function", "function": {"name": _PROBE_TOOL, "arguments": args}}
            messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                        {"role": "tool", "tool_call_id": "call_0", "content": "ok"}]
            try:
                texts.append(self._render(prepare_messages(messages), [_probe_tool()], True, {}))
            except ChatTemplateError:
                texts.append("")
        xml = any(f"<function={_PROBE_TOOL}>" in t and f"<parameter={_PROBE_ARG}>" in t for t in texts)
        return ("xml" if xml else "json"), _PROBE_VALUE in texts[0] and _PROBE_VALUE not in texts[1]

    @property
    def tool_format(self) -> str:
        return self.call_style[0]

    def render(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None,
               add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """The prompt text for messages. kwargs (enable_thinking=..., documents=...) become template variables."""
        chat = prepare_messages(messages)
        if any(_string_arguments(m) for m in chat) and self.call_style[1]:
            chat = [_object_arguments(m, i) for i, m in enumerate(chat)]
        return self._render(chat, tools, add_generation_prompt, kwargs)

    def _render(self, chat: list[dict], tools: Sequence[Mapping[str, Any]] | None, add_generation_prompt: bool,
                kwargs: Mapping[str, Any]) -> str:
        if tools is not None and (not isinstance(tools, (list, tuple))
                                  or not all(isinstance(t, Mapping) for t in tools)):
            raise ChatTemplateError("tools must be a list of JSON schema objects")
        variables = {**self.special_tokens, **plain_data(kwargs)}
        variables.setdefault("documents", None)
        try:
            return run_budgeted(self._compiled[self._pick(tools)].generate(
                messages=chat, tools=plain_data(tools), add_generation_prompt=add_generation_prompt, **variables))
        except ChatTemplateError:
            raise
        except jinja2.exceptions.SecurityError as e:  # the sandbox or the budget (template_sandbox.py)
            raise UnsafeTemplateError(f"chat template refused: {e.message or e}") from None
        except RecursionError:
            raise UnsafeTemplateError("chat template refused: it recursed too deeply") from None
        except OverflowError as e:  # jinja's range() over the sandbox's MAX_RANGE, float overflow
            raise UnsafeTemplateError(f"chat template refused: {e}") from None
        except jinja2.TemplateError as e:  # raise_exception(), undefined calls
            raise ChatTemplateError(f"chat template error: {e.message or e}") from e
        except (TypeError, ValueError, KeyError, AttributeError, IndexError, ZeroDivisionError,
                MemoryError) as e:  # malformed messages reaching template operators
            raise ChatTemplateError(f"chat template failed on these messages: {type(e).__name__}: {e}") from e


def _string_arguments(message: Mapping[str, Any]) -> bool:
    calls = message.get("tool_calls")
    return isinstance(calls, list) and any(isinstance(c, Mapping) and isinstance(c.get("function"), Mapping)
                                           and isinstance(c["function"].get("arguments"), str) for c in calls)


def _object_arguments(message: dict, i: int) -> dict:
    """The message with its tool calls' JSON-string arguments decoded to objects."""
    if not _string_arguments(message):
        return message
    calls = []
    for k, call in enumerate(message["tool_calls"]):
        fn = call.get("function") if isinstance(call, Mapping) else None
        if isinstance(fn, Mapping) and isinstance(fn.get("arguments"), str):
            try:
                args = json.loads(fn["arguments"]) if fn["arguments"].strip() else {}
            except ValueError:
                args = None
            if not isinstance(args, dict):
                raise ChatTemplateError(f"messages[{i}].tool_calls[{k}].function.arguments must be a JSON object "
                                        f"for this model's chat template")
            call = {**call, "function": {**fn, "arguments": args}}
        calls.append(call)
    return {**message, "tool_calls": calls}


def _probe_tool() -> dict:
    return {"type": "function", "function": {"name": _PROBE_TOOL, "description": "Probe.",
                                             "parameters": {"type": "object", "properties": {}}}}


def _templates_in_dir(model_dir: str, cfg: Mapping[str, Any]) -> dict[str, str] | None:
    templates: dict[str, str] = {}
    main = os.path.join(model_dir, "chat_template.jinja")
    if os.path.isfile(main):
        templates["default"] = _read(main)
    extra_dir = os.path.join(model_dir, "additional_chat_templates")
    if os.path.isdir(extra_dir):
        for name in sorted(os.listdir(extra_dir)):
            if name.endswith(".jinja"):
                templates[name[: -len(".jinja")]] = _read(os.path.join(extra_dir, name))
    if templates:
        return templates
    found = cfg.get("chat_template")
    legacy = os.path.join(model_dir, "chat_template.json")
    if found is None and os.path.isfile(legacy):
        with open(legacy, encoding="utf-8") as f:
            found = json.load(f).get("chat_template")
    if found is None:
        return None
    if isinstance(found, str):
        return {"default": found}
    if isinstance(found, list) and all(isinstance(t, Mapping) and "name" in t and "template" in t for t in found):
        return {t["name"]: t["template"] for t in found}
    raise ChatTemplateError(f"{model_dir}: unrecognised chat_template entry of type {type(found).__name__}")


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()
