"""Prefix reuse seen by real clients: the openai client reads usage.prompt_tokens_details.cached_tokens on
stream and non-stream responses, the final chunk carries llama.cpp's timings.cache_n, the metrics extension
event says how much was reused, and /metrics counts reused and prefilled prompt tokens."""
from __future__ import annotations

import re
import urllib.request

import openai
import pytest

from tests.support.live_server import LiveServer

SYSTEM = {"role": "system", "content": "You answer in one short sentence. " * 6}


@pytest.fixture(scope="module")
def server(tiny_qwen3_tied):
    with LiveServer(tiny_qwen3_tied, queue=0, prefill_chunk=32) as s:
        yield s


@pytest.fixture()
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60) as c:
        yield c


def counters(server) -> dict[str, float]:
    text = urllib.request.urlopen(server.url + "/metrics", timeout=10).read().decode()
    return {m[0]: float(m[1]) for m in re.findall(r"^(kestrel_prompt_tokens\w*) (\S+)$", text, re.M)}


def test_second_turn_reports_cached_tokens_everywhere(client, server):
    before = counters(server)
    messages = [SYSTEM, {"role": "user", "content": "Name a river."}]
    first = client.chat.completions.create(model="m", messages=messages, max_tokens=6, temperature=0,
                                           extra_body={"ignore_eos": True, "chat_template_kwargs":
                                                       {"enable_thinking": False}})
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And a mountain?"}]
    chunks = list(client.chat.completions.create(
        model="m", messages=messages, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}}))
    usage = chunks[-1].usage
    cached = usage.prompt_tokens_details.cached_tokens  # the openai client's own field
    assert cached > first.usage.prompt_tokens - 10 and cached < usage.prompt_tokens
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason][0]
    assert finish.model_extra["timings"]["cache_n"] == cached
    assert finish.model_extra["timings"]["prompt_n"] == usage.prompt_tokens - cached
    # the same prompt again, non-stream: all but the last prompt token reused
    again = client.chat.completions.create(model="m", messages=messages, max_tokens=6, temperature=0,
                                           extra_body={"ignore_eos": True, "chat_template_kwargs":
                                                       {"enable_thinking": False}})
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
    assert again.model_extra["timings"]["cache_n"] == again.usage.prompt_tokens - 1
    assert again.choices[0].message.content == "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    after = counters(server)
    reused = after["kestrel_prompt_tokens_cached_total"] - before.get("kestrel_prompt_tokens_cached_total", 0)
    run = after["kestrel_prompt_tokens_prefilled_total"] - before.get("kestrel_prompt_tokens_prefilled_total", 0)
    assert reused == first.usage.prompt_tokens_details.cached_tokens + cached + again.usage.prompt_tokens - 1
    assert reused + run == first.usage.prompt_tokens + usage.prompt_tokens + again.usage.prompt_tokens


def test_metrics_event_carries_cached_tokens(server):
    import json
    body = json.dumps({"model": "m", "messages": [SYSTEM, {"role": "user", "content": "Hi"}], "max_tokens": 2,
                       "stream": True, "stream_options": {"include_metrics": True}}).encode()
    events = []
    for _ in range(2):
        req = urllib.request.Request(server.url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
        raw = urllib.request.urlopen(req, timeout=60).read().decode()
        events.append([json.loads(line[6:]) for line in raw.splitlines()
                       if line.startswith("data: {") and "chat.completion.metrics" in line][0]["metrics"])
    assert events[1]["cached_tokens"] == events[1]["prompt_tokens"] - 1
    assert events[1]["prefill_ms"] >= 0 and events[1]["cached_tokens"] > events[0]["cached_tokens"]
