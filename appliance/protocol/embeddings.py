"""Embedding requests and responses, sans I/O: OpenAI's POST /v1/embeddings, Ollama's /api/embed and the older
/api/embeddings.

Policies:
- OpenAI's `input` is a string, a list of strings, one list of token ids, or a list of token-id lists (all items
  of one kind); an empty string, an empty list or more than MAX_INPUTS items is a 400 naming `input`, as is a
  mixed list. Token ids are non-negative integers (the vocabulary bound is the server's check).
- `encoding_format` "float" (JSON numbers) or "base64" (the little-endian float32 bytes, what the openai client
  asks for by default and decodes); `dimensions` keeps the first N components (Matryoshka models, Qwen3-Embedding)
  and, when the model normalises, renormalises them to unit length.
- Ollama's /api/embed: `input` a string or a list of strings, `truncate` (default true: an input longer than the
  context is cut to it; false: a 400), `dimensions`; the answer is `embeddings` plus the durations in
  nanoseconds. /api/embeddings (legacy): `prompt` one string, the answer `{"embedding": [...]}` (an empty prompt
  gets an empty embedding, as Ollama answers).
- Vectors come in as sequences of floats (the server converts the engine's arrays off the event loop).
"""
from __future__ import annotations

import base64
import math
import struct
from dataclasses import dataclass
from typing import Any, Sequence

from appliance.protocol.fields import check_type, get, invalid, json_kind, load_json_object

MAX_INPUTS = 2048  # OpenAI's limit on the items of one embeddings request
ENCODINGS = ("float", "base64")


@dataclass(frozen=True)
class EmbeddingsQuery:
    """One embeddings request of any API: texts or token-id lists, in order."""
    inputs: tuple[str | tuple[int, ...], ...]
    encoding_format: str = "float"
    dimensions: int | None = None
    truncate: bool = False  # cut an input longer than the context (Ollama's default) instead of refusing it
    param: str = "input"  # the field the inputs came in (error messages)


def _dimensions(data: dict[str, Any]) -> int | None:
    dims = get(data, "dimensions", "integer")
    if dims is not None and dims < 1:
        raise invalid("dimensions", f"Invalid 'dimensions': {dims} is less than the minimum of 1.", "invalid_value")
    return dims


def _token_ids(items: list, param: str) -> tuple[int, ...]:
    for j, t in enumerate(items):
        if not isinstance(t, int) or isinstance(t, bool) or t < 0:
            raise invalid(param, f"Invalid '{param}[{j}]': a token id is a non-negative integer, got "
                                 f"{json_kind(t) if not isinstance(t, int) or isinstance(t, bool) else t}.",
                          "invalid_value")
    return tuple(items)


def _check_count(n: int, param: str) -> None:
    if n == 0:
        raise invalid(param, f"Invalid '{param}': the list is empty; send at least one input.", "invalid_value")
    if n > MAX_INPUTS:
        raise invalid(param, f"Invalid '{param}': {n} inputs; at most {MAX_INPUTS} are allowed in one request.",
                      "invalid_value")


def _texts(value: Any, param: str) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list):
        raise invalid(param, f"Invalid type for '{param}': expected a string or an array of strings, but got "
                             f"{json_kind(value)} instead.", "invalid_type")
    _check_count(len(items), param)
    for i, s in enumerate(items):
        if not isinstance(s, str):
            raise invalid(param, f"Invalid type for '{param}[{i}]': expected a string, but got {json_kind(s)} "
                                 f"instead.", "invalid_type")
        if not s:
            raise invalid(param, f"Invalid '{param}[{i}]': the string is empty.", "invalid_value")
    return tuple(items)


def parse_openai_embeddings(body: bytes) -> EmbeddingsQuery:
    data = load_json_object(body)
    value = data.get("input")
    if value is None:
        raise invalid("input", "Missing required parameter: 'input'.", "missing_required_parameter")
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        inputs: tuple[str | tuple[int, ...], ...] = (_token_ids(value, "input"),)
    elif isinstance(value, list) and value and all(isinstance(t, list) for t in value):
        _check_count(len(value), "input")
        inputs = tuple(_token_ids(t, f"input[{i}]") for i, t in enumerate(value))
        empty = next((i for i, t in enumerate(inputs) if not t), None)
        if empty is not None:
            raise invalid("input", f"Invalid 'input[{empty}]': the token list is empty.", "invalid_value")
    else:
        inputs = _texts(value, "input")
    fmt = get(data, "encoding_format", "string", default="float")
    if fmt not in ENCODINGS:
        raise invalid("encoding_format", f"Invalid 'encoding_format': {fmt!r}; expected 'float' or 'base64'.",
                      "invalid_value")
    get(data, "user", "string")
    return EmbeddingsQuery(inputs, fmt, _dimensions(data))


def parse_ollama_embed(body: bytes) -> EmbeddingsQuery:
    data = load_json_object(body)
    value = data.get("input")
    if value is None:
        raise invalid("input", "Missing required parameter: 'input'.", "missing_required_parameter")
    truncate = get(data, "truncate", "boolean", default=True)
    get(data, "options", "object")
    return EmbeddingsQuery(_texts(value, "input"), "float", _dimensions(data), truncate=truncate)


def parse_ollama_embeddings(body: bytes) -> EmbeddingsQuery:
    """/api/embeddings: one `prompt` (empty: no inputs, answered with an empty embedding)."""
    data = load_json_object(body)
    prompt = data.get("prompt")
    if prompt is None:
        raise invalid("prompt", "Missing required parameter: 'prompt'.", "missing_required_parameter")
    check_type(prompt, "string", "prompt")
    get(data, "options", "object")
    return EmbeddingsQuery((prompt,) if prompt else (), "float", None, truncate=True, param="prompt")


def shape_vector(v: Sequence[float], dimensions: int | None, renormalize: bool) -> list[float]:
    """The first `dimensions` components (all when None or more than there are), renormalised to unit length
    when the model's vectors are normalised."""
    out = [float(x) for x in v]
    if dimensions is None or dimensions >= len(out):
        return out
    out = out[:dimensions]
    if renormalize:
        n = math.sqrt(math.fsum(x * x for x in out))
        if n > 0:
            out = [x / n for x in out]
    return out


def encode_base64(v: Sequence[float]) -> str:
    """The vector as little-endian float32 bytes in base64 (what OpenAI sends for encoding_format=base64)."""
    return base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode("ascii")


def openai_response(model: str, vectors: Sequence[Sequence[float]], prompt_tokens: int, q: EmbeddingsQuery,
                    renormalize: bool) -> dict[str, Any]:
    data = []
    for i, v in enumerate(vectors):
        vec = shape_vector(v, q.dimensions, renormalize)
        data.append({"object": "embedding", "index": i,
                     "embedding": encode_base64(vec) if q.encoding_format == "base64" else vec})
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


def ollama_embed_response(model: str, vectors: Sequence[Sequence[float]], prompt_tokens: int, q: EmbeddingsQuery,
                          renormalize: bool, total_ns: int, load_ns: int) -> dict[str, Any]:
    return {"model": model, "embeddings": [shape_vector(v, q.dimensions, renormalize) for v in vectors],
            "total_duration": total_ns, "load_duration": load_ns, "prompt_eval_count": prompt_tokens}


def ollama_embeddings_response(vectors: Sequence[Sequence[float]]) -> dict[str, Any]:
    return {"embedding": shape_vector(vectors[0], None, False) if vectors else []}
