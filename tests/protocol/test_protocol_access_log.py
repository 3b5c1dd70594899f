"""protocol/access_log.py: the access-log line byte for byte, what a client can and cannot put into it, the
request id, and the level each kind of request is logged at."""
from __future__ import annotations

import logging

from appliance.protocol.access_log import MAX_FIELD, access_level, access_line, peer_name, request_id


def line(**kw) -> str:
    args = dict(method="POST", path="/v1/chat/completions", status=200, bytes_sent=1834, duration_s=0.5324,
                rid="abc", client="127.0.0.1:5000", notes={})
    args.update(kw)
    return access_line(**args)


def test_line_byte_for_byte():
    notes = {"finish": "stop", "prompt_tokens": 25, "queue_ms": 3.25, "completion_tokens": 16, "cached_tokens": 0,
             "ttft_ms": 120.4, "tok_s": 31.52, "unknown": "ignored"}
    assert line(notes=notes) == ("POST /v1/chat/completions 200 bytes=1834 ms=532 id=abc client=127.0.0.1:5000 "
                                 "queue_ms=3.2 prompt_tokens=25 cached_tokens=0 completion_tokens=16 ttft_ms=120 "
                                 "tok_s=31.5 finish=stop")
    assert line(status=None, bytes_sent=0, notes={"prompt_tokens": 9}, client_gone=True) == (
        "POST /v1/chat/completions - bytes=0 ms=532 id=abc client=127.0.0.1:5000 prompt_tokens=9 client_gone")
    assert line(method="-", path="-", status=400, client="", notes={"error": 'Malformed "x"'}) == (
        '- - 400 bytes=1834 ms=532 id=abc client=- error="Malformed \\"x\\""')
    assert line(status=503, notes={}, cut=True).endswith(" cut")


def test_client_text_cannot_forge_a_line():
    text = line(path="/a b\r\n2026-12-02 INFO appliance.access: GET /x 200\x00ü€😀",
                notes={"error": "bad\nvalue \x1b[31m€"})
    assert "\n" not in text and "\r" not in text and "\x1b" not in text and "\x00" not in text
    assert text.isascii()
    assert text.startswith("POST /a%20b\\x0d\\x0a2026-12-02%20INFO%20appliance.access:%20GET%20/x%20200"
                           "\\x00\\xfc\\u20ac\\U0001f600 200 ")
    assert text.endswith(' error="bad\\nvalue \\u001b[31m\\u20ac"')
    long = line(path="/" + "p" * 5000, notes={"error": "e" * 5000})
    assert len(long) < 2 * MAX_FIELD + 200


def test_request_id_is_the_clients_plain_token_or_new():
    assert request_id("req-42.a:b_C") == "req-42.a:b_C"
    assert request_id(" padded ") == "padded"
    for bad in (None, "", "has space", "x" * 65, "new\nline", "quote\""):
        rid = request_id(bad)
        assert len(rid) == 16 and int(rid, 16) >= 0
    assert request_id(None) != request_id(None)


def test_levels():
    assert access_level("GET", "/health", 200) == logging.DEBUG
    assert access_level("HEAD", "/metrics", 200) == logging.DEBUG
    assert access_level("GET", "/health", 503) == logging.WARNING
    assert access_level("GET", "/health", 401) == logging.INFO
    assert access_level("POST", "/v1/chat/completions", 200) == logging.INFO
    assert access_level("POST", "/v1/chat/completions", 400) == logging.INFO
    assert access_level("POST", "/v1/chat/completions", 500) == logging.WARNING
    assert access_level("POST", "/v1/chat/completions", None, client_gone=True) == logging.INFO
    assert access_level("POST", "/v1/chat/completions", None) == logging.WARNING


def test_peer_name():
    assert peer_name(("127.0.0.1", 8080)) == "127.0.0.1:8080"
    assert peer_name(("::1", 8080, 0, 0)) == "[::1]:8080"
    assert peer_name(None) == ""
