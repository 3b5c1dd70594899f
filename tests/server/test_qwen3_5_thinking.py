"""Thinking on Qwen3.5 (hybrid Gated DeltaNet) through the CLI server with the official openai client.

The tiny Qwen3.5 is served with a template that opens `<think>` in the generation prompt (tiny_models.thinking_copy,
as the published Qwen3.5 template does by default): with thinking on, everything the random model writes is
reasoning, so it must come back as `reasoning_content` (streamed deltas and the whole message alike), never as
content, counted as reasoning tokens; with `enable_thinking: false` the same server answers in `content` with no
reasoning. Both texts are transformers' greedy continuations of transformers' own rendering of the template.
"""
from __future__ import annotations

import contextlib

import openai
import pytest

from tests.support import tiny_models
from tests.support.live_server import drain_stderr, start_cli_server

N = 12
MESSAGES = [{"role": "user", "content": "Think about rivers."}]


@pytest.fixture(scope="module")
def thinking_dir(tiny_qwen3_5, tmp_path_factory):
    return tiny_models.thinking_copy(tiny_qwen3_5, str(tmp_path_factory.mktemp("tiny-qwen3_5-thinking")))


@pytest.fixture(scope="module")
def client(thinking_dir):
    proc, port = start_cli_server(thinking_dir, "--ctx", "512", "--prefill-chunk", "16")
    drain_stderr(proc)
    try:
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0,
                           timeout=120) as c:
            yield c
    finally:
        proc.kill()
        proc.wait()
        with contextlib.suppress(OSError, ValueError):
            proc.stderr.close()


@pytest.fixture(scope="module")
def reference(thinking_dir):
    """transformers' greedy N tokens after transformers' rendering of the template (thinking on / off)."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(thinking_dir)
    model = AutoModelForImageTextToText.from_pretrained(thinking_dir, dtype=torch.float32).eval()

    def answer(thinking: bool) -> tuple[str, str]:
        prompt = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True,
                                         enable_thinking=thinking)
        ids = tok(prompt, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=N, min_new_tokens=N, do_sample=False)
        return prompt, tok.decode(out[0, len(ids):].tolist())
    return {True: answer(True), False: answer(False)}


def test_thinking_on_is_reasoning_content_streamed_and_not(client, reference):
    prompt, text = reference[True]
    assert prompt.endswith("<|im_start|>assistant\n<think>\n")
    assert "</think>" not in text                    # the random model never closes its think block in N tokens
    expected = text.lstrip("\n").rstrip("\n")        # the template's own newlines around the think block
    assert expected

    chunks = list(client.chat.completions.create(
        model="m", messages=MESSAGES, max_tokens=N, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    assert reasoning == expected
    assert all(not d.content for d in deltas)         # no token of it reached content
    assert chunks[-1].usage.completion_tokens == N
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == N

    resp = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=N, temperature=0,
                                          extra_body={"ignore_eos": True})
    msg = resp.choices[0].message
    assert msg.reasoning_content == expected and not msg.content
    assert resp.usage.completion_tokens_details.reasoning_tokens == N


def test_thinking_off_is_content_streamed_and_not(client, reference):
    prompt, text = reference[False]
    assert prompt.endswith("</think>\n\n")                   # the think block closed by the template
    off = {"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}}
    chunks = list(client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=N, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body=off))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == text
    assert all(not getattr(d, "reasoning_content", None) for d in deltas)
    assert not chunks[-1].usage.completion_tokens_details or \
        not chunks[-1].usage.completion_tokens_details.reasoning_tokens

    resp = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=N, temperature=0, extra_body=off)
    msg = resp.choices[0].message
    assert msg.content == text and not getattr(msg, "reasoning_content", None)
