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


def outcome(parse, raw: bytes, kind: type, rng: random.Random, render_error) -> str:
    """Parse one body: "ok" (a request of `kind`) or "400" (an ApiError whose body `render_error` makes)."""
    try:
        r = parse(raw, defaults={"temperature": 0.6}, context_length=4096, images_supported=rng.random() < 0.5)
    except ApiError as e:
        assert e.status == 400 and e.type == "invalid_request_error" and e.message
        rendered = json.loads(render_error(e))
        assert rendered["error"]       # OpenAI's {"error": {...}} or Ollama's {"error": "..."}
        return "400"
    assert isinstance(r, kind)
    return "ok"


@pytest.mark.parametrize("seed", range(6))
def test_ollama_bodies_end_in_a_request_or_a_400(seed):
    from appliance.protocol.ollama_requests import OllamaRequest, parse_ollama_chat, parse_ollama_generate
    from appliance.protocol.ollama_stream import error_body as ollama_error_body
    rng = random.Random(1000 + seed)
    seen = set()
    for _ in range(400):
        raw = json.dumps(ollama_mutate(rng)).encode()
        if rng.random() < 0.1:
            raw = raw[:rng.randrange(len(raw))]
        for parse in (parse_ollama_chat, parse_ollama_generate):
            seen.add(outcome(parse, raw, OllamaRequest, rng, ollama_error_body))
    assert seen == {"ok", "400"}


# ---- the Responses API (/v1/responses) --------------------------------------------------------------------

RESPONSES_FIELDS = ["model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "tools",
                    "tool_choice", "text", "reasoning", "stream", "store", "previous_response_id", "metadata",
                    "parallel_tool_calls", "top_logprobs", "background"]
RESPONSES_GOOD = {"model": "m", "input": "hi", "instructions": "x", "max_output_tokens": 32, "temperature": 0.5,
                  "tools": [{"type": "function", "name": "f"}], "tool_choice": "auto", "stream": True,
                  "reasoning": {"effort": "none"}, "text": {"format": {"type": "text"}}}
ITEM_TYPES = ["message", "function_call", "function_call_output", "reasoning", "item_reference", "x", None]
PART_TYPES = ["input_text", "input_image", "output_text", "refusal", "input_file"]


def responses_mutate(rng: random.Random) -> dict:
    body = {k: v for k, v in RESPONSES_GOOD.items() if rng.random() < 0.7}
    for _ in range(rng.randint(1, 4)):
        body[rng.choice(RESPONSES_FIELDS)] = rand_value(rng)
    if rng.random() < 0.5:
        items = []
        for _ in range(rng.randint(0, 4)):
            item = {"type": rng.choice(ITEM_TYPES), "role": rng.choice(["user", "assistant", "system", "tool"]),
                    "call_id": rng.choice(["c1", None, 3]), "name": rng.choice(["f", None]),
                    "arguments": rng.choice(["{}", None, {}]), "output": rand_value(rng, 2)}
            if rng.random() < 0.5:
                item["content"] = [{"type": rng.choice(PART_TYPES), "text": rand_value(rng, 3),
                                    "image_url": rng.choice(["data:image/png;base64,AAAA", None, 5])}
                                   for _ in range(rng.randint(0, 3))]
            else:
                item["content"] = rand_value(rng, 2)
            items.append({k: v for k, v in item.items() if v is not None or rng.random() < 0.3})
        body["input"] = items
    return body


@pytest.mark.parametrize("seed", range(6))
def test_responses_bodies_end_in_a_request_or_a_400(seed):
    from appliance.protocol.responses_requests import ResponsesRequest, parse_responses_request
    rng = random.Random(2000 + seed)
    seen = {outcome(parse_responses_request, json.dumps(responses_mutate(rng)).encode(), ResponsesRequest, rng,
                    error_body) for _ in range(400)}
    assert seen == {"ok", "400"}
