"""`kestrel-appliance fleet-config --board HOST:PORT ...`: the nginx configuration that puts several boards behind one
address, keeping each conversation on the board that holds its prefix cache (image/nginx/kestrel-fleet.conf is its
output for three example boards).

Policies:
- One board runs one generation at a time (plus `--queue` waiting); the proxy's job is to find a board with room and
  to send a conversation's next turn back to the board that served the last one (its KV is there: turn 2 prefills
  only the new turn). A stateless proxy can do both only by routing every turn of a conversation, turn 1 included,
  by the same function of what the turns share, so the board of a conversation is `hash KEY consistent`:
  KEY = the `X-Session-Id` header (the chat page sends one per conversation) or, without it, the first user message
  as it appears in the request body (Chat Completions / Ollama `messages`, Responses `input`): every turn re-sends
  it byte for byte, and it (after the system prompt) is where the prefix cache's reuse starts. A body with neither
  (a bare `prompt`, one larger than client_body_buffer_size, which nginx keeps in a file) gets the request's
  random id: no affinity. Requests that are no conversation (other paths without X-Session-Id) go `least_conn`.
- Load: a board that is full answers 429. nginx counts a 429 as a failed attempt towards max_fails (only 403 and 404
  are not), so `proxy_next_upstream http_429` on the hash pool would take full boards out of the rotation; instead
  the 429 is intercepted and the request goes on to the least_conn pool, where `proxy_next_upstream error timeout
  http_429 http_503 non_idempotent` with tries = the number of boards tries every board before the client sees a
  429 (so a 429 means every board was full). That pool has no passive health accounting (max_fails=0: 429s are its
  normal traffic); a dead board there costs one refused connection per request.
- Failure: the hash pool's passive health (`max_fails`, `fail_timeout`) takes a board that refuses connections,
  times out or answers 503 (loading, shutting down) out for fail_timeout; its conversations move to the next board
  on the ring (cold there: one full prefill) and come back when it returns (cold again after a restart, unless
  --prompt-cache-dir). A stream already running on a board that dies breaks: the client sees the chunked body end
  early, as with any proxy; nothing is re-sent once bytes went out. Generation has no side effects, so POSTs are
  retried (`non_idempotent`) while nothing was sent.
- Streams: proxy_buffering off (the boards also send X-Accel-Buffering: no), HTTP/1.1 with keep-alive to the boards,
  proxy_read_timeout above the longest generation (a non-streamed answer sends nothing until it is done).
- Open-source nginx has no active health checks; the generated file names /health for those that do (nginx Plus).
"""
from __future__ import annotations

import argparse
import ipaddress
import re
import sys
from dataclasses import dataclass

PROG = "kestrel-appliance fleet-config"
CONVERSATION_PATHS = ("/v1/chat/completions", "/v1/responses", "/api/chat")
_HOST = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?")


@dataclass(frozen=True)
class FleetOptions:
    listen: str = "8080"
    server_name: str = "_"
    read_timeout_s: int = 600
    connect_timeout_s: int = 2
    max_fails: int = 1
    fail_timeout_s: int = 10
    keepalive: int = 16
    max_body_mb: int = 4          # the boards' own request limit
    access_log: str = "/var/log/nginx/kestrel-fleet.access.log"


def parse_board(text: str) -> str:
    """HOST:PORT (IPv6 as [ADDR]:PORT), checked and normalized; ValueError with the reason."""
    m = re.fullmatch(r"\[([^\]]+)\]:(\d+)|([^:\[\]]+):(\d+)", text.strip())
    if m is None:
        raise ValueError(f"--board {text!r} is not HOST:PORT")
    host, port = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
    if not 1 <= int(port) <= 65535:
        raise ValueError(f"--board {text!r}: the port must be between 1 and 65535")
    if m.group(1):
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"--board {text!r}: {host} is not an IPv6 address") from None
        return f"[{host}]:{int(port)}"
    if not _HOST.fullmatch(host):
        raise ValueError(f"--board {text!r}: {host!r} is not a host name or address")
    return f"{host}:{int(port)}"


