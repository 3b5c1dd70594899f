"""The Ollama API end to end: the official `ollama` client and LangChain's ChatOllama against the real server
(worker thread + trio + h11 on a loopback socket) on tiny real checkpoints. The scripted checkpoint
(tests/support/scripted_model.py) thinks and calls a tool with thinking on, and answers with thinking off, so
think, tool calls and the tool round trip are checked on what a model really generated."""
from __future__ import annotations

import base64
import json

import ollama
import openai
import pytest

from appliance.server.ollama import OLLAMA_COMPAT_VERSION
from tests.support.live_server import LiveServer, RawClient, request_bytes
from tests.support.scripted_model import ANSWER, THINKING
from tests.support.tiny_vl import cached_qwen3_vl, image_bytes

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def server(scripted_qwen3):
    with LiveServer(scripted_qwen3, queue=1, queue_keepalive_s=0.05) as s:
        yield s


@pytest.fixture()
def client(server):
    return ollama.Client(host=server.url)


def name(server) -> str:
    return server.api_cfg.model_name


def test_root_version_list_show_ps(client, server):
    c = RawClient(server.port)
    c.send(request_bytes("GET", "/"))
    r = c.read_head()
    assert r.status == 200 and r.header("content-type").startswith("text/plain")
    assert c.read_body(r) == b"Ollama is running"
    c.send(request_bytes("HEAD", "/"))
    r = c.read_head()
    assert r.status == 200 and r.header("content-length") == "17"
    c.send(request_bytes("GET", "/api/version"))      # no body followed the HEAD's headers on this connection
    r = c.read_head()
    assert r.status == 200 and json.loads(c.read_body(r))["version"] == OLLAMA_COMPAT_VERSION
    c.close()
    c = RawClient(server.port)
    c.send(request_bytes("GET", "/api/version"))
    r = c.read_head()
    assert json.loads(c.read_body(r))["version"].count(".") == 2
    c.close()

    models = client.list().models
    assert [m.model for m in models] == [name(server)]
    assert models[0].details.family == "qwen3" and models[0].details.format == "safetensors"
    assert models[0].size > 0 and models[0].details.quantization_level == "BF16"
    show = client.show(name(server))
    assert show.capabilities == ["completion", "tools", "thinking"]
    assert show.modelinfo["qwen3.context_length"] == server.worker.loaded.context_length
    assert "<tool_call>" in show.template and "temperature" in show.parameters
    assert client.show(name(server) + ":latest").details.family == "qwen3"
    assert client.show("llama3").modelinfo == show.modelinfo          # any name, as chat accepts any name
    ps = client.ps().models
    assert ps[0].model == name(server) and ps[0].context_length == server.worker.loaded.context_length


def test_chat_stream_and_non_stream_agree(client, server):
    msgs = [{"role": "user", "content": "What's the weather?"}]
    parts = list(client.chat(model=name(server), messages=msgs, stream=True, think=False, options=GREEDY))
    assert parts[0].message.content == "" and not parts[0].done       # sent before prefill
    assert [p.done for p in parts].count(True) == 1 and parts[-1].done_reason == "stop"
    text = "".join(p.message.content for p in parts)
    assert text == ANSWER
    assert sum(1 for p in parts if p.message.content) == 5             # one line per token with text
    last = parts[-1]
    assert last.eval_count == 6 and last.prompt_eval_count > 0
    assert last.total_duration >= last.prompt_eval_duration + last.eval_duration > 0

    r = client.chat(model=name(server), messages=msgs, stream=False, think=False, options=GREEDY)
    assert r.message.content == ANSWER and r.message.thinking is None and r.done and r.eval_count == 6
    n = client.chat(model=name(server), messages=msgs, think=False, options={**GREEDY, "num_predict": 2})
    assert n.done_reason == "length" and n.message.content == " Sunny in"


