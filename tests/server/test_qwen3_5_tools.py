"""Tools on Qwen3.5 through the CLI server with the official openai client, on a tiny random Qwen3.5 carrying the
published Qwen3.5 chat template (tests/fixtures/qwen3_5, llama.cpp's vendored copy), which writes calls in the
Qwen3-Coder XML form (`<tool_call>\\n<function=N>\\n<parameter=P>\\nV\\n</parameter>\\n</function>\\n</tool_call>`):

- a forced call (tool_choice naming the function) decodes in that form under the grammar and comes back as
  `tool_calls` with JSON arguments that fit the parameters, streamed and not (the fragments join to the same
  arguments), and as the same function_call item through the Responses API; cut by max_tokens at every length, its arguments are a prefix of the whole call's, never content;
- a conversation carrying the call (arguments as the JSON string OpenAI clients send) and its tool result renders
  exactly as transformers' apply_chat_template renders it (arguments as an object, as the template needs), and is
  answered: the template used to fail on string arguments, a 400 for every agent's second turn.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import urllib.request

import openai
import pytest

from tests.support.live_server import drain_stderr, start_cli_server

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "qwen3_5",
                       "chat_template.jinja")
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "enum": [1, 2]},
                                     "note": {"type": "string"}},
    "required": ["city", "days"]}}}
FORCED = {"type": "function", "function": {**TOOL["function"], "parameters": {   # no free text: a random model
    **TOOL["function"]["parameters"], "properties": {                              # would write it until max_tokens
        k: v for k, v in TOOL["function"]["parameters"]["properties"].items() if k != "note"}}}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def model_dir(tiny_qwen3_5, tmp_path_factory):
    """tiny_qwen3_5 (files symlinked) with Qwen3.5's published chat template."""
    out = str(tmp_path_factory.mktemp("tiny-qwen3_5-template"))
    for name in os.listdir(tiny_qwen3_5):
        if name != "chat_template.jinja":
            os.symlink(os.path.join(tiny_qwen3_5, name), os.path.join(out, name))
    shutil.copyfile(FIXTURE, os.path.join(out, "chat_template.jinja"))
    return out


@pytest.fixture(scope="module")
def url(model_dir):
    proc, port = start_cli_server(model_dir, "--ctx", "1024")
    drain_stderr(proc)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()
        with contextlib.suppress(OSError, ValueError):
            proc.stderr.close()


@pytest.fixture()
def client(url):
    with openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120) as c:
        yield c


def test_forced_call_is_parsed_streamed_and_not_and_cut_anywhere(client):
    kw = dict(model="m", messages=ASK, tools=[FORCED], tool_choice=NAMED, temperature=0, extra_body=NO_THINK)
    whole = client.chat.completions.create(max_tokens=200, **kw)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    [call] = choice.message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and args["city"] in ("Paris", "Rome") and args["days"] in (1, 2)
    assert set(args) == {"city", "days"}
    print(f"\nforced call: {whole.usage.completion_tokens} tokens, arguments {call.function.arguments}")

    chunks = list(client.chat.completions.create(max_tokens=200, stream=True, **kw))
    deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert deltas[0].id and deltas[0].function.name == "get_weather" and {d.index for d in deltas} == {0}
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    fn = FORCED["function"]                     # the Responses API: the same call as a function_call item
    resp = client.responses.create(model="m", input=ASK, temperature=0, max_output_tokens=200,
                                   tools=[{"type": "function", "name": fn["name"], "parameters": fn["parameters"]}],
                                   tool_choice={"type": "function", "name": fn["name"]}, extra_body=NO_THINK)
    [item] = [o for o in resp.output if o.type == "function_call"]
    assert item.name == "get_weather" and item.arguments == call.function.arguments

    for n in range(1, whole.usage.completion_tokens):
        r = client.chat.completions.create(max_tokens=n, **kw)
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "length" and not msg.content, (n, msg)
        got = [c.function.arguments for c in msg.tool_calls or []]
        assert got == [] or (len(got) == 1 and call.function.arguments.startswith(got[0])), (n, got)


def test_a_tool_result_round_trips_through_the_template(client, url, model_dir):
    from transformers import AutoTokenizer

    arguments = {"city": "Paris", "days": 2, "note": "bring\n\"an umbrella\""}
    turn = [{"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                  "arguments": json.dumps(arguments)}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 C."}]
    messages = ASK + turn
    want = AutoTokenizer.from_pretrained(model_dir).apply_chat_template(
        ASK + [{**turn[0], "tool_calls": [{**turn[0]["tool_calls"][0], "function": {
            "name": "get_weather", "arguments": arguments}}]}, turn[1]],
        tools=[TOOL], tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert "<parameter=note>\nbring\n\"an umbrella\"\n</parameter>" in want and "<tool_response>\nSunny" in want
    body = json.dumps({"messages": messages, "tools": [TOOL], **NO_THINK}).encode()
    with urllib.request.urlopen(urllib.request.Request(url + "/apply-template", body), timeout=60) as r:
        assert json.loads(r.read())["prompt"] == want

    resp = client.chat.completions.create(model="m", messages=messages, tools=[TOOL], max_tokens=4, temperature=0,
                                          extra_body={**NO_THINK, "ignore_eos": True})
    ids = AutoTokenizer.from_pretrained(model_dir)(want, add_special_tokens=False)["input_ids"]
    assert resp.usage.prompt_tokens == len(ids) and resp.usage.completion_tokens == 4

    bad = [*ASK, {**turn[0], "tool_calls": [{**turn[0]["tool_calls"][0], "function": {
        "name": "get_weather", "arguments": "[1, 2]"}}]}, turn[1]]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=bad, tools=[TOOL], max_tokens=4, extra_body=NO_THINK)
    assert "must be a JSON object" in e.value.body["message"]
