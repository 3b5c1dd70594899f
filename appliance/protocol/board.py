"""The board's name on every response (`X-Kestrel-Board`), so that a reverse proxy's routing (one conversation's
turns on one board) can be checked end to end from the client.

Policies:
- The name comes from `--board-name` (default: the host name). It is a header value sent as is on every response
  the HTTP layer writes (h11_server.py: the application's responses, streams, and its own 4xx/5xx), so it must be
  1-64 visible ASCII characters: no spaces, no control characters, nothing that needs quoting.
- An empty name sends no header (the in-process test servers' default).
"""
from __future__ import annotations

import re

BOARD_HEADER = b"X-Kestrel-Board"
MAX_NAME = 64
_NAME = re.compile(rf"[!-~]{{1,{MAX_NAME}}}")   # visible ASCII, no space


def board_name_problem(name: str) -> str | None:
    """Why `name` cannot be a board name (None: it can)."""
    if _NAME.fullmatch(name):
        return None
    if not name:
        return "is empty"
    if len(name) > MAX_NAME:
        return f"is longer than {MAX_NAME} characters"
    return "may hold only visible ASCII characters (no spaces)"


def board_headers(name: str) -> tuple[tuple[bytes, bytes], ...]:
    """The headers naming this board on every response: none for an empty name."""
    if not name:
        return ()
    problem = board_name_problem(name)
    if problem is not None:
        raise ValueError(f"board name {name!r} {problem}")
    return ((BOARD_HEADER, name.encode("ascii")),)


def with_board(headers: list[tuple[bytes, bytes]], board: tuple[tuple[bytes, bytes], ...]
               ) -> list[tuple[bytes, bytes]]:
    """A response's headers with the board's appended (after the application's own, before h11's framing)."""
    return list(headers) + list(board)