def _servers(boards: list[str], params: str) -> str:
    return "\n".join(f"    server {b}{params};" for b in boards)


# The first user message as the body shows it: "role":"user" then its "content" (a string, or the first KiB of a
# parts array), or the same with "content" first. Single-quoted for nginx: `\\\\` is the regex's `\\`.
_BODY_KEYS = (
    r"""'~"role"\s*:\s*"user"\s*,\s*"content"\s*:\s*(?<kestrel_c>"(?:[^"\\\\]|\\\\.)*"|\[[^\]]{0,1024})'""",
    r"""'~"content"\s*:\s*(?<kestrel_c>"(?:[^"\\\\]|\\\\.)*"|\[[^\]]{0,1024})\s*,\s*"role"\s*:\s*"user"'""",
)


def render(boards: list[str], opts: FleetOptions = FleetOptions(), command: str = "") -> str:
    """The nginx configuration (http-level: for /etc/nginx/conf.d/) for `boards` (HOST:PORT, parse_board'ed)."""
    if not boards:
        raise ValueError("at least one --board is needed")
    if len(set(boards)) != len(boards):
        raise ValueError("a board is named twice")
    n = len(boards)
    o = opts
    health = f" max_fails={o.max_fails} fail_timeout={o.fail_timeout_s}s"
    log = (f"access_log {o.access_log} kestrel_fleet;" if o.access_log != "off" else "access_log off;")
    paths = "|".join(re.escape(p.lstrip("/")) for p in CONVERSATION_PATHS)
    body_keys = "\n".join(f"    {k} $kestrel_c;" for k in _BODY_KEYS)
    return f"""\
# Kestrel Appliance: {n} board{'s' if n > 1 else ''} behind one nginx, each conversation kept on its warm board.
# Made by: {command or PROG + ' ' + ' '.join('--board ' + b for b in boards)}
# Put it in /etc/nginx/conf.d/ (it holds http-level directives only), then `nginx -t && systemctl reload nginx`.
# Start each board with its own name: kestrel-appliance ... --board-name NAME (every response says
# X-Kestrel-Board: NAME, so a client can see where its turns went).

# What identifies a conversation: the X-Session-Id header (any stable string per conversation; the chat page
# sends one) or, without it, the first user message as it appears in the body (every turn re-sends it unchanged,
# and the boards' prefix cache reuses a conversation's KV from there on). A body with neither gets the request's
# own id: it goes to any board.
map $request_body $kestrel_body_key {{
{body_keys}
    default $request_id;
}}
map $http_x_session_id $kestrel_conversation {{
    "" $kestrel_body_key;
    default $http_x_session_id;
}}
# Requests outside the conversation paths go least_conn, unless they carry X-Session-Id.
map $http_x_session_id $kestrel_pool {{
    "" kestrel_least_conn;
    default kestrel_affinity;
}}

# A conversation's board: a consistent hash of its key (turn 1 included: a stateless proxy can only send turn 2
# where turn 1 went by computing the same board again). Only errors, timeouts and 503s count as failures here;
# a board out of the rotation hands its conversations to the next board on the ring until fail_timeout ends.
upstream kestrel_affinity {{
    hash $kestrel_conversation consistent;
    zone kestrel_affinity 64k;
{_servers(boards, health)}
    keepalive {o.keepalive};
}}

# Full boards (429) and requests that are no conversation: the board with the fewest open requests, every board
# tried before the client sees a 429. No failure accounting: a 429 is this pool's normal traffic, not a fault.
upstream kestrel_least_conn {{
    least_conn;
    zone kestrel_least_conn 64k;
{_servers(boards, " max_fails=0")}
    keepalive {o.keepalive};
}}

# upstream= / upstream_status= list every board tried, in order (" : " where a 429 went on to the least_conn pool).
log_format kestrel_fleet '$remote_addr [$time_local] "$request" $status $body_bytes_sent id=$request_id '
                         'upstream=$upstream_addr upstream_status=$upstream_status '
                         'board=$upstream_http_x_kestrel_board rt=$request_time';

server {{
    listen {o.listen};
    server_name {o.server_name};
    {log}

    client_max_body_size {o.max_body_mb}m;
    # the whole body in memory: the conversation key is read from it, and a retry re-sends it
    client_body_buffer_size {o.max_body_mb}m;
    client_body_in_single_buffer on;

    proxy_http_version 1.1;
    proxy_set_header Connection "";
    proxy_set_header Host $host;
    proxy_set_header X-Request-Id $request_id;     # the boards' access lines say id=$request_id
    add_header X-Request-Id $request_id always;    # ... and so does the response
    proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
    proxy_buffering off;
    proxy_request_buffering on;
    proxy_connect_timeout {o.connect_timeout_s}s;
    proxy_send_timeout 60s;
    proxy_read_timeout {o.read_timeout_s}s;

    # A 429 from the conversation's board: on to the least_conn pool (nginx would count it as a failure here).
    proxy_intercept_errors on;
    error_page 429 = @kestrel_spill;
    proxy_next_upstream error timeout http_503 non_idempotent;
    proxy_next_upstream_tries {n};

    location ~ ^/({paths})$ {{
        proxy_pass http://kestrel_affinity;
    }}

    location / {{
        proxy_pass http://$kestrel_pool;
    }}

    location @kestrel_spill {{
        proxy_intercept_errors off;
        proxy_next_upstream error timeout http_429 http_503 non_idempotent;
        proxy_next_upstream_tries {n};
        proxy_pass http://kestrel_least_conn;
    }}

    # Active checks need nginx Plus: `health_check uri=/health match=kestrel_ready;` in both locations, with
    # match kestrel_ready {{ status 200; body ~ '"status": *"ok"'; }} at http level. /health also says "busy" and
    # the queue depth. Open-source nginx relies on the passive checks above.
}}
"""