def test_think_and_tool_call_round_trip(client, server):
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    r = client.chat(model=name(server), messages=msgs, tools=[WEATHER_TOOL], think=True, options=GREEDY)
    assert r.message.thinking == THINKING and r.message.content == ""
    assert [(c.function.name, dict(c.function.arguments)) for c in r.message.tool_calls] == \
        [("get_weather", {"city": "Paris"})]
    assert r.done_reason == "stop"

    streamed = list(client.chat(model=name(server), messages=msgs, tools=[WEATHER_TOOL], think=True,
                                stream=True, options=GREEDY))
    assert "".join(p.message.thinking or "" for p in streamed) == THINKING
    calls = [c for p in streamed for c in (p.message.tool_calls or [])]
    assert [c.function.name for c in calls] == ["get_weather"] and calls[0].function.arguments == {"city": "Paris"}

    # the round trip: the call and the tool's answer go back; thinking off, the model answers in text
    msgs += [r.message, {"role": "tool", "content": "18 C and sunny", "tool_name": "get_weather"}]
    final = client.chat(model=name(server), messages=msgs, tools=[WEATHER_TOOL], think=False, options=GREEDY)
    assert final.message.content == ANSWER and not final.message.tool_calls
    assert final.prompt_eval_count > r.prompt_eval_count      # the call and its result are in the prompt


def test_generate_stream_non_stream_raw_and_context(client, server):
    g = client.generate(model=name(server), prompt="Weather?", think=False, options=GREEDY)
    assert g.response == ANSWER and g.done_reason == "stop"
    parts = list(client.generate(model=name(server), prompt="Weather?", think=False, stream=True, options=GREEDY))
    assert "".join(p.response for p in parts) == ANSWER and parts[-1].context == g.context
    t = client.generate(model=name(server), prompt="Weather?", think=True, options=GREEDY)
    assert t.thinking == THINKING                                     # generate splits thinking too
    raw = client.generate(model=name(server), raw=True, options=GREEDY,
                          prompt="<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert raw.response == ANSWER
    cont = client.generate(model=name(server), prompt="More?", context=g.context, think=False,
                           options={**GREEDY, "num_predict": 1})
    assert cont.prompt_eval_count > len(g.context) and cont.context[:len(g.context)] == g.context
    load = client.generate(model=name(server))
    assert load.done and load.done_reason == "load"
    unload = client.chat(model=name(server), messages=[], keep_alive=0)
    assert unload.done_reason == "unload"


def test_errors_in_ollama_shape(client, server):
    def call(method, path, body=None, headers=None):
        c = RawClient(server.port)
        c.send(request_bytes(method, path, body, headers))
        r = c.read_head()
        raw = c.read_body(r)
        c.close()
        return r.status, json.loads(raw)

    for path in ("/api/pull", "/api/push", "/api/create", "/api/delete", "/api/copy"):
        status, body = call("POST", path, {"model": "x"})
        assert status == 400 and set(body) == {"error"} and "fixed model" in body["error"]
    status, body = call("POST", "/api/embed", {"model": "x", "input": "hello"})  # a chat model: no embeddings
    assert status == 400 and set(body) == {"error"} and "a text generation model" in body["error"]
    assert call("GET", "/api/nothing") == (404, {"error": "Unknown path: /api/nothing"})
    status, body = call("GET", "/api/chat")
    assert status == 405 and set(body) == {"error"}
    status, body = call("POST", "/api/chat", b"{not json")
    assert status == 400 and "JSON" in body["error"]
    status, body = call("POST", "/api/chat", {"model": "m", "messages": [{"role": "user", "content": "x"}],
                                               "format": {"type": "string", "format": "no-such-format"}})
    assert status == 400 and set(body) == {"error"} and "'format'" in body["error"] and "no-such-format" in body["error"]
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=name(server), messages=[{"role": "user", "content": "x"}], options={"top_p": "all"})
    assert e.value.status_code == 400 and "top_p" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=name(server), messages=[{"role": "user", "content": "x"}],
                    options={"num_ctx": 8})
    assert e.value.status_code == 400 and "num_ctx" in e.value.error
    for n in (-5, -3, 0):   # Ollama's -1 (until the model stops) and -2 (fill the context) only; -5 ran unbounded
        with pytest.raises(ollama.ResponseError) as e:
            client.chat(model=name(server), messages=[{"role": "user", "content": "x"}], options={"num_predict": n})
        assert e.value.status_code == 400 and f"'options.num_predict': {n}" in e.value.error, e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model=name(server), prompt="x", images=[base64.b64encode(b"png").decode()])
    assert e.value.status_code == 400 and "images" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:      # a context id past the vocabulary
        client.generate(model=name(server), prompt="x", context=[1, 10**9])
    assert e.value.status_code == 400 and "'context'" in e.value.error and "1000000000" in e.value.error


