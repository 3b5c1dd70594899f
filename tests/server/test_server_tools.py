"""Tools end to end on the paths that exposed issue 22, through the real CLI (`python -m appliance`, a subprocess)
and the client libraries that hit them (openai, ollama, langchain-ollama):

- SmolLM2-135M-Instruct Q4_1 (a real model whose chat template has no tool section): the tools reach the prompt
  (the prompt's own tokens, decoded), and the generic format's calls come back parsed on OpenAI chat (stream and
  non-stream), Responses and Ollama /api/chat, forced or chosen by the model itself;
- the scripted Qwen3 (Qwen3's template, tools in the template's own format) and a tiny random Qwen3 under a forced
  call: a call cut by max_tokens ends "length" with no markup in content and exactly the arguments the model
  produced;
- /api/show answers for the name chat accepts ("any").
"""
from __future__ import annotations

import contextlib
import json

import ollama
import openai
import pytest

from appliance.engine.gguf_tokenizer import build_tokenizer
from appliance.engine.load.gguf import open_gguf
from tests.support.gguf_files import fetch_smollm2
from tests.support.live_server import RawClient, request_bytes, start_cli_server

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL_ME = [{"role": "user", "content": "Call get_weather for Paris."}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@contextlib.contextmanager
def cli(model: str, *args: str):
    proc, port = start_cli_server(model, *args)
    try:
        yield f"http://127.0.0.1:{port}", port
    finally:
        proc.kill()
        proc.wait()
        proc.stderr.close()


@pytest.fixture(scope="module")
def smollm2_path() -> str:
    return fetch_smollm2()


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    with cli(smollm2_path, "--ctx", "2048") as server:
        yield server


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_path):
    r = open_gguf(smollm2_path)
    return build_tokenizer({k: f.contents() for k, f in r.fields.items() if k.startswith("tokenizer.")})


def prompt_text(port: int, tokenizer, body: dict) -> tuple[str, int]:
    """The prompt the server rendered for a chat request (its own token ids, from the tokens extension event,
    decoded) and its prompt_tokens."""
    c = RawClient(port)
    c.send(request_bytes("POST", "/v1/chat/completions", {
        **body, "model": "any", "stream": True, "max_tokens": 1,
        "stream_options": {"include_usage": True, "include_tokens": True}}))
    r = c.read_events(c.read_head())
    c.close()
    evs = r.json_events()
    n_prompt = next(e["usage"]["prompt_tokens"] for e in evs if e.get("usage"))
    ids = next(e["tokens"] for e in evs if e.get("object") == "chat.completion.tokens")
    return tokenizer.decode(ids[:n_prompt], skip_special_tokens=False), n_prompt


def test_smollm2_tools_and_tool_turns_reach_the_prompt(smollm2, smollm2_tokenizer):
    url, port = smollm2
    bare, n_bare = prompt_text(port, smollm2_tokenizer, {"messages": ASK})
    with_tools, n_tools = prompt_text(port, smollm2_tokenizer, {"messages": ASK, "tools": [WEATHER]})
    assert "get_weather" not in bare
    assert '{"name": "get_weather", "description": "Current weather of a city", "parameters": {"type": "object", ' \
           '"properties": {"city": {"type": "string"}}, "required": ["city"]}}' in with_tools
    assert '{"tool_call": {"name": "<tool name>", "arguments": {...}}}' in with_tools
    assert n_tools > n_bare + 40 and with_tools.endswith("What is the weather in Paris?<|im_end|>\n"
                                                         "<|im_start|>assistant\n")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    usage = client.chat.completions.create(model="any", messages=ASK, tools=[WEATHER], max_tokens=1).usage
    assert usage.prompt_tokens == n_tools                     # what the openai client sees, the same prompt

    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_7", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_7", "content": "18 C and sunny"}]
    turns, n_turns = prompt_text(port, smollm2_tokenizer, {"messages": history, "tools": [WEATHER]})
    assert ('<|im_start|>assistant\n{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}<|im_end|>\n'
            '<|im_start|>user\n{"tool_response": {"tool": "get_weather", "tool_call_id": "call_7", '
            '"content": "18 C and sunny"}}<|im_end|>') in turns
    assert n_turns > n_tools


