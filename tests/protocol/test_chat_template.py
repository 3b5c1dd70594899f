"""ChatTemplate renders exactly what transformers' apply_chat_template(..., tokenize=False) renders."""
from __future__ import annotations

import copy
import json
import os

import pytest

from appliance.engine.chat_template import ChatTemplate, ChatTemplateError
from appliance.engine.tokenizer import Tokenizer
from tests.support.tiny_models import FIXTURES

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city. Returns °C.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "城市名 <html> & \"q\""},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city"]}}}
TIME_TOOL = {"type": "function", "function": {"name": "now", "description": "UTC time",
                                              "parameters": {"type": "object", "properties": {}}}}

SYSTEM = {"role": "system", "content": "You are Kestrel, a helpful assistant. Answer briefly."}
CALL_ARGS_DICT = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "北京", "unit": "c"}}}]}
CALL_ARGS_STR = {"role": "assistant", "content": "Let me check both.", "tool_calls": [
    {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
    {"id": "call_3", "type": "function", "function": {"name": "now", "arguments": "{}"}}]}
CALL_BARE = {"role": "assistant", "content": "", "tool_calls": [{"name": "now", "arguments": {}}]}

QWEN3_CONVERSATIONS = {
    "user_only": [{"role": "user", "content": "Hello!"}],
    "system_user": [SYSTEM, {"role": "user", "content": "你好，介绍一下你自己。"}],
    "think_history": [
        SYSTEM,
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "<think>\nSimple arithmetic.\n</think>\n\n2+2 = 4."},
        {"role": "user", "content": "And times 3?"},
        {"role": "assistant", "content": "<think>\n4*3\n</think>\n\n12 😀"},
        {"role": "user", "content": "Thanks"},
    ],
    "reasoning_content_history": [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1", "reasoning_content": "thinking about Q1"},
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "content": "\n\nA2", "reasoning_content": "\nthinking about Q2\n"},
    ],
    "thinking_alias": [  # transformers fills reasoning_content from `thinking` (and `reasoning`)
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "A", "thinking": "aliased reasoning", "tool_calls": [
            {"type": "function", "function": {"name": "now", "arguments": {}}}]},
        {"role": "tool", "content": "10:00"},
        {"role": "assistant", "content": "B", "reasoning": "second alias", "reasoning_content": None},
    ],
    "last_assistant_no_think": [
        {"role": "user", "content": "Say hi"},
        {"role": "assistant", "content": "hi"},
    ],
    "tools_full_cycle": [
        SYSTEM,
        {"role": "user", "content": "Weather in Beijing and Paris, and the time?"},
        CALL_ARGS_DICT,
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21, \"sky\": \"晴\"}"},
        CALL_ARGS_STR,
        {"role": "tool", "tool_call_id": "call_2", "content": "{\"temp\": 14}"},
        {"role": "tool", "tool_call_id": "call_3", "content": "2026-11-29T10:00:00Z"},
        {"role": "assistant", "content": "<think>\nall data in\n</think>\n\nBeijing 21°C, Paris 14°C."},
        {"role": "user", "content": "Thanks! Anything else?"},
    ],
    "tool_result_last": [
        {"role": "user", "content": "time?"},
        CALL_BARE,
        {"role": "tool", "content": "10:00"},
    ],
    "tool_response_shaped_user": [
        {"role": "user", "content": "real question"},
        {"role": "assistant", "content": "calling", "reasoning_content": "need a tool", "tool_calls": [
            {"type": "function", "function": {"name": "now", "arguments": {}}}]},
        {"role": "user", "content": "<tool_response>\nfake\n</tool_response>"},
    ],
    "system_mid_conversation": [
        {"role": "user", "content": "a"}, {"role": "system", "content": "late system"},
        {"role": "user", "content": "b"},
    ],
    "non_string_content": [{"role": "user", "content": [{"type": "text", "text": "parts are dropped by Qwen3"}]}],
}

QWEN3_TOOLSETS = {"none": None, "weather": [WEATHER_TOOL], "two": [WEATHER_TOOL, TIME_TOOL]}


@pytest.fixture(scope="module")
def hf_tokenizer(qwen_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen_tokenizer_dir)


def template_text(name: str) -> str:
    with open(os.path.join(FIXTURES, name, "chat_template.jinja"), encoding="utf-8") as f:
        return f.read()


def hf_render(hf, template, messages, tools, add_generation_prompt, **kwargs):
    return hf.apply_chat_template(copy.deepcopy(messages), tools=copy.deepcopy(tools), chat_template=template,
                                  tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs)


@pytest.fixture(scope="module")
def qwen3(qwen_tokenizer_dir) -> ChatTemplate:
    return ChatTemplate(template_text("qwen3"), Tokenizer.from_dir(qwen_tokenizer_dir).special_tokens)


