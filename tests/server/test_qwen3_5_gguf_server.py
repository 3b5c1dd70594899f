"""Qwen3.5 from a GGUF file made by llama.cpp's converter (`qwen35`, f16) through the CLI server with the official
openai client: a streamed greedy chat answers as transformers does on the checkpoint the file came from (same
rendered prompt), and a follow-up turn resumes from the recurrent-state snapshot with the same answer."""
from __future__ import annotations

import openai
import pytest

from tests.support.hf_reference import greedy_answer
from tests.support.live_server import start_cli_server

NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}, "ignore_eos": True}


@pytest.fixture(scope="module")
def client(qwen3_5_gguf):
    proc, port = start_cli_server(qwen3_5_gguf["f16"], "--ctx", "512", "--prefill-chunk", "16")
    try:
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120) as c:
            yield c
    finally:
        proc.kill()
        proc.wait()
        proc.stderr.close()


@pytest.fixture(scope="module")
def reference(qwen3_5_gguf):
    """transformers' greedy continuation (text) of the checkpoint's template's rendering of `messages`."""
    return greedy_answer(qwen3_5_gguf["hf"])


def stream(client, messages, n):
    chunks = list(client.chat.completions.create(model="m", messages=messages, max_tokens=n, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body=NO_THINK))
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks[-1].usage


def test_streamed_chat_on_the_gguf_answers_as_transformers(client, reference):
    messages = [{"role": "system", "content": "You are a terse assistant."},
                {"role": "user", "content": "Name a river in France."}]
    text, usage = stream(client, messages, 12)
    assert text == reference(messages, 12) and usage.completion_tokens == 12
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "And a mountain?"}]
    follow, usage2 = stream(client, messages, 12)
    assert follow == reference(messages, 12)
    assert usage.prompt_tokens - 12 < usage2.prompt_tokens_details.cached_tokens < usage2.prompt_tokens
