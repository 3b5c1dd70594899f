"""The official `openai` Python client, sync and async, unchanged, against the real server and engine."""
from __future__ import annotations

import asyncio

import openai
import pytest

from tests.support.live_server import LiveServer, RawClient, chat_body, request_bytes

KEY = "sk-test-key-123"
MESSAGES = [{"role": "user", "content": "Write a short poem about the sea."}]


@pytest.fixture(scope="module")
def server(tiny_qwen3_tied):
    with LiveServer(tiny_qwen3_tied, queue=0, api_keys=(KEY,)) as s:
        yield s


@pytest.fixture()
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60) as c:
        yield c


def test_stream_documented_loop_equals_non_stream(client, server):
    parts = []
    stream = client.chat.completions.create(model=server.api_cfg.model_name, messages=MESSAGES, stream=True,
                                            max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    for chunk in stream:  # the loop from the openai README
        parts.append(chunk.choices[0].delta.content or "")
    streamed = "".join(parts)

    resp = client.chat.completions.create(model=server.api_cfg.model_name, messages=MESSAGES, max_tokens=16,
                                          temperature=0, extra_body={"ignore_eos": True})
    assert resp.choices[0].message.content == streamed
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 16 and resp.usage.prompt_tokens > 0
    assert resp.model == server.api_cfg.model_name
    assert len(streamed) > 0


def test_stream_with_usage(client, server):
    stream = client.chat.completions.create(model="anything", messages=MESSAGES, stream=True, max_tokens=5,
                                            temperature=0, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert chunks[-2].choices[0].finish_reason == "length"


def test_completions_and_models(client, server):
    resp = client.completions.create(model=server.api_cfg.model_name, prompt="The capital of France is",
                                     max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    assert resp.object == "text_completion" and resp.usage.completion_tokens == 4
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="x", prompt="The capital of France is", max_tokens=4, temperature=0, stream=True,
        extra_body={"ignore_eos": True}))
    assert streamed == resp.choices[0].text
    models = client.models.list()
    assert [m.id for m in models.data] == [server.api_cfg.model_name]


def test_errors_surface_as_client_exceptions(client, server):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=MESSAGES, n=2)
    assert e.value.status_code == 400 and e.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=MESSAGES, temperature=7)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="m", messages=[{"role": "wizard", "content": "x"}])
    with pytest.raises(openai.BadRequestError) as e:  # prompt + max_tokens beyond the context
        client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4096)
    assert e.value.code == "context_length_exceeded" or e.value.body["code"] in ("context_length_exceeded",
                                                                                 "invalid_value")
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    with openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.chat.completions.create(model="m", messages=MESSAGES)
        assert [m.id for m in bad.models.list().data]  # /v1/models stays open
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x" * (5 << 20)}])
    assert e.value.status_code == 413


def test_queue_full_is_rate_limit_error(client, server):
    running = RawClient(server.port)
    running.send(request_bytes("POST", "/v1/chat/completions",
                               chat_body("Busy", stream=True, max_tokens=2000, ignore_eos=True),
                               headers={"Authorization": f"Bearer {KEY}"}))
    r = running.read_head()
    running.read_events(r, stop_after=2)
    try:
        with pytest.raises(openai.RateLimitError) as e:  # queue=0: nothing may wait
            client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)
        assert int(e.value.response.headers["retry-after"]) >= 1
    finally:
        running.close()
    server.wait_for(lambda: not server.worker.busy, what="the engine to go idle")


def test_async_client_stream_and_non_stream(server):
    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0) as c:
            stream = await c.chat.completions.create(model="m", messages=MESSAGES, stream=True, max_tokens=8,
                                                     temperature=0, extra_body={"ignore_eos": True})
            parts = []
            async for chunk in stream:
                parts.append(chunk.choices[0].delta.content or "")
            resp = await c.chat.completions.create(model="m", messages=MESSAGES, max_tokens=8, temperature=0,
                                                   extra_body={"ignore_eos": True})
            with pytest.raises(openai.BadRequestError):
                await c.chat.completions.create(model="m", messages=[])
            return "".join(parts), resp

    streamed, resp = asyncio.run(main())
    assert streamed == resp.choices[0].message.content and resp.usage.completion_tokens == 8


def test_completions_echo_and_logprobs(client, server):
    prompt = "The capital of France is"
    plain = client.completions.create(model="m", prompt=prompt, max_tokens=4, temperature=0,
                                      extra_body={"ignore_eos": True})
    echoed = client.completions.create(model="m", prompt=prompt, max_tokens=4, temperature=0, echo=True,
                                       extra_body={"ignore_eos": True})
    assert echoed.choices[0].text == prompt + plain.choices[0].text
    lp = client.completions.create(model="m", prompt=prompt, max_tokens=4, temperature=0, logprobs=2,
                                   extra_body={"ignore_eos": True}).choices[0].logprobs
    assert len(lp.tokens) == 4 == len(lp.token_logprobs) == len(lp.top_logprobs)
    if not any(t.startswith("bytes:") for t in lp.tokens):  # every token is whole UTF-8 text
        assert "".join(lp.tokens) == plain.choices[0].text
    assert all(len(alts) == 2 for alts in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