def test_api_key_in_ollama_shape(scripted_qwen3):
    with LiveServer(scripted_qwen3, api_keys=("k1",)) as s:
        c = RawClient(s.port)
        c.send(request_bytes("POST", "/api/chat", {"model": "m", "messages": []}))
        r = c.read_head()
        assert r.status == 401 and set(json.loads(c.read_body(r))) == {"error"}
        c.close()
        ok = ollama.Client(host=s.url, headers={"Authorization": "Bearer k1"})
        assert ok.chat(model="m", messages=[{"role": "user", "content": "x"}], think=False,
                       options=GREEDY).message.content == ANSWER
        with pytest.raises(ollama.ResponseError):
            ollama.Client(host=s.url).list()


def test_langchain_chat_ollama_invoke_and_stream(server):
    from langchain_core.messages import HumanMessage
    from langchain_ollama import ChatOllama

    llm = ChatOllama(model=name(server), base_url=server.url, temperature=0, reasoning=False)
    msg = llm.invoke([HumanMessage("What's the weather?")])
    assert msg.content == ANSWER and msg.usage_metadata["output_tokens"] == 6
    chunks = list(llm.stream("What's the weather?"))
    assert "".join(c.content for c in chunks) == ANSWER
    thinking = ChatOllama(model=name(server), base_url=server.url, temperature=0, reasoning=True)
    bound = thinking.bind_tools([WEATHER_TOOL])
    called = bound.invoke("Weather in Paris?")
    assert called.tool_calls[0]["name"] == "get_weather" and called.tool_calls[0]["args"] == {"city": "Paris"}
    assert called.additional_kwargs.get("reasoning_content") == THINKING


def test_image_on_tiny_qwen3_vl_matches_the_openai_route(tmp_path_factory):
    png = image_bytes(120, 90, "PNG", seed=5)
    with LiveServer(cached_qwen3_vl(tmp_path_factory)) as s:
        c = ollama.Client(host=s.url)
        assert "vision" in c.show(s.api_cfg.model_name).capabilities
        r = c.chat(model="vl", messages=[{"role": "user", "content": "Describe.", "images": [png]}],
                   options={"temperature": 0, "num_predict": 6})
        oa = openai.OpenAI(base_url=s.url + "/v1", api_key="x").chat.completions.create(
            model="vl", temperature=0, max_tokens=6, messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()}},
                {"type": "text", "text": "Describe."}]}])
        assert r.message.content == oa.choices[0].message.content and r.eval_count == 6
        assert r.prompt_eval_count == oa.usage.prompt_tokens
        text_only = c.chat(model="vl", messages=[{"role": "user", "content": "Describe."}],
                           options={"temperature": 0, "num_predict": 1})
        assert r.prompt_eval_count > text_only.prompt_eval_count + 4     # the image's tokens
        # a bad image is named as the client sent it (the images list), not as our internal content part
        with pytest.raises(ollama.ResponseError) as e:
            c.chat(model="vl", messages=[{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": "Describe.", "images": [png, b"not a picture"]}])
        assert e.value.status_code == 400 and "'messages[1].images[1]'" in e.value.error, e.value.error
        with pytest.raises(ollama.ResponseError) as e:
            c.generate(model="vl", system="Be brief.", prompt="Describe.", images=[b"not a picture"])
        assert e.value.status_code == 400 and "Invalid image in 'images[0]'" in e.value.error, e.value.error
