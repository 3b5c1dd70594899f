"""The access log: one line per request, as nginx and llama-server write them (pure functions; the HTTP layer
emits the line when the request has ended, whatever way it ended).

Policies:
- The line: `METHOD PATH STATUS` then key=value fields in a fixed order: bytes (written to the socket for this
  response: head, body, chunk framing), ms (from the request head to the end), id (the client's X-Request-Id
  when it is a plain token of at most 64 characters, else one made here), client (address:port), then what the
  application noted (queue_ms, prompt_tokens, cached_tokens, completion_tokens, ttft_ms, tok_s, finish), then
  `client_gone` (the client left before the response was whole), `cut` (the server ended it at shutdown) and
  last `error="..."` (the reason the client was given, JSON-quoted).
- STATUS is the status line sent (`-`: none was); a request whose client left is counted as 499 in /metrics
  but logged with what was sent and `client_gone`.
- Client-controlled text (the path, the reason, which may quote the request) cannot forge lines: control and
  non-ASCII characters are escaped, spaces in the path become %20, both are cut at MAX_FIELD characters.
- Level: info; warning for 5xx; debug for the successful probes (GET/HEAD /health, /metrics) a kiosk or
  Prometheus repeats every few seconds, so that they do not bury the requests in the journal.
"""
from __future__ import annotations

import json
import logging
import re
import secrets
from typing import Any, Mapping

MAX_FIELD = 300
NOTE_ORDER = ("queue_ms", "prompt_tokens", "cached_tokens", "completion_tokens", "ttft_ms", "tok_s", "finish")
PROBE_PATHS = ("/health", "/metrics")
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")
_UNSAFE = re.compile(r"[^\x21-\x7e]")


def request_id(header: str | None) -> str:
    """The client's (or its proxy's) X-Request-Id when it is a plain token, else a new random one."""
    if header is not None and _REQUEST_ID.fullmatch(header.strip()):
        return header.strip()
    return secrets.token_hex(8)


def _escape_char(c: str, space: str) -> str:
    if c == " ":
        return space
    n = ord(c)
    return f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}"


def _escape(s: str, space: str) -> str:
    return _UNSAFE.sub(lambda m: _escape_char(m.group(), space), s[:MAX_FIELD])


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, float):
        return f"{v:.1f}" if abs(v) < 100 else f"{v:.0f}"
    if isinstance(v, int):
        return str(v)
    return _escape(str(v), "_")


def access_line(*, method: str, path: str, status: int | None, bytes_sent: int, duration_s: float, rid: str,
                client: str, notes: Mapping[str, Any], client_gone: bool = False, cut: bool = False) -> str:
    parts = [_escape(method, "_") or "-", _escape(path, "%20") or "-", str(status) if status else "-",
             f"bytes={bytes_sent}", f"ms={duration_s * 1000:.0f}", f"id={rid}", f"client={client or '-'}"]
    parts += [f"{k}={_value(notes[k])}" for k in NOTE_ORDER if notes.get(k) is not None]
    if client_gone:
        parts.append("client_gone")
    if cut:
        parts.append("cut")
    if notes.get("error"):
        parts.append("error=" + json.dumps(str(notes["error"])[:MAX_FIELD]))  # ensure_ascii: no raw controls
    return " ".join(parts)


def access_level(method: str, path: str, status: int | None, client_gone: bool = False) -> int:
    if status is None:
        return logging.INFO if client_gone else logging.WARNING
    if status >= 500:
        return logging.WARNING
    if status < 300 and not client_gone and method in ("GET", "HEAD") and path in PROBE_PATHS:
        return logging.DEBUG
    return logging.INFO


def peer_name(addr: Any) -> str:
    """A socket's peer address as host:port ([host]:port for IPv6); '' when unknown."""
    if isinstance(addr, tuple) and len(addr) >= 2:
        host, port = addr[0], addr[1]
        return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"
    return str(addr) if addr else ""
