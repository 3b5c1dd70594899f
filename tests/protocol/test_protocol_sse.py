"""SSE framing, JSON encoding and error bodies, byte for byte."""
from __future__ import annotations

import json

import pytest

from appliance.protocol import errors
from appliance.protocol.errors import ApiError, error_body
from appliance.protocol.sse import SSE_DONE, SSE_HEADERS, json_bytes, sse_comment, sse_event


def test_sse_headers_in_the_issue_order():
    assert SSE_HEADERS == [
        (b"Content-Type", b"text/event-stream; charset=utf-8"),
        (b"Cache-Control", b"no-cache"),
        (b"Connection", b"keep-alive"),
        (b"X-Accel-Buffering", b"no"),
    ]


def test_sse_event_dict_is_compact_utf8_json():
    assert sse_event({"a": 1, "b": [1, 2], "c": None}) == b'data: {"a":1,"b":[1,2],"c":null}\n\n'
    # non-ASCII stays as UTF-8 bytes, not \u escapes
    assert sse_event({"t": "你好 é"}) == b'data: {"t":"' + "你好 é".encode("utf-8") + b'"}\n\n'
    # a newline inside a JSON string is escaped, so one event stays one data line
    assert sse_event({"t": "a\nb"}) == b'data: {"t":"a\\nb"}\n\n'


def test_sse_event_str_and_done():
    assert sse_event("[DONE]") == SSE_DONE == b"data: [DONE]\n\n"
    assert sse_event("one\ntwo") == b"data: one\ndata: two\n\n"


def test_sse_comment():
    assert sse_comment() == b": keep-alive\n\n"
    assert sse_comment("queued 2") == b": queued 2\n\n"
    assert sse_comment("a\nb") == b": a\n: b\n\n"


def test_json_bytes_refuses_nan():
    with pytest.raises(ValueError):
        json_bytes({"x": float("nan")})


def test_sse_event_parses_back_with_a_line_based_reader():
    ev = sse_event({"k": "v\r\nw", "n": 1.5})
    assert ev.endswith(b"\n\n") and ev.count(b"\n") == 2
    assert json.loads(ev[len(b"data: "):-2]) == {"k": "v\r\nw", "n": 1.5}


def test_error_body_shape_and_types():
    e = ApiError(400, "bad 'temperature'", param="temperature", code="invalid_value")
    assert error_body(e) == (b'{"error":{"message":"bad \'temperature\'","type":"invalid_request_error",'
                             b'"param":"temperature","code":"invalid_value"}}')
    assert ApiError(401, "x").type == "authentication_error"
    assert ApiError(404, "x").type == "not_found_error"
    assert ApiError(429, "x").type == "rate_limit_error"
    assert ApiError(500, "x").type == "server_error"
    assert ApiError(418, "x").type == "invalid_request_error"
    assert error_body(ApiError(500, "x")) == \
        b'{"error":{"message":"x","type":"server_error","param":null,"code":null}}'


def test_error_constructors_carry_their_headers():
    q = errors.queue_full(2)
    assert (q.status, q.type, q.headers) == (429, "rate_limit_error", ((b"Retry-After", b"2"),))
    m = errors.method_not_allowed("GET", "/v1/chat/completions", ("POST", "OPTIONS"))
    assert (m.status, m.headers) == (405, ((b"Allow", b"POST, OPTIONS"),))
    c = errors.context_length_exceeded(100, 50, 128)
    assert (c.status, c.param, c.code) == (400, "messages", "context_length_exceeded")
    assert "128" in c.message and "150" in c.message
    assert errors.invalid_api_key().status == 401


@pytest.mark.parametrize("status,cls", [(400, "BadRequestError"), (401, "AuthenticationError"),
                                        (404, "NotFoundError"), (429, "RateLimitError"),
                                        (500, "InternalServerError")])
def test_openai_client_maps_our_error_bodies_to_its_exceptions(status, cls):
    """The official client builds its exception from status + body; check it reads our body's fields."""
    import httpx
    import openai

    err = ApiError(status, "boom", param="p", code="c")
    request = httpx.Request("POST", "http://test/v1/chat/completions")
    response = httpx.Response(status, content=error_body(err), request=request,
                              headers={"content-type": "application/json"})
    client = openai.OpenAI(api_key="k", base_url="http://test/v1")
    exc = client._make_status_error_from_response(response)
    assert type(exc).__name__ == cls
    assert exc.status_code == status
    assert exc.body == {"message": "boom", "type": err.type, "param": "p", "code": "c"}
    assert exc.code == "c" and exc.param == "p" and exc.type == err.type
