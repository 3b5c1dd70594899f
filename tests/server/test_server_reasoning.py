"""Reasoning and logprobs through the whole server path, checked against the engine run directly.

Reasoning: a copy of the tiny checkpoint whose chat template opens `<think>` in the generation prompt (as
thinking-only Qwen3 templates do), so everything the random model generates is reasoning: the server must
route it to `reasoning_content`, stream and non-stream alike, and count it as reasoning tokens.
"""
from __future__ import annotations

import json

import pytest

from appliance.engine.generate import GenerationRequest
from appliance.engine.load import load_model
from appliance.engine.sampling import SamplingParams
from tests.support import tiny_models
from tests.support.live_server import LiveServer, RawClient, chat_body, request_bytes

N = 12


@pytest.fixture(scope="module")
def thinking_dir(tiny_qwen3_tied, tmp_path_factory):
    return tiny_models.thinking_copy(tiny_qwen3_tied, str(tmp_path_factory.mktemp("tiny-thinking")))


@pytest.fixture(scope="module")
def server(thinking_dir):
    with LiveServer(thinking_dir) as s:
        yield s


@pytest.fixture(scope="module")
def direct(thinking_dir):
    loaded = load_model(thinking_dir)
    prompt = loaded.chat_template.render([{"role": "user", "content": "Think."}], add_generation_prompt=True)
    assert prompt.endswith("<think>\n")
    ids = loaded.tokenizer.encode(prompt)
    req = GenerationRequest(prompt_ids=ids, sampling=SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2),
                            max_tokens=N, ignore_eos=True)
    events = list(loaded.engine.generate(req))
    return loaded, events


def post(server, body):
    c = RawClient(server.port)
    c.send(request_bytes("POST", "/v1/chat/completions", body))
    r = c.read_head()
    if body.get("stream"):
        c.read_events(r)
        c.close()
        return r, r.json_events()
    out = json.loads(c.read_body(r))
    c.close()
    return r, out


def test_reasoning_content_stream_and_non_stream(server, direct):
    _, events = direct
    text = "".join(e.text for e in events)
    expected = text.lstrip("\n").rstrip("\n")  # the template's own whitespace around <think> blocks

    _, chunks = post(server, chat_body("Think.", stream=True, max_tokens=N, temperature=0, ignore_eos=True,
                                       stream_options={"include_usage": True}))
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]][1:-1]  # between role frame and finish
    assert deltas and all(set(d) == {"reasoning_content"} for d in deltas)
    assert "".join(d["reasoning_content"] for d in deltas) == expected
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens_details"]["reasoning_tokens"] == N

    _, resp = post(server, chat_body("Think.", max_tokens=N, temperature=0, ignore_eos=True))
    msg = resp["choices"][0]["message"]
    assert msg["reasoning_content"] == expected and msg["content"] == ""
    assert resp["usage"]["completion_tokens_details"]["reasoning_tokens"] == N


def test_logprobs_cover_every_token_once(server, direct):
    loaded, events = direct
    tokens = [e for e in events if hasattr(e, "token_id")]
    _, chunks = post(server, chat_body("Think.", stream=True, max_tokens=N, temperature=0, ignore_eos=True,
                                       logprobs=True, top_logprobs=2))
    entries = [e for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
               for e in c["choices"][0]["logprobs"]["content"]]
    assert len(entries) == N == len(tokens)
    for entry, tok in zip(entries, tokens):
        assert bytes(entry["bytes"]) == loaded.tokenizer.token_bytes(tok.token_id)
        assert entry["logprob"] == pytest.approx(tok.logprob.logprob, abs=1e-4)
        assert len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0]["logprob"] >= entry["top_logprobs"][1]["logprob"]

    _, resp = post(server, chat_body("Think.", max_tokens=N, temperature=0, ignore_eos=True, logprobs=True))
    content = resp["choices"][0]["logprobs"]["content"]
    assert [bytes(e["bytes"]) for e in content] == [bytes(e["bytes"]) for e in entries]
