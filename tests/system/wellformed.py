"""What a well-formed response of each API looks like, for the soak's mixed load (tests/system/mixed_load.py):
each check takes a response's status, headers and whole body and returns None or what is wrong with it.

- Any generation request may be turned away with 429 when the queue is full: then it must carry an integer
  Retry-After >= 1 and the API's error JSON. Any other status is wrong (the load sends only valid requests).
- A stream must be a chunked body that ended (the terminal chunk) and end as its API ends one: `data: [DONE]`
  (OpenAI chat and completions), an NDJSON line with `"done": true` (Ollama), a `response.completed` or
  `response.incomplete` event (Responses), with no error event anywhere.
- A non-stream answer must be JSON of the API's shape; a structured-output or tool-call answer that finished
  (not cut by max_tokens) must parse and follow its schema.
"""
from __future__ import annotations

import json
from typing import Any

from tests.support.live_server import Received

FINISH_REASONS = {"stop", "length", "tool_calls"}


def retry_after_problem(r: Received, body: bytes, ollama: bool) -> str | None:
    ra = r.header("retry-after")
    if ra is None or not ra.isdigit() or int(ra) < 1:
        return f"429 without a valid Retry-After ({ra!r})"
    try:
        err = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return f"429 body is not error JSON: {body[:200]!r}"
    if ollama and not isinstance(err, str) or not ollama and not isinstance(err, dict):
        return f"429 error of the wrong API's shape: {err!r}"[:200]
    return None


def sse_events(payload: bytes) -> list[tuple[str | None, str]]:
    """(event name, data) of every SSE event with data (comments and keep-alives skipped)."""
    out = []
    for block in payload.decode("utf-8").split("\n\n"):
        name, data = None, []
        for line in block.split("\n"):
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data.append(line[6:])
        if data:
            out.append((name, "\n".join(data)))
    return out


def openai_stream_problem(payload: bytes, schema: dict | None = None) -> str | None:
    """Chat or text completions stream: JSON chunks, a finish_reason, then [DONE]; with `schema`, a chat's
    content that finished (not cut by max_tokens) must follow it."""
    events = [d for _, d in sse_events(payload)]
    if not events or events[-1] != "[DONE]":
        return f"stream does not end with [DONE]: {payload[-200:]!r}"
    chunks = [json.loads(d) for d in events[:-1]]
    if any("error" in c for c in chunks):
        return f"error event: {next(c for c in chunks if 'error' in c)}"[:300]
    reasons = [ch.get("finish_reason") for c in chunks for ch in c.get("choices", []) if ch.get("finish_reason")]
    if len(reasons) != 1 or reasons[0] not in FINISH_REASONS:
        return f"finish reasons {reasons}"
    if schema is not None and reasons[0] == "stop":
        return schema_problem("".join(ch["delta"].get("content") or "" for c in chunks for ch in c["choices"]), schema)
    return None


def responses_stream_problem(payload: bytes) -> str | None:
    events = sse_events(payload)
    names = [n for n, _ in events]
    for _, d in events:
        json.loads(d)
    if not names or names[0] != "response.created":
        return f"first event {names[:1]}"
    if "error" in names or "response.failed" in names:
        return f"error event in {names}"[:300]
    if names[-1] not in ("response.completed", "response.incomplete"):
        return f"stream ends with {names[-1]!r}"
    return None


def ndjson(payload: bytes) -> list[dict]:
    return [json.loads(line) for line in payload.split(b"\n") if line.strip()]


def ollama_stream_problem(payload: bytes) -> str | None:
    lines = ndjson(payload)
    if not lines or lines[-1].get("done") is not True:
        return f"NDJSON stream does not end with done: true: {payload[-200:]!r}"
    if any("error" in x for x in lines):
        return f"error line: {next(x for x in lines if 'error' in x)}"[:300]
    if any(x.get("done") for x in lines[:-1]):
        return "done: true before the last line"
    return None


def chat_problem(obj: dict, schema: dict | None = None, tool: str | None = None) -> str | None:
    """A non-stream chat completion; with `schema`, finished content must be JSON following it; with `tool`,
    finished tool calls must name it with JSON arguments."""
    choice = obj["choices"][0]
    msg, reason = choice["message"], choice["finish_reason"]
    if reason not in FINISH_REASONS or msg.get("role") != "assistant" or "usage" not in obj:
        return f"chat answer {obj}"[:300]
    if schema is not None and reason == "stop":
        return schema_problem(msg.get("content") or "", schema)
    if tool is not None and reason == "tool_calls":
        call = msg["tool_calls"][0]["function"]
        if call["name"] != tool:
            return f"tool call names {call['name']!r}"
        json.loads(call["arguments"])
    return None


def schema_problem(text: str, schema: dict) -> str | None:
    """The few schema rules the load's schema uses: an object with the required keys and declared types."""
    try:
        value = json.loads(text)
    except ValueError:
        return f"structured output is not JSON: {text[:200]!r}"
    types = {"boolean": bool, "integer": int, "string": str}
    if not isinstance(value, dict) or set(value) - set(schema["properties"]) or \
            not set(schema["required"]) <= set(value):
        return f"structured output {value!r} misses the schema's keys"[:300]
    for key, rule in schema["properties"].items():
        if key in value and ("enum" in rule and value[key] not in rule["enum"]
                             or "type" in rule and not isinstance(value[key], types[rule["type"]])):
            return f"structured output {key}={value[key]!r} breaks {rule}"[:300]
    return None


def completion_logprobs_problem(obj: dict, top: int) -> str | None:
    choice = obj["choices"][0]
    lp, n = choice["logprobs"], obj["usage"]["completion_tokens"]
    if choice["finish_reason"] not in FINISH_REASONS:
        return f"finish_reason {choice['finish_reason']!r}"
    if not (len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n):
        return f"logprobs of {len(lp['tokens'])} tokens for {n} completion tokens"
    if any(len(alts) > top for alts in lp["top_logprobs"]) or any(v > 0 for v in lp["token_logprobs"]):
        return "top_logprobs wider than asked or a positive logprob"
    return None


def ollama_problem(obj: dict, chat: bool) -> str | None:
    if obj.get("done") is not True or (chat and obj.get("message", {}).get("role") != "assistant") or \
            (not chat and not isinstance(obj.get("response"), str)):
        return f"ollama answer {obj}"[:300]
    return None


def responses_problem(obj: dict) -> str | None:
    if obj.get("object") != "response" or obj.get("status") not in ("completed", "incomplete"):
        return f"response object {obj}"[:300]
    return None


def body_problem(check: Any, body: bytes) -> str | None:
    """Run check(obj) on a JSON body; a body that is not JSON (or not of the shape check reads) is wrong too."""
    try:
        return check(json.loads(body))
    except (ValueError, KeyError, IndexError, TypeError) as e:
        return f"{type(e).__name__}: {e} in {body[:300]!r}"
