"""llama-server's utility endpoints, sans I/O: POST /tokenize, /detokenize, /apply-template (same request and
response shapes as llama-server's README gives them).

Policies:
- /tokenize: `content` (required string), `add_special` (default false: the tokenizer's post-processor tokens,
  BOS / a trailing EOS, are added only when asked), `parse_special` (default true: "<|im_start|>" written in the
  text is one token; false, treating special tokens as plain text, is a 400: our tokenizer is not switched per
  request), `with_pieces` (each token as `{"id", "piece"}`, the piece a string when its bytes are valid UTF-8,
  else the list of its byte values).
- /detokenize: `tokens`, a list of non-negative ids; the answer `{"content": "..."}` (special tokens included, as
  llama-server's detokenizer writes them).
- /apply-template: the body of a chat completion (`messages`, `tools`, `chat_template_kwargs`); the answer is
  `{"prompt": "..."}`, the model's template rendered with the generation prompt.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from appliance.protocol.fields import check_type, get, invalid, json_kind, load_json_object


@dataclass(frozen=True)
class TokenizeQuery:
    content: str
    add_special: bool = False
    with_pieces: bool = False


def parse_tokenize(body: bytes) -> TokenizeQuery:
    data = load_json_object(body)
    content = data.get("content")
    if content is None:
        raise invalid("content", "Missing required parameter: 'content'.", "missing_required_parameter")
    check_type(content, "string", "content")
    if not get(data, "parse_special", "boolean", default=True):
        raise invalid("parse_special", "'parse_special': false is not supported; special tokens written in the "
                                       "text are always parsed.", "unsupported_value")
    return TokenizeQuery(content, get(data, "add_special", "boolean", default=False),
                         get(data, "with_pieces", "boolean", default=False))


def tokenize_response(ids: Sequence[int], pieces: Sequence[bytes] | None) -> dict[str, Any]:
    if pieces is None:
        return {"tokens": list(ids)}
    out = []
    for i, b in zip(ids, pieces, strict=True):
        try:
            piece: Any = b.decode("utf-8")
        except UnicodeDecodeError:
            piece = list(b)
        out.append({"id": i, "piece": piece})
    return {"tokens": out}


def parse_detokenize(body: bytes) -> list[int]:
    data = load_json_object(body)
    tokens = data.get("tokens")
    if tokens is None:
        raise invalid("tokens", "Missing required parameter: 'tokens'.", "missing_required_parameter")
    check_type(tokens, "array", "tokens")
    for j, t in enumerate(tokens):
        if not isinstance(t, int) or isinstance(t, bool) or t < 0:
            raise invalid("tokens", f"Invalid 'tokens[{j}]': a token id is a non-negative integer, got "
                                    f"{json_kind(t) if not isinstance(t, int) or isinstance(t, bool) else t}.",
                          "invalid_value")
    return list(tokens)


def detokenize_response(text: str) -> dict[str, Any]:
    return {"content": text}


def apply_template_response(prompt: str) -> dict[str, Any]:
    return {"prompt": prompt}
