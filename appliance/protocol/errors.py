"""OpenAI-shaped API errors.

Policy: every client mistake becomes an ApiError with a 4xx status and the body OpenAI sends,
`{"error": {"message", "type", "param", "code"}}`; the `type` follows the status the way OpenAI's API does,
so the official client raises the matching exception class (BadRequestError, AuthenticationError, ...).
5xx is reserved for our own faults, never for client input.
"""
from __future__ import annotations

import json
from typing import Any

# status -> OpenAI error type
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


def error_type_for(status: int) -> str:
    if status in ERROR_TYPES:
        return ERROR_TYPES[status]
    return "server_error" if status >= 500 else "invalid_request_error"


class ApiError(Exception):
    """An error the API reports to the client: HTTP status plus OpenAI's error object fields.

    `headers` carries extra response headers the status needs (Retry-After on 429, Allow on 405).
    """

    def __init__(self, status: int, message: str, *, type: str | None = None, param: str | None = None,
                 code: str | None = None, headers: tuple[tuple[bytes, bytes], ...] = ()):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or error_type_for(status)
        self.param = param
        self.code = code
        self.headers = tuple(headers)

    def to_dict(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def __repr__(self) -> str:
        return f"ApiError({self.status}, {self.message!r}, type={self.type!r}, param={self.param!r}, code={self.code!r})"


def error_body(err: ApiError) -> bytes:
    """The JSON body of an error response (compact, UTF-8; never raises, whatever the message holds)."""
    return json.dumps(err.to_dict(), ensure_ascii=False, separators=(",", ":")).encode("utf-8", "replace")


# Constructors for the errors the server raises outside request parsing, so wording and codes stay uniform.

def invalid_api_key() -> ApiError:
    return ApiError(401, "Incorrect API key provided.", code="invalid_api_key")


def missing_api_key() -> ApiError:
    return ApiError(401, "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'.",
                    code="invalid_api_key")


def not_found(path: str) -> ApiError:
    return ApiError(404, f"Unknown path: {path}", code="unknown_url")


def method_not_allowed(method: str, path: str, allowed: tuple[str, ...]) -> ApiError:
    return ApiError(405, f"Method {method} is not allowed on {path}; use {', '.join(allowed)}.",
                    code="method_not_allowed", headers=((b"Allow", ", ".join(allowed).encode("ascii")),))


def model_not_found(model: str) -> ApiError:
    return ApiError(404, f"The model '{model}' does not exist.", param="model", code="model_not_found")


def body_too_large(limit: int) -> ApiError:
    return ApiError(413, f"Request body is larger than the limit of {limit} bytes.", code="request_too_large")


def queue_full(retry_after_s: int = 1) -> ApiError:
    return ApiError(429, "The server is busy: the request queue is full. Retry later.", code="queue_full",
                    headers=((b"Retry-After", str(int(retry_after_s)).encode("ascii")),))


def not_ready() -> ApiError:
    return ApiError(503, "The model is still loading.", code="model_loading",
                    headers=((b"Retry-After", b"1"),))


def server_shutdown() -> ApiError:
    """The server stopped before this request could be served (queued, or cut past the grace period)."""
    return ApiError(503, "The server is shutting down; retry the request.", code="server_shutdown",
                    headers=((b"Retry-After", b"5"),))


def context_length_exceeded(prompt_tokens: int, max_tokens: int | None, context_length: int,
                            at_least: bool = False) -> ApiError:
    """A prompt (plus any requested max_tokens) that does not fit the model's context window (`at_least`: the
    prompt was not tokenized to its end; prompt_tokens is a proven lower bound)."""
    if at_least:
        msg = (f"This model's maximum context length is {context_length} tokens. However, your messages "
               f"resulted in at least {prompt_tokens} tokens (counted until they were too many).")
    elif max_tokens is None:
        msg = (f"This model's maximum context length is {context_length} tokens. However, your messages "
               f"resulted in {prompt_tokens} tokens, which leaves no room for a completion.")
    else:
        msg = (f"This model's maximum context length is {context_length} tokens. However, you requested "
               f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, {max_tokens} in the "
               f"completion). Please reduce the length of the messages or completion.")
    return ApiError(400, msg, param="messages", code="context_length_exceeded")


KIND_NAMES = {"generate": "a text generation model", "embedding": "an embedding model", "rerank": "a reranker"}


def wrong_model_kind(kind: str, name: str, wanted: str) -> ApiError:
    """A request the served model's kind ('generate', 'embedding', 'rerank') does not serve."""
    how = {"embedding": "serve an embedding model (Qwen3-Embedding) or start with --embedding",
           "rerank": "serve a reranker (Qwen3-Reranker) with --reranking",
           "generate": "serve a chat model"}[wanted]
    what = {"embedding": "embeddings", "rerank": "reranking", "generate": "text generation"}[wanted]
    return ApiError(400, f"The served model '{name}' is {KIND_NAMES[kind]}; it does not serve {what} ({how}).",
                    param="model", code="model_not_supported")


def internal_error() -> ApiError:
    return ApiError(500, "The server had an error while processing your request.")
