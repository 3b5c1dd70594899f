"""--prompt-cache-dir: the KV of the prefix two requests share is written to disk (atomically) after the
response, and a restarted server serves its first request warm (cached_tokens > 0, same greedy tokens); a
corrupted, truncated or foreign file is ignored with a warning and never trusted."""
from __future__ import annotations

import logging
import os

import openai
import pytest

from appliance.engine.load import load_model
from tests.support.live_server import LiveServer

SYSTEM = {"role": "system", "content": "You are the house assistant. Entities: " +
          ", ".join(f"light.room_{i} (on)" for i in range(12))}
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}, "ignore_eos": True}


def serve(model_dir, cache_dir, **kw):
    return LiveServer(model_dir, queue=0, load=lambda: load_model(model_dir, context_length=512, prefill_chunk=32,
                                                                  prompt_cache_dir=str(cache_dir), **kw))


def ask(server, question):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60) as c:
        r = c.chat.completions.create(model="m", messages=[SYSTEM, {"role": "user", "content": question}],
                                      max_tokens=6, temperature=0, extra_body=NO_THINK)
    return r.usage.prompt_tokens_details.cached_tokens, r.choices[0].message.content


def files(d):
    return sorted(n for n in os.listdir(d) if n.endswith(".kvc"))


@pytest.fixture(scope="module")
def warm_dir(tiny_qwen3_tied, tmp_path_factory):
    """A cache directory written by one server run: two requests sharing the system prompt."""
    d = tmp_path_factory.mktemp("prompt-cache")
    with serve(tiny_qwen3_tied, d) as s:
        ask(s, "Turn on the kitchen light.")
        assert files(d) == []  # one request shares nothing yet
        ask(s, "Is the hall light on?")
        s.wait_for(lambda: files(d), what="the prompt cache file")
    assert not [n for n in os.listdir(d) if ".tmp" in n]  # written under a temporary name, then renamed
    return d


def test_restart_serves_the_first_request_warm(tiny_qwen3_tied, warm_dir, tmp_path):
    with serve(tiny_qwen3_tied, warm_dir) as s:
        cached, text = ask(s, "What is on in room 3?")
    assert cached > 100  # the system prompt and the user turn's opening
    with serve(tiny_qwen3_tied, tmp_path / "empty") as s:  # the same request without a cache on disk
        cold, cold_text = ask(s, "What is on in room 3?")
    assert cold == 0 and cold_text == text


def damaged(tmp_path, warm_dir, how):
    d = tmp_path / how
    d.mkdir()
    (name,) = files(warm_dir)
    data = (warm_dir / name).read_bytes()
    if how == "corrupted":
        data = data[:-100] + bytes([data[-100] ^ 0x40]) + data[-99:]
    elif how == "truncated":
        data = data[:len(data) // 2]
    elif how == "garbage":
        data = b"not a cache file at all"
    (d / name).write_bytes(data)
    return d


@pytest.mark.parametrize("how,reason", [("corrupted", "digest mismatch"), ("truncated", "truncated"),
                                        ("garbage", "not a prompt cache file")])
def test_damaged_file_is_ignored_with_a_warning(tiny_qwen3_tied, warm_dir, tmp_path, caplog, how, reason):
    d = damaged(tmp_path, warm_dir, how)
    with caplog.at_level(logging.WARNING, logger="appliance.prompt_cache"):
        with serve(tiny_qwen3_tied, d) as s:
            cached, _ = ask(s, "What is on in room 3?")
    assert cached == 0
    assert any(reason in r.getMessage() and "ignoring" in r.getMessage() for r in caplog.records), caplog.text
    assert files(d)  # not deleted: it is not ours to remove


def test_another_models_file_is_ignored(tiny_qwen3_untied, warm_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="appliance.prompt_cache"):
        with serve(tiny_qwen3_untied, warm_dir) as s:
            cached, _ = ask(s, "What is on in room 3?")
    assert cached == 0 and "another model" in caplog.text


def test_float32_cache_does_not_read_float16_files(tiny_qwen3_tied, warm_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="appliance.prompt_cache"):
        with serve(tiny_qwen3_tied, warm_dir, kv_type="f32") as s:
            cached, _ = ask(s, "What is on in room 3?")
    assert cached == 0 and "ignoring" in caplog.text