@pytest.mark.parametrize("conv", sorted(QWEN3_CONVERSATIONS))
@pytest.mark.parametrize("tools", sorted(QWEN3_TOOLSETS))
def test_qwen3_matches_transformers(hf_tokenizer, qwen3, conv, tools):
    messages, toolset = QWEN3_CONVERSATIONS[conv], QWEN3_TOOLSETS[tools]
    template = template_text("qwen3")
    for agp in (True, False):
        for thinking in ({}, {"enable_thinking": True}, {"enable_thinking": False}):
            want = hf_render(hf_tokenizer, template, messages, toolset, agp, **thinking)
            got = qwen3.render(copy.deepcopy(messages), tools=copy.deepcopy(toolset), add_generation_prompt=agp,
                               **thinking)
            assert got == want, (conv, tools, agp, thinking)


def test_qwen3_rendering_details(qwen3):
    # independent of transformers: the parts this project relies on
    off = qwen3.render([{"role": "user", "content": "hi"}], enable_thinking=False)
    assert off == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    on = qwen3.render([{"role": "user", "content": "hi"}], enable_thinking=True)
    assert on == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    with_tools = qwen3.render([{"role": "user", "content": "x"}], tools=[WEATHER_TOOL])
    assert json.dumps(WEATHER_TOOL, ensure_ascii=False) in with_tools  # tojson: no ASCII or HTML escaping
    call = qwen3.render([{"role": "user", "content": "x"}, CALL_ARGS_DICT], add_generation_prompt=False)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "北京", "unit": "c"}}\n</tool_call>' in call
    assert "None" not in call  # content=None is dropped, not rendered


def test_messages_are_not_modified(qwen3):
    messages = copy.deepcopy(QWEN3_CONVERSATIONS["thinking_alias"])
    before = copy.deepcopy(messages)
    qwen3.render(messages)
    assert messages == before


VL_IMAGE = {"type": "image", "image": "file:///tmp/cat.png"}
VL_URL = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
VL_VIDEO = {"type": "video", "video": "file:///tmp/clip.mp4"}
VL_CONVERSATIONS = {
    "image_then_text": [{"role": "user", "content": [VL_IMAGE, {"type": "text", "text": "What is in this picture?"}]}],
    "two_images_url": [
        {"role": "system", "content": [{"type": "text", "text": "Describe precisely."}]},
        {"role": "user", "content": [{"type": "text", "text": "Compare "}, VL_URL, {"type": "text", "text": " and "},
                                     VL_IMAGE]},
        {"role": "assistant", "content": [{"type": "text", "text": "The first is a cat."}]},
        {"role": "user", "content": [VL_VIDEO, {"type": "text", "text": "and this clip?"}]},
    ],
    "string_content": [{"role": "system", "content": "sys"}, {"role": "user", "content": "plain text"}],
    "tool_with_image": [
        {"role": "user", "content": "Take a screenshot"},
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "shot", "arguments": {"w": 640}}}]},
        {"role": "tool", "content": [VL_IMAGE, {"type": "text", "text": "screenshot taken"}]},
    ],
}


@pytest.mark.parametrize("conv", sorted(VL_CONVERSATIONS))
def test_qwen3_vl_matches_transformers(hf_tokenizer, qwen_tokenizer_dir, conv):
    template = template_text("qwen3_vl")
    ours = ChatTemplate(template, Tokenizer.from_dir(qwen_tokenizer_dir).special_tokens)
    messages = VL_CONVERSATIONS[conv]
    for tools in (None, [WEATHER_TOOL]):
        for agp in (True, False):
            for extra in ({}, {"add_vision_id": True}):
                want = hf_render(hf_tokenizer, template, messages, tools, agp, **extra)
                got = ours.render(copy.deepcopy(messages), tools=copy.deepcopy(tools), add_generation_prompt=agp,
                                  **extra)
                assert got == want, (conv, tools, agp, extra)
    if conv == "image_then_text":
        assert "<|vision_start|><|image_pad|><|vision_end|>What is in this picture?" in got


ENV_TEMPLATE = """{{ bos_token or 'nobos' }}|{{ eos_token }}|{{ pad_token }}
{% set ns = namespace(n=0) %}
{% for m in messages %}
  {% if loop.index > 2 %}{% break %}{% endif %}
  {% if m.role == 'skip' %}{% continue %}{% endif %}
  {% set ns.n = ns.n + 1 %}
  {{ m | tojson(indent=2) }}
{% endfor %}
{{ ns.n }} {{ dict(a=1, b='é') | tojson(sort_keys=True, separators=(',', ':')) }} {{ strftime_now('%Y') }}
{{ documents | tojson }} {{ custom_flag }}
"""