def build_parser() -> argparse.ArgumentParser:
    d = FleetOptions()
    p = argparse.ArgumentParser(prog=PROG, description="Print an nginx configuration that serves several boards "
                                                       "behind one address (see README, 'Serving several boards').")
    p.add_argument("--board", action="append", required=True, metavar="HOST:PORT",
                   help="a board's address (repeat for each board)")
    p.add_argument("--listen", default=d.listen, metavar="ADDR", help=f"nginx's listen address (default {d.listen})")
    p.add_argument("--server-name", default=d.server_name, metavar="NAME")
    p.add_argument("--read-timeout", type=int, default=d.read_timeout_s, metavar="S",
                   help=f"longest wait between two reads from a board, above the longest generation "
                        f"(default {d.read_timeout_s})")
    p.add_argument("--max-fails", type=int, default=d.max_fails, metavar="N",
                   help=f"failures that take a board out of the rotation (default {d.max_fails}; 0: never)")
    p.add_argument("--fail-timeout", type=int, default=d.fail_timeout_s, metavar="S",
                   help=f"how long it stays out (default {d.fail_timeout_s})")
    p.add_argument("--access-log", default=d.access_log, metavar="PATH", help="nginx access log, or off")
    return p


def main(argv: list[str]) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    for name in ("read_timeout", "fail_timeout"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.max_fails < 0:
        p.error("--max-fails must be at least 0")
    if not re.fullmatch(r"[\w.:\[\]-]+", args.listen) or not re.fullmatch(r"[\w.*-]+", args.server_name):
        p.error("--listen and --server-name take one word each (an address/port, a host name)")
    if not re.fullmatch(r"[^\s;{}'\"]+", args.access_log):
        p.error("--access-log is one path without spaces, quotes, ';' or braces")
    try:
        boards = [parse_board(b) for b in args.board]
        opts = FleetOptions(listen=args.listen, server_name=args.server_name, read_timeout_s=args.read_timeout,
                            max_fails=args.max_fails, fail_timeout_s=args.fail_timeout, access_log=args.access_log)
        text = render(boards, opts, command="kestrel-appliance fleet-config " + " ".join(argv))
    except ValueError as e:
        p.error(str(e))
    sys.stdout.write(text)
    return 0
