"""Server-Sent Events framing and the JSON encoding every response body uses.

Policy: one event is one `data: <compact JSON>\\n\\n` record, written as soon as it exists; JSON is compact,
UTF-8, non-ASCII kept as is (ensure_ascii=False), and never contains NaN/Infinity (builders clamp them first,
and the encoder refuses them so a slip is caught in tests, not by a client's JSON parser).
"""
from __future__ import annotations

import json
from typing import Any

SSE_HEADERS: list[tuple[bytes, bytes]] = [
    (b"Content-Type", b"text/event-stream; charset=utf-8"),
    (b"Cache-Control", b"no-cache"),
    (b"Connection", b"keep-alive"),
    (b"X-Accel-Buffering", b"no"),
]
JSON_CONTENT_TYPE = b"application/json"
SSE_DONE = b"data: [DONE]\n\n"


def json_bytes(obj: Any) -> bytes:
    """Compact UTF-8 JSON (no spaces after separators, non-ASCII as is)."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode("utf-8")


def sse_event(obj: dict | str) -> bytes:
    """One SSE event: `data: <json>\\n\\n` for a dict, the text itself for a str.

    A str containing newlines becomes one `data:` line per line (the SSE way to carry a multi-line payload;
    a client joins them back with '\\n').
    """
    if isinstance(obj, str):
        lines = obj.replace("\r\n", "\n").replace("\r", "\n").split("\n")
        return b"".join(b"data: " + line.encode("utf-8") + b"\n" for line in lines) + b"\n"
    return b"data: " + json_bytes(obj) + b"\n\n"


def sse_comment(text: str = "keep-alive") -> bytes:
    """An SSE comment (`: text\\n\\n`): clients ignore it; it keeps proxies and idle timers from closing the stream."""
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    return b"".join(b": " + line.encode("utf-8") + b"\n" for line in lines) + b"\n"