def test_smollm2_openai_chat_calls_come_back_parsed(smollm2):
    url, _ = smollm2
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    kw = dict(model="any", tools=[WEATHER], temperature=0, max_tokens=60)
    for choice in ("auto", "required", NAMED):          # auto: the model chooses the call itself
        r = client.chat.completions.create(messages=CALL_ME, tool_choice=choice, **kw)
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and msg.content is None, (choice, msg)
        assert [c.function.name for c in msg.tool_calls] == ["get_weather"]
        assert isinstance(json.loads(msg.tool_calls[0].function.arguments)["city"], str)
        chunks = list(client.chat.completions.create(messages=CALL_ME, tool_choice=choice, stream=True, **kw))
        deltas = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
        assert deltas[0].id and deltas[0].function.name == "get_weather"
        assert "".join(d.function.arguments or "" for d in deltas) == msg.tool_calls[0].function.arguments
        assert not any(ch.choices[0].delta.content for ch in chunks if ch.choices)
        assert chunks[-1].choices[0].finish_reason == "tool_calls"

    answer = client.chat.completions.create(messages=ASK, **kw)     # a reply: the JSON's string, decoded
    streamed = list(client.chat.completions.create(messages=ASK, stream=True, **kw))
    text = "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices)
    m = answer.choices[0].message
    if m.tool_calls is None:
        assert m.content == text and text and '"response"' not in text and not text.startswith("{")
    else:
        assert [c.function.name for c in m.tool_calls] == ["get_weather"]


def test_smollm2_responses_api_function_call(smollm2):
    url, _ = smollm2
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    tool = {"type": "function", **WEATHER["function"]}
    bare = client.responses.create(model="any", input="Call get_weather for Paris.", max_output_tokens=16)
    r = client.responses.create(model="any", input="Call get_weather for Paris.", tools=[tool], temperature=0,
                                tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=60)
    assert r.usage.input_tokens > bare.usage.input_tokens + 40
    assert [(o.type, o.name, o.status) for o in r.output] == [("function_call", "get_weather", "completed")]
    assert isinstance(json.loads(r.output[0].arguments)["city"], str)
    with client.responses.stream(model="any", input="Call get_weather for Paris.", tools=[tool], temperature=0,
                                 max_output_tokens=60) as s:
        final = s.get_final_response()
    assert [(o.type, o.name) for o in final.output] == [("function_call", "get_weather")]


def test_smollm2_ollama_chat_and_show(smollm2):
    url, _ = smollm2
    client = ollama.Client(host=url)
    opts = {"temperature": 0, "num_predict": 60}
    bare = client.chat(model="any", messages=CALL_ME, options={**opts, "num_predict": 1})
    r = client.chat(model="any", messages=CALL_ME, tools=[WEATHER], options=opts)
    assert r.prompt_eval_count > bare.prompt_eval_count + 40
    assert r.message.content == "" and r.done_reason == "stop"
    assert [c.function.name for c in r.message.tool_calls] == ["get_weather"]
    assert isinstance(r.message.tool_calls[0].function.arguments["city"], str)
    parts = list(client.chat(model="any", messages=CALL_ME, tools=[WEATHER], options=opts, stream=True))
    calls = [c for p in parts for c in p.message.tool_calls or []]
    assert [(c.function.name, c.function.arguments) for c in calls] == \
        [("get_weather", r.message.tool_calls[0].function.arguments)]
    assert "".join(p.message.content for p in parts) == ""
    # the round trip: the call and its result go back (in the generic format's text)
    msgs = [*CALL_ME, r.message, {"role": "tool", "content": "18 C and sunny", "tool_name": "get_weather"}]
    again = client.chat(model="any", messages=msgs, tools=[WEATHER], options={**opts, "num_predict": 1})
    assert again.prompt_eval_count > r.prompt_eval_count + 20

    show = client.show("any")                                # the name chat accepts
    assert show.capabilities == ["completion", "tools"] and show.details.format == "gguf"
    assert [m.model for m in client.list().models] == ["SmolLM2-135M-Instruct.Q4_1.gguf"]


