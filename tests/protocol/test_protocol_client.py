"""Our byte streams fed through the official openai client's own HTTP/SSE parsing (httpx MockTransport):
the documented loops work, and the seed's extension events are exactly what breaks them unless asked for."""
from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from appliance.protocol.chunks import ChatChunks, CompletionChunks, chat_completion
from appliance.protocol.errors import ApiError, error_body
from appliance.protocol.sse import SSE_DONE, SSE_HEADERS, json_bytes, sse_event
from appliance.protocol.stats import GenerationStats

STATS = GenerationStats(3, 2, 5.0, 6.0, 4.0, 12.0, 2.0, 500.0)


def chat_stream(extensions: bool) -> bytes:
    cc = ChatChunks("chatcmpl-x", "m", 1, include_usage=True)
    events = [cc.role(), cc.delta(reasoning_content="hmm"), cc.delta(content="Hel"), cc.delta(content="lo 你"),
              cc.finish("stop", STATS), cc.usage(3, 2)]
    if extensions:
        events += [cc.metrics(STATS), cc.tokens([1, 2, 3, 4, 5])]
    return b"".join(sse_event(e) for e in events) + SSE_DONE


def client_for(status: int, body: bytes, headers: list[tuple[bytes, bytes]]):
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, headers=headers, content=body)
    return openai.OpenAI(api_key="k", base_url="http://kestrel.test/v1", max_retries=0,
                         http_client=httpx.Client(transport=httpx.MockTransport(handler)))


def test_documented_streaming_loop_over_our_bytes():
    client = client_for(200, chat_stream(False), SSE_HEADERS)
    stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], stream=True,
                                            stream_options={"include_usage": True})
    text, usage = [], None
    for chunk in stream:
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
        else:
            usage = chunk.usage
    assert "".join(text) == "Hello 你"
    assert usage.prompt_tokens == 3 and usage.completion_tokens == 2


def test_extension_events_crash_the_documented_loop():
    """The measured fact behind sending them only on request."""
    client = client_for(200, chat_stream(True), SSE_HEADERS)
    stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], stream=True)
    with pytest.raises(IndexError):
        for chunk in stream:
            _ = chunk.choices[0].delta.content


def test_async_client_streams_our_bytes():
    async def run() -> str:
        async def handler(request: httpx.Request) -> httpx.Response:
            return httpx.Response(200, headers=SSE_HEADERS, content=chat_stream(False))
        client = openai.AsyncOpenAI(api_key="k", base_url="http://kestrel.test/v1", max_retries=0,
                                    http_client=httpx.AsyncClient(transport=httpx.MockTransport(handler)))
        out = []
        stream = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                                      stream=True)
        async for chunk in stream:
            if chunk.choices:
                out.append(chunk.choices[0].delta.content or "")
        return "".join(out)
    assert asyncio.run(run()) == "Hello 你"


def test_non_stream_response_through_the_client():
    body = json_bytes(chat_completion("chatcmpl-x", "m", 1, content="Hi", reasoning_content="r",
                                      finish_reason="length", prompt_tokens=3, completion_tokens=2,
                                      timings=STATS))
    client = client_for(200, body, [(b"Content-Type", b"application/json")])
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert r.choices[0].message.content == "Hi" and r.choices[0].finish_reason == "length"
    assert r.usage.total_tokens == 5


def test_completions_stream_through_the_client():
    cc = CompletionChunks("cmpl-x", "m", 1)
    body = b"".join(sse_event(e) for e in [cc.text("a"), cc.text("bc"), cc.finish("length", STATS)]) + SSE_DONE
    client = client_for(200, body, SSE_HEADERS)
    parts = [c.choices[0].text for c in client.completions.create(model="m", prompt="p", stream=True)]
    assert parts == ["a", "bc", ""]


def test_error_body_surfaces_as_client_exception():
    err = ApiError(400, "Invalid 'n'", param="n", code="unsupported_value")
    client = client_for(400, error_body(err), [(b"Content-Type", b"application/json")])
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], n=2)
    assert info.value.param == "n" and info.value.code == "unsupported_value"
    assert "Invalid 'n'" in str(info.value)


def test_client_stream_helper_accumulates_our_tool_call_and_reasoning_deltas():
    """openai's chat.completions.stream() helper merges deltas by index into a final ChatCompletion."""
    import itertools

    from appliance.protocol.assemble import ChatAssembler

    n = itertools.count()
    a = ChatAssembler(ChatChunks("chatcmpl-x", "m", 1, include_usage=True), tools=True,
                      new_id=lambda: f"call_{next(n)}")
    toks = ["<think>", "\nweather?", "\n</think>\n\n", "Checking.", "\n<tool_call>",
            "\n{\"name\": \"w\", \"arguments\": {\"c\": \"巴黎\"}}\n</tool_call>"]
    body = b"".join(a.start() + [a.token(t) for t in toks] + a.finish("stop", "", STATS))
    client = client_for(200, body, SSE_HEADERS)
    tools = [{"type": "function", "function": {"name": "w", "parameters": {"type": "object"}}}]
    with client.chat.completions.stream(model="m", messages=[{"role": "user", "content": "x"}],
                                        tools=tools) as stream:
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking."
    assert [(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls] == \
        [("call_0", "w", "{\"c\": \"巴黎\"}")]
    assert final.usage.total_tokens == 5
