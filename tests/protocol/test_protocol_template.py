"""Parsed messages render through the models' own chat templates (transformers' renderer) as intended:
OpenAI-shaped requests give the same prompt as the Qwen-native message shapes the templates were written for."""
from __future__ import annotations

import json
import os

import pytest

from appliance.protocol.requests import parse_chat_request
from tests.support.tiny_models import FIXTURES


@pytest.fixture(scope="module")
def render(qwen_tokenizer_dir):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(qwen_tokenizer_dir)

    def render(template_name: str, messages, **kw) -> str:
        with open(os.path.join(FIXTURES, template_name, "chat_template.jinja"), encoding="utf-8") as f:
            template = f.read()
        return tok.apply_chat_template(messages, chat_template=template, tokenize=False, **kw)
    return render


def parsed(body: dict, **kw):
    return parse_chat_request(json.dumps(body).encode(), context_length=4096, **kw)


def test_openai_tool_conversation_renders_like_qwen_native_messages(render):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now.",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    openai_messages = [
        {"role": "developer", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Paris?"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "18C, sunny"}]},
        {"role": "assistant", "content": "18C and sunny."},
        {"role": "user", "content": "Thanks"},
    ]
    native = [  # the shapes Qwen's own examples pass to this template
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "18C, sunny"},
        {"role": "assistant", "content": "18C and sunny."},
        {"role": "user", "content": "Thanks"},
    ]
    req = parsed({"messages": openai_messages, "tools": tools, "chat_template_kwargs": {"enable_thinking": False}})
    ours = render("qwen3", req.messages, tools=req.tools, add_generation_prompt=True, **req.template_kwargs)
    ref = render("qwen3", native, tools=tools, add_generation_prompt=True, enable_thinking=False)
    assert ours == ref
    assert "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>" in ours
    assert ours.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_text_parts_render_like_the_vl_template_joins_them(render):
    parts = [{"type": "text", "text": "Describe "}, {"type": "text", "text": "this."}]
    req = parsed({"messages": [{"role": "user", "content": parts}]})
    assert req.messages[0]["content"] == "Describe this."
    # the VL template concatenates text parts itself: same prompt from the raw parts and from our string
    assert render("qwen3_vl", req.messages, add_generation_prompt=True) == \
        render("qwen3_vl", [{"role": "user", "content": parts}], add_generation_prompt=True)
    # the text-only Qwen3 template would drop a part list entirely; our string keeps the text
    assert "Describe this." in render("qwen3", req.messages, add_generation_prompt=True)
    assert "Describe this." not in render("qwen3", [{"role": "user", "content": parts}], add_generation_prompt=True)


def test_image_parts_render_the_vision_placeholder(render):
    msg = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}},
                                        {"type": "text", "text": "What is it?"}]}]
    req = parsed({"messages": msg}, images_supported=True)
    out = render("qwen3_vl", req.messages, add_generation_prompt=True)
    assert "<|vision_start|><|image_pad|><|vision_end|>What is it?" in out


def test_past_reasoning_goes_back_inside_think(render):
    req = parsed({"messages": [{"role": "user", "content": "q"},
                               {"role": "assistant", "content": "a", "reasoning_content": "because"}]})
    out = render("qwen3", req.messages)
    assert out.endswith("<|im_start|>assistant\n<think>\nbecause\n</think>\n\na<|im_end|>\n")
