"""Request parsing: what is accepted and how it is normalised; every rejection's status and param."""
from __future__ import annotations

import json

import pytest

from appliance.engine.sampling import SamplingParams
from appliance.protocol.errors import ApiError
from appliance.protocol.requests import parse_chat_request, parse_completion_request

QWEN_DEFAULTS = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
USER = [{"role": "user", "content": "hi"}]


def chat(body, **kw):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    kw.setdefault("defaults", QWEN_DEFAULTS)
    kw.setdefault("context_length", 4096)
    return parse_chat_request(raw, **kw)


def comp(body, **kw):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    kw.setdefault("context_length", 4096)
    return parse_completion_request(raw, **kw)


def rejects(fn, body, param, status=400, **kw) -> ApiError:
    with pytest.raises(ApiError) as info:
        fn(body, **kw)
    assert (info.value.status, info.value.param) == (status, param), info.value
    assert info.value.type == "invalid_request_error"
    return info.value


# --- accepted --------------------------------------------------------------------------------------------

def test_minimal_chat_uses_model_defaults():
    r = chat({"messages": USER})
    assert r.messages == [{"role": "user", "content": "hi"}]
    assert r.sampling == SamplingParams(temperature=0.6, top_p=0.95, top_k=20)
    assert (r.model, r.max_tokens, r.stop, r.stream, r.tools, r.template_kwargs) == (None, None, (), False, None, {})
    assert not (r.include_usage or r.include_metrics or r.include_tokens or r.ignore_eos)
    assert r.enable_thinking


def test_full_chat_request():
    r = chat({"model": "qwen3", "messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": "u"},
        {"role": "assistant", "content": None, "reasoning_content": "r",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"}],
        "max_completion_tokens": 64, "max_tokens": 9, "temperature": 0, "top_p": 0.5, "top_k": -1, "min_p": 0.1,
        "seed": -3, "stop": ["\n\n", "END", ""], "presence_penalty": 0.5, "frequency_penalty": -0.5,
        "repetition_penalty": 1.1, "logprobs": True, "top_logprobs": 3, "stream": True,
        "stream_options": {"include_usage": True, "include_metrics": True, "include_tokens": False},
        "chat_template_kwargs": {"enable_thinking": False}, "n": 1, "user": "x", "some_future_field": [1],
        "tools": [{"type": "function", "function": {"name": "f", "description": "d",
                                                    "parameters": {"type": "object"}, "strict": True}}],
        "tool_choice": "auto", "response_format": {"type": "text"}, "logit_bias": {}, "ignore_eos": True})
    assert r.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "ab", "name": "u"},
        {"role": "assistant", "content": "", "reasoning_content": "r",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"}]
    assert r.model == "qwen3" and r.max_tokens == 64 and r.stop == ("\n\n", "END")
    assert r.sampling == SamplingParams(temperature=0, top_p=0.5, top_k=0, min_p=0.1, seed=-3,
                                        presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.1,
                                        logprobs=True, top_logprobs=3)
    assert (r.stream, r.include_usage, r.include_metrics, r.include_tokens) == (True, True, True, False)
    assert r.template_kwargs == {"enable_thinking": False} and not r.enable_thinking
    assert r.tools == [{"type": "function", "function": {"name": "f", "description": "d",
                                                         "parameters": {"type": "object"}}}]
    assert r.tool_choice == "auto" and r.ignore_eos


def test_stop_string_and_nulls_mean_unset():
    r = chat({"messages": USER, "stop": "x", "temperature": None, "max_tokens": None, "stream": None,
              "tools": None, "seed": None})
    assert r.stop == ("x",) and r.sampling.temperature == 0.6 and r.max_tokens is None and not r.stream


def test_stream_extensions_default_from_the_server_flag():
    r = chat({"messages": USER, "stream": True}, stream_extensions=True)
    assert (r.include_metrics, r.include_tokens, r.include_usage) == (True, True, False)
    r = chat({"messages": USER, "stream": True, "stream_options": {"include_tokens": False}},
             stream_extensions=True)
    assert (r.include_metrics, r.include_tokens) == (True, False)
    r = chat({"messages": USER}, stream_extensions=True)
    assert not r.include_metrics     # nothing to stream into


def test_tool_choice_none_drops_the_tools_and_top_level_enable_thinking():
    tools = [{"type": "function", "function": {"name": "f"}}]
    r = chat({"messages": USER, "tools": tools, "tool_choice": "none", "enable_thinking": False})
    assert r.tools is None and r.tool_choice is None and r.template_kwargs == {"enable_thinking": False}


def test_image_parts_kept_when_the_model_takes_images():
    msg = [{"role": "user", "content": [{"type": "text", "text": "what is"},
                                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]}]
    r = chat({"messages": msg}, images_supported=True)
    assert r.messages[0]["content"] == [{"type": "text", "text": "what is"},
                                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]


def test_image_parts_refused_with_the_models_hint():
    msg = [{"role": "user", "content": [{"type": "text", "text": "what is"},
                                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]}]
    with pytest.raises(ApiError) as plain:
        chat({"messages": msg})
    assert plain.value.message == ("Invalid content part 'messages[0].content[1]': this model does not accept "
                                   "images; send text parts only.")
    with pytest.raises(ApiError) as hinted:
        chat({"messages": msg}, images_hint="start the server with --mmproj mmproj.gguf to send images")
    assert hinted.value.message == ("Invalid content part 'messages[0].content[1]': this model does not accept "
                                    "images; start the server with --mmproj mmproj.gguf to send images.")
    assert hinted.value.status == 400 and hinted.value.param == "messages[0].content[1]"
    assert hinted.value.code == "unsupported_content"


def test_completion_prompts():
    assert comp({"prompt": "Once"}).prompt == "Once"
    assert comp({"prompt": ["Once"]}).prompt == "Once"
    assert comp({"prompt": [1, 2, 3]}).prompt == [1, 2, 3]
    assert comp({"prompt": [[4, 5]]}).prompt == [4, 5]
    r = comp({"prompt": "x", "logprobs": 2, "max_tokens": 5, "echo": False, "best_of": 1, "suffix": None})
    assert r.sampling.logprobs and r.sampling.top_logprobs == 2 and r.max_tokens == 5
    assert comp({"prompt": "x"}).max_tokens == 16
    assert comp({"prompt": "x"}, context_length=8).max_tokens == 8
    assert comp({"prompt": "x", "echo": True}).echo
    assert comp({"prompt": "x", "logprobs": 0}).sampling.top_logprobs == 0


# --- rejected ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("raw,fragment", [
    (b"\xff\xfe{}", "UTF-8"),
    (b"", "empty"),
    (b"{\"messages\": [", "parse the JSON"),
    (b"[1, 2]", "JSON object"),
    (b"{\"temperature\": NaN, \"messages\": []}", "parse the JSON"),
    (b"[" * 100000 + b"]" * 100000, "parse the JSON"),
])
def test_bodies_that_are_not_a_json_object(raw, fragment):
    e = rejects(chat, raw, None)
    assert fragment in e.message


