"""Whatever the body, parsing ends in a request or an ApiError(400) — never another exception."""
from __future__ import annotations

import json
import random

import pytest

from appliance.protocol.errors import ApiError, error_body
from appliance.protocol.requests import ChatRequest, CompletionRequest, parse_chat_request, parse_completion_request

FIELDS = ["messages", "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
          "seed", "stop", "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs",
          "top_logprobs", "stream", "stream_options", "chat_template_kwargs", "tools", "tool_choice", "n",
          "response_format", "logit_bias", "ignore_eos", "enable_thinking", "prompt", "echo", "suffix", "best_of"]
GOOD = {"messages": [{"role": "user", "content": "hi"}], "prompt": "hi", "max_tokens": 8, "temperature": 0.5,
        "stream": True, "stream_options": {"include_usage": True}, "stop": ["x"], "logprobs": True, "n": 1,
        "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto", "seed": 3}


def rand_value(rng: random.Random, depth: int = 0):
    kinds = ["null", "bool", "int", "float", "str", "list", "dict"] if depth < 3 else ["null", "int", "str"]
    k = rng.choice(kinds)
    if k == "null":
        return None
    if k == "bool":
        return rng.random() < 0.5
    if k == "int":
        return rng.choice([0, 1, -1, 2, 5, 20, 21, 10**30, -10**30, 4096, 4097])
    if k == "float":
        return rng.choice([0.0, 0.5, 1.0, 1.5, -0.5, 2.0, 2.5, 1e300, -1e-300])
    if k == "str":
        return rng.choice(["", "a", "user", "assistant", "tool", "text", "image_url", "auto", "none", "\x00", "é",
                           "\ud800", "😀"])
    if k == "list":
        return [rand_value(rng, depth + 1) for _ in range(rng.randint(0, 5))]
    keys = ["role", "content", "type", "text", "function", "name", "arguments", "tool_calls", "image_url", "url",
            "include_usage", "include_metrics", "enable_thinking", "add_generation_prompt"]
    return {rng.choice(keys): rand_value(rng, depth + 1) for _ in range(rng.randint(0, 4))}


def mutate(rng: random.Random) -> dict:
    body = {k: v for k, v in GOOD.items() if rng.random() < 0.7}
    for _ in range(rng.randint(1, 4)):
        body[rng.choice(FIELDS)] = rand_value(rng)
    if "messages" in body and isinstance(body["messages"], list) and rng.random() < 0.5:
        body["messages"] = [{"role": rng.choice(["user", "system", "assistant", "tool", "x"]),
                             "content": rand_value(rng, 1)} for _ in range(rng.randint(0, 3))]
    return body


@pytest.mark.parametrize("seed", range(8))
def test_random_bodies_end_in_a_request_or_a_400(seed):
    rng = random.Random(seed)
    outcomes = {"ok": 0, "400": 0}
    for _ in range(400):
        raw = json.dumps(mutate(rng)).encode()
        for parse, kind in ((parse_chat_request, ChatRequest), (parse_completion_request, CompletionRequest)):
            try:
                r = parse(raw, defaults={"temperature": 0.6}, context_length=4096)
            except ApiError as e:
                assert e.status == 400 and e.type == "invalid_request_error" and e.message
                json.loads(error_body(e))
                outcomes["400"] += 1
            else:
                assert isinstance(r, kind)
                outcomes["ok"] += 1
    assert outcomes["ok"] > 0 and outcomes["400"] > 0


@pytest.mark.parametrize("seed", range(4))
def test_random_bytes_end_in_a_400(seed):
    rng = random.Random(seed)
    valid = json.dumps(GOOD).encode()
    for _ in range(300):
        raw = bytearray(valid)
        for _ in range(rng.randint(1, 6)):
            i = rng.randrange(len(raw))
            raw[i] = rng.randrange(256)
        try:
            parse_chat_request(bytes(raw), context_length=4096)
        except ApiError as e:
            assert e.status == 400
            json.loads(error_body(e))


# ---- the Ollama API (/api/chat, /api/generate) ----------------------------------------------------------

OLLAMA_FIELDS = ["model", "messages", "prompt", "system", "raw", "context", "images", "stream", "think", "format",
                 "options", "keep_alive", "tools", "suffix", "template"]
OLLAMA_OPTION_KEYS = ["temperature", "top_p", "top_k", "min_p", "seed", "num_predict", "num_ctx", "stop",
                      "repeat_penalty", "presence_penalty", "frequency_penalty", "mirostat"]
OLLAMA_GOOD = {"model": "m", "messages": [{"role": "user", "content": "hi", "images": ["iVBORw0KGgo="]}],
               "prompt": "hi", "stream": False, "think": True, "options": {"temperature": 0.5, "num_predict": 8},
               "keep_alive": "5m", "tools": [{"type": "function", "function": {"name": "f"}}]}


def ollama_mutate(rng: random.Random) -> dict:
    body = {k: v for k, v in OLLAMA_GOOD.items() if rng.random() < 0.7}
    for _ in range(rng.randint(1, 4)):
        body[rng.choice(OLLAMA_FIELDS)] = rand_value(rng)
    if rng.random() < 0.5:
        body["options"] = {rng.choice(OLLAMA_OPTION_KEYS): rand_value(rng, 2) for _ in range(rng.randint(0, 3))}
    if rng.random() < 0.4:
        body["messages"] = [{"role": rng.choice(["user", "assistant", "tool", "x"]), "content": rand_value(rng, 2),
                             rng.choice(["images", "tool_calls", "thinking", "tool_name"]): rand_value(rng, 2)}
                            for _ in range(rng.randint(0, 3))]
    return body


@pytest.mark.parametrize("seed", range(6))
def test_ollama_bodies_end_in_a_request_or_a_400(seed):
    from appliance.protocol.ollama_requests import OllamaRequest, parse_ollama_chat, parse_ollama_generate
    from appliance.protocol.ollama_stream import error_body as ollama_error_body
    rng = random.Random(1000 + seed)
    outcomes = {"ok": 0, "400": 0}
    for _ in range(400):
        raw = json.dumps(ollama_mutate(rng)).encode()
        if rng.random() < 0.1:
            raw = raw[:rng.randrange(len(raw))]
        for parse in (parse_ollama_chat, parse_ollama_generate):
            try:
                r = parse(raw, defaults={"temperature": 0.6}, context_length=4096, images_supported=rng.random() < 0.5)
            except ApiError as e:
                assert e.status == 400 and e.message
                assert set(json.loads(ollama_error_body(e))) == {"error"}
                outcomes["400"] += 1
            else:
                assert isinstance(r, OllamaRequest)
                outcomes["ok"] += 1
    assert outcomes["ok"] > 0 and outcomes["400"] > 0