def test_smollm2_langchain_ollama_agent_gets_tool_calls(smollm2):
    from langchain_core.tools import tool
    from langchain_ollama import ChatOllama

    @tool
    def get_weather(city: str) -> str:
        """Current weather of a city"""
        return "18 C"

    url, _ = smollm2
    llm = ChatOllama(model="any", base_url=url, temperature=0, num_predict=60)
    msg = llm.bind_tools([get_weather]).invoke("Call get_weather for Paris.")
    assert [c["name"] for c in msg.tool_calls] == ["get_weather"] and isinstance(msg.tool_calls[0]["args"]["city"], str)
    assert msg.content == ""
    listed = ChatOllama(model="SmolLM2-135M-Instruct.Q4_1.gguf", base_url=url, validate_model_on_init=True,
                        num_predict=1)
    assert listed.invoke("Hi").response_metadata["done_reason"] == "length"
    with pytest.raises(ValueError, match="SmolLM2-135M-Instruct.Q4_1.gguf"):   # it looks the name up in /api/tags
        ChatOllama(model="any", base_url=url, validate_model_on_init=True)


# ---- Qwen3's template: a call cut by max_tokens --------------------------------------------------------------

@pytest.fixture(scope="module")
def scripted(scripted_qwen3):
    with cli(scripted_qwen3) as server:
        yield server


# the scripted model's tokens: <think> Let me check </think> <tool_call> {" name ":" get _weather "," arguments
# ":{" city ": ' "' Paris "}} </tool_call> <|im_end|>
@pytest.mark.parametrize("max_tokens, arguments, finish, item", [
    (10, None, "length", None),                                # cut inside the name: no call, no markup
    (16, '{"city":', "length", "incomplete"),
    (19, '{"city": "Paris"}', "length", "incomplete"),         # cut before </tool_call>: no `}` of the block
    (20, '{"city": "Paris"}', "length", "completed"),          # cut after it, before <|im_end|>
    (21, '{"city": "Paris"}', "tool_calls", "completed")])
def test_qwen3_call_cut_by_max_tokens(scripted, max_tokens, arguments, finish, item):
    url, _ = scripted
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    kw = dict(model="any", messages=ASK, tools=[WEATHER], temperature=0, max_tokens=max_tokens)
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == finish and msg.reasoning_content == "Let me check"
    assert [c.function.arguments for c in msg.tool_calls or []] == ([arguments] if arguments else [])
    assert msg.content == ("" if arguments is None else None)
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert not any(ch.choices[0].delta.content for ch in chunks if ch.choices)
    streamed = "".join(tc.function.arguments or "" for ch in chunks if ch.choices
                       for tc in ch.choices[0].delta.tool_calls or [])
    assert streamed == (arguments or "") and chunks[-1].choices[0].finish_reason == finish
    if max_tokens >= 16:                                      # the Responses API's minimum
        resp = client.responses.create(model="any", input=ASK, tools=[{"type": "function", **WEATHER["function"]}],
                                       temperature=0, max_output_tokens=max_tokens)
        assert [(o.type, o.arguments, o.status) for o in resp.output if o.type != "reasoning"] == \
            [("function_call", arguments, item)]
        assert resp.status == ("completed" if finish == "tool_calls" else "incomplete")


@pytest.fixture(scope="module")
def tiny(tiny_qwen3_tied):
    with cli(tiny_qwen3_tied) as server:
        yield server


def test_forced_call_cut_anywhere_keeps_only_the_models_arguments(tiny):
    """The issue's case: a grammar-forced call (random weights) cut at every length; each cut's arguments are the
    beginning of the whole call's, equal to them when only </tool_call> is missing, and nothing reaches
    content (the random model's tokens: <tool_call> \n {" name ": ' "' get _weather ", ' "' arguments ": ' {"'
    city ": ' ' "P aris "}}\n </tool_call>)."""
    url, _ = tiny
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
        "additionalProperties": False}}}
    kw = dict(model="any", messages=ASK, tools=[tool], tool_choice=NAMED, temperature=0)
    whole = client.chat.completions.create(max_tokens=100, **kw)
    args = whole.choices[0].message.tool_calls[0].function.arguments
    assert json.loads(args)["city"] in ("Paris", "Rome") and whole.usage.completion_tokens < 40
    for n in range(1, whole.usage.completion_tokens):
        r = client.chat.completions.create(max_tokens=n, **kw)
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "length" and not msg.content, (n, msg)
        got = [c.function.arguments for c in msg.tool_calls or []]
        assert got == [] or (len(got) == 1 and args.startswith(got[0])), (n, got)
        if n == whole.usage.completion_tokens - 1:             # cut before </tool_call>: after `"}}\n`
            assert got == [args], (n, got)