@pytest.mark.parametrize("body,param", [
    ({}, "messages"),
    ({"messages": None}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": ["hi"]}, "messages[0]"),
    ({"messages": [{"content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "function", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "assistant", "content": None}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text"),
    ({"messages": [{"role": "user", "content": [{"text": "a"}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "assistant", "content": "x", "tool_calls": [{"function": {}}]}]},
     "messages[0].tool_calls[0].function.name"),
    ({"messages": USER, "model": 3}, "model"),
    ({"messages": USER, "n": 2}, "n"),
    ({"messages": USER, "n": 0}, "n"),
    ({"messages": USER, "max_tokens": 0}, "max_tokens"),
    ({"messages": USER, "max_tokens": -5}, "max_tokens"),
    ({"messages": USER, "max_tokens": 10.5}, "max_tokens"),
    ({"messages": USER, "max_tokens": "10"}, "max_tokens"),
    ({"messages": USER, "max_tokens": True}, "max_tokens"),
    ({"messages": USER, "max_tokens": 5000}, "max_tokens"),
    ({"messages": USER, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": USER, "temperature": "hot"}, "temperature"),
    ({"messages": USER, "temperature": 2.5}, "temperature"),
    ({"messages": USER, "temperature": -0.1}, "temperature"),
    (b'{"messages": [{"role": "user", "content": "x"}], "temperature": 1e400}', "temperature"),
    ({"messages": USER, "top_p": 0}, "top_p"),
    ({"messages": USER, "top_p": 1.5}, "top_p"),
    ({"messages": USER, "top_k": 1.5}, "top_k"),
    ({"messages": USER, "top_k": -2}, "top_k"),
    ({"messages": USER, "min_p": 2}, "min_p"),
    ({"messages": USER, "seed": 1.5}, "seed"),
    ({"messages": USER, "presence_penalty": 3}, "presence_penalty"),
    ({"messages": USER, "frequency_penalty": -2.5}, "frequency_penalty"),
    ({"messages": USER, "repetition_penalty": 0}, "repetition_penalty"),
    ({"messages": USER, "logprobs": 1}, "logprobs"),
    ({"messages": USER, "top_logprobs": 3}, "top_logprobs"),
    ({"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": USER, "stop": 5}, "stop"),
    ({"messages": USER, "stop": ["a", 1]}, "stop[1]"),
    ({"messages": USER, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"messages": USER, "stream": "yes"}, "stream"),
    ({"messages": USER, "stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": USER, "stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ({"messages": USER, "stream": True, "stream_options": []}, "stream_options"),
    ({"messages": USER, "chat_template_kwargs": "x"}, "chat_template_kwargs"),
    ({"messages": USER, "chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
    ({"messages": USER, "chat_template_kwargs": {"enable_thinking": "no"}}, "chat_template_kwargs.enable_thinking"),
    ({"messages": USER, "tools": {"type": "function"}}, "tools"),
    ({"messages": USER, "tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"messages": USER, "tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name"),
    ({"messages": USER, "tool_choice": "required"}, "tool_choice"),
    ({"messages": USER, "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ({"messages": USER, "tool_choice": "sometimes"}, "tool_choice"),
    ({"messages": USER, "response_format": {"type": "xml"}}, "response_format.type"),
    ({"messages": USER, "response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"messages": USER, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": []}}},
     "response_format.json_schema.schema"),
    ({"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice.function.name"),
    ({"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function"}}, "tool_choice.function"),
    ({"messages": USER, "logit_bias": {"50256": -100}}, "logit_bias"),
    ({"messages": USER, "ignore_eos": "true"}, "ignore_eos"),
])
def test_chat_rejections(body, param):
    rejects(chat, body, param)


def test_rejection_messages_read_like_openai():
    e = rejects(chat, {"messages": USER, "max_tokens": "10"}, "max_tokens")
    assert e.message == "Invalid type for 'max_tokens': expected an integer, but got a string instead."
    e = rejects(chat, {"messages": USER, "max_tokens": 10.5}, "max_tokens")
    assert e.message == "Invalid type for 'max_tokens': expected an integer, but got a decimal number instead."
    e = rejects(chat, {"messages": USER, "temperature": 2.5}, "temperature")
    assert "2.5" in e.message and "temperature" in e.message
    e = rejects(chat, {"messages": [{"role": "user", "content": [{"type": "image_url",
                                                                  "image_url": {"url": "u"}}]}]},
                "messages[0].content[0]")
    assert "images" in e.message


@pytest.mark.parametrize("body,param", [
    ({}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": [[1], [2]]}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt[1]"),
    ({"prompt": [1, -1]}, "prompt[1]"),
    ({"prompt": 7}, "prompt"),
    ({"prompt": "x", "n": 3}, "n"),
    ({"prompt": "x", "best_of": 2}, "best_of"),
    ({"prompt": "x", "suffix": "tail"}, "suffix"),
    ({"prompt": "x", "echo": True, "logprobs": 1}, "echo"),
    ({"prompt": "x", "logprobs": True}, "logprobs"),
    ({"prompt": "x", "logprobs": -1}, "logprobs"),
    ({"prompt": "x", "logprobs": 50}, "logprobs"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 9999}, "max_tokens"),
    ({"prompt": "x", "temperature": 9}, "temperature"),
])
def test_completion_rejections(body, param):
    rejects(comp, body, param)


def test_lone_surrogate_escapes_are_a_400_and_error_bodies_never_raise():
    from appliance.protocol.errors import error_body
    for raw in (b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}',
                b'{"messages": [{"role": "\\udfff", "content": "x"}]}'):
        e = rejects(chat, raw, None)
        assert "surrogate" in e.message
        error_body(e)
    # a proper pair is one character and fine
    r = chat(b'{"messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}')
    assert r.messages[0]["content"] == "\U0001F600"
    assert error_body(ApiError(400, "bad \ud800")).endswith(b'"bad ?","type":"invalid_request_error",'
                                                            b'"param":null,"code":null}}')