def test_environment_matches_transformers(hf_tokenizer, qwen3):
    ours = ChatTemplate(ENV_TEMPLATE, qwen3.special_tokens)
    messages = [{"role": "skip", "content": "x"}, {"role": "user", "content": "é <b>"}, {"role": "z", "content": "9"}]
    for kwargs in ({}, {"custom_flag": [1, "二"]}, {"documents": [{"title": "t", "text": "d"}]}):
        want = hf_render(hf_tokenizer, ENV_TEMPLATE, messages, None, True, **kwargs)
        assert ours.render(messages, **kwargs) == want
    # kwargs override the named special tokens, as in transformers
    assert ours.render([], eos_token="E").split("|")[1] == "E"


@pytest.mark.parametrize("source", [
    "{{ raise_exception('Conversation roles must alternate') }}",
    "{{ messages[0].role }}",  # empty messages: undefined attribute of undefined
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",  # sandbox escape attempt
    "{% set ns = namespace(_x=1) %}",
    "{% set x = [] %}{{ x.append(1) }}",  # immutable sandbox: no mutating methods
    "{{ messages[0].content + 1 }}",  # type error on the messages
])
def test_template_errors_become_chat_template_error(source):
    with pytest.raises(ChatTemplateError) as e:
        ChatTemplate(source).render([] if "role" in source else [{"role": "user", "content": "x"}])
    assert isinstance(e.value, ValueError)


def test_bad_templates_and_inputs():
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for x in %}")
    t = ChatTemplate("{{ messages | length }}")
    for bad in ("text", [1], None):
        with pytest.raises(ChatTemplateError):
            t.render(bad)
    with pytest.raises(ChatTemplateError):
        t.render([], tools="not a list")
    assert t.render([{"role": "user", "content": "x"}]) == "1"


def write_dir(path, *, jinja=None, config_template=None, legacy=None, extra=None):
    os.makedirs(path, exist_ok=True)
    cfg = {"eos_token": {"content": "<|im_end|>", "special": True}, "bos_token": None, "pad_token": "<|endoftext|>"}
    if config_template is not None:
        cfg["chat_template"] = config_template
    with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f)
    if jinja is not None:
        with open(os.path.join(path, "chat_template.jinja"), "w", encoding="utf-8") as f:
            f.write(jinja)
    if legacy is not None:
        with open(os.path.join(path, "chat_template.json"), "w", encoding="utf-8") as f:
            json.dump({"chat_template": legacy}, f)
    for name, text in (extra or {}).items():
        os.makedirs(os.path.join(path, "additional_chat_templates"), exist_ok=True)
        with open(os.path.join(path, "additional_chat_templates", f"{name}.jinja"), "w", encoding="utf-8") as f:
            f.write(text)
    return str(path)


def test_from_dir_sources_and_priority(tmp_path):
    d = write_dir(tmp_path / "a", jinja="jinja {{ eos_token }}", config_template="config", legacy="legacy")
    assert ChatTemplate.from_dir(d).render([]) == "jinja <|im_end|>"
    assert ChatTemplate.from_dir(write_dir(tmp_path / "b", config_template="config {{ pad_token }}",
                                           legacy="legacy")).render([]) == "config <|endoftext|>"
    assert ChatTemplate.from_dir(write_dir(tmp_path / "c", legacy="legacy")).render([]) == "legacy"
    named = [{"name": "default", "template": "plain"}, {"name": "tool_use", "template": "tools {{ tools | length }}"}]
    t = ChatTemplate.from_dir(write_dir(tmp_path / "d", config_template=named))
    assert t.render([]) == "plain" and t.render([], tools=[TIME_TOOL]) == "tools 1"
    t = ChatTemplate.from_dir(write_dir(tmp_path / "e", jinja="main", extra={"tool_use": "tu"}))
    assert t.render([]) == "main" and t.render([], tools=[]) == "tu"
    with pytest.raises(ChatTemplateError, match="no chat template"):
        ChatTemplate.from_dir(write_dir(tmp_path / "f"))
    with pytest.raises(ChatTemplateError, match="none named 'default'"):
        ChatTemplate({"a": "x", "b": "y"}).render([])


def test_from_dir_real_model_dir(tiny_qwen3_tied, qwen3):
    t = ChatTemplate.from_dir(tiny_qwen3_tied)
    assert t.source_for() == template_text("qwen3")
    assert t.special_tokens == qwen3.special_tokens
    conv = QWEN3_CONVERSATIONS["tools_full_cycle"]
    assert t.render(conv, tools=[WEATHER_TOOL]) == qwen3.render(conv, tools=[WEATHER_TOOL])
