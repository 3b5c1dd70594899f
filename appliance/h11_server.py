"""HTTP/1.1 over trio sockets with h11: the only module that touches sockets.

Policies:
- Every connection runs in its own nursery with a reader task that owns the receive side: bytes go into the
  h11 state machine as soon as they arrive, so a peer that closes is seen at once, even while its request is
  being prefilled; the request's cancel scope is then cancelled (and with it any generation it holds).
- Only the request task writes. Each write goes straight to the socket (TCP_NODELAY, no buffering here).
- Limits: request head size (h11's max_incomplete_event_size -> 431), body size (-> 413, by Content-Length
  before reading, or while reading a chunked body), slow request head (-> 408), slow body (-> 408), idle
  keep-alive (closed silently), stalled writes (closed). A connection whose request body was not fully read
  is closed after the response (with a short lingering drain so the client sees the response, not a reset).
- Shutdown: stop accepting, close idle keep-alive connections at once, let in-flight requests finish within
  the grace period, then cut what is left: a response not started gets 503 `server_shutdown`; a started body
  gets the application's error tail (`Exchange.stream_error`, an SSE error event) and a proper end of the
  chunked body, within CUT_S; then every connection is cancelled. Writes are shielded from cancellation
  (bounded by the write timeout, shortened at the cut), so a cancel never leaves half a chunk on the wire.
- Content-Length together with Transfer-Encoding (RFC 9112 6.3, a request-smuggling vector) is a 400 and the
  connection closes.
- The application is one coroutine `app(exchange)`; it sees an Exchange (request head, read_body, respond,
  start_stream/send/end_stream), never a socket. Headers it puts in `Exchange.extra_headers` (CORS) go on
  whatever response the request gets, error responses of this layer included.
- A response is marked complete as soon as its last byte is written, before any cancel (a client that read it
  and closed at once) can interrupt the handler: Exchange.outcome is the status it really ended with.
- Every response head (the application's, streams included, and this module's own errors) carries the board's
  name (`X-Kestrel-Board`, protocol/board.py) when the server has one.
- One access-log line per request (protocol/access_log.py) when it has ended, whatever way: the application
  adds its notes (tokens, queue wait, the error's reason) to `Exchange.notes`; malformed request heads get one
  too.
- While the model loads (answer_while_busy .. stop_busy_answers), a native thread that needs no GIL
  (native/busy_responder.py) answers any connection the event loop has not accepted within BUSY_GRACE_S with
  the application's fixed loading response (503, `Connection: close`; no access-log line, the count is logged
  at the end; no Host or Origin check either: the answer carries nothing a page could use): third-party native code in the load holds the GIL for up to seconds, and a watchdog or a load
  balancer must still get its answer. Meanwhile every response closes its connection, and around the load's
  known GIL-holding calls (GIL_BOUND sections) the event loop accepts nothing and the call waits until the
  loop's connections are answered, so no request is caught inside the loop by one. The sockets it watches
  close only after it has stopped.
"""
from __future__ import annotations

import errno
import logging
import math
import socket
import sys
import time
from dataclasses import dataclass
from http import HTTPStatus
from typing import Awaitable, Callable
from urllib.parse import unquote

import h11
import trio

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

from .native.busy_responder import GIL_BOUND, BusyResponder
from .protocol.access_log import access_level, access_line, peer_name, request_id
from .protocol.board import board_headers, with_board
from .protocol.errors import ApiError, body_too_large, error_body, internal_error, server_shutdown

log = logging.getLogger("appliance.server")
access_log = logging.getLogger("appliance.access")

RECV_SIZE = 65536
LINGER_S = 2.0                 # lingering close after an unread request body
LINGER_BYTES = 64 * 1024 * 1024
CUT_S = 1.0                    # past the grace period: time to write the cut responses' last bytes
BUSY_GRACE_S = 0.05            # answer_while_busy: how long a connection waits for the event loop first
CLIENT_CLOSED = 499            # the outcome of a request whose client left before its response was whole (nginx)


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    max_body: int = 4 * 1024 * 1024
    max_header: int = 16 * 1024
    keepalive_timeout: float = 15.0   # idle between requests
    header_timeout: float = 10.0      # from the first byte of a request to the end of its head
    body_timeout: float = 30.0
    write_timeout: float = 60.0       # one write blocked this long: the client stopped reading
    grace_period: float = 10.0
    board_name: str = ""              # X-Kestrel-Board on every response (protocol/board.py); "" sends none


class PeerGone(Exception):
    """The client closed the connection (or it broke) while we were reading or writing."""


def _only(exc: BaseException, kind: type | tuple[type, ...]) -> bool:
    """True when exc is `kind`, or an exception group whose every leaf is."""
    if isinstance(exc, BaseExceptionGroup):
        return all(_only(e, kind) for e in exc.exceptions)
    return isinstance(exc, kind)


class Exchange:
    """One request/response on a connection, as the application sees it."""

    def __init__(self, conn: "_Connection", req: h11.Request):
        self._conn = conn
        self.method = req.method.decode("ascii", "replace").upper()
        target = req.target.decode("latin-1")
        path, _, self.query = target.partition("?")
        self.path = unquote(path)
        self.http_version = req.http_version.decode("ascii")
        self.headers: dict[str, str] = {}
        for name, value in req.headers:  # h11 lower-cases names
            key = name.decode("latin-1")
            val = value.decode("latin-1")
            self.headers[key] = f"{self.headers[key]}, {val}" if key in self.headers else val
        self.response_started = False
        self.status: int | None = None
        self.complete = False
        self.stream_error: Callable[[ApiError], bytes] | None = None  # a started body's last bytes on a cut
        self.error_body: Callable[[ApiError], bytes] = error_body     # the path's API's error JSON (set by the app)
        self.started = time.perf_counter()
        self.request_id = request_id(self.headers.get("x-request-id"))
        self.notes: dict[str, object] = {}   # the application's additions to the access-log line
        self.extra_headers: list[tuple[bytes, bytes]] = []   # the application's headers for every response (CORS)
        self._bytes_before = conn.bytes_out

    def header(self, name: str, default: str | None = None) -> str | None:
        return self.headers.get(name.lower(), default)

    @property
    def max_body(self) -> int:
        return self._conn.cfg.max_body

    @property
    def peer_gone(self) -> bool:
        return self._conn.peer_gone

    @property
    def cut(self) -> bool:
        """The server cut this request at shutdown."""
        return self._conn.cut

    @property
    def bytes_sent(self) -> int:
        return self._conn.bytes_out - self._bytes_before

    @property
    def outcome(self) -> int:
        """The status the request ended with: the one sent when the response went out whole, else 499 when the
        client left, 503 when the server cut it at shutdown, else the one sent (500: none was)."""
        if self.complete:
            return self.status or 500
        return CLIENT_CLOSED if self.peer_gone else 503 if self.cut else self.status or 500

    @property
    def open_connections(self) -> int:
        """The server's client connections now (accepted, socket not yet closed), this one included."""
        return len(self._conn.server.connections)

    async def read_body(self, limit: int | None = None) -> bytes:
        conn = self._conn
        limit = conn.cfg.max_body if limit is None else limit
        length = self.header("content-length")
        if length is not None and length.strip().isdigit() and int(length) > limit:
            raise body_too_large(limit)
        h = conn.h11
        if h.client_is_waiting_for_100_continue:
            await conn.send(h11.InformationalResponse(status_code=100, headers=[], reason=b"Continue"))
        parts: list[bytes] = []
        size = 0
        deadline = trio.current_time() + conn.cfg.body_timeout
        while True:
            ev = await conn.next_event(deadline, "request body")
            if isinstance(ev, h11.Data):
                size += len(ev.data)
                if size > limit:
                    raise body_too_large(limit)
                parts.append(bytes(ev.data))
            elif isinstance(ev, h11.EndOfMessage):
                return b"".join(parts)
            else:  # ConnectionClosed
                raise PeerGone()

    async def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes,
                      reason: bytes | None = None) -> None:
        headers = list(headers) + [(b"Content-Length", str(len(body)).encode("ascii"))]
        await self._start(status, headers, reason)  # no checkpoint until it is all written and marked complete
        if body and self.method != "HEAD":  # a HEAD response has the headers of the GET one and no body
            await self._conn.send(h11.Data(data=body), checkpoint=False)
        await self.end_stream()

    async def start_stream(self, status: int, headers: list[tuple[bytes, bytes]], reason: bytes | None = None
                           ) -> None:
        await self._start(status, headers, reason)
        await trio.lowlevel.checkpoint_if_cancelled()

    async def _start(self, status: int, headers: list[tuple[bytes, bytes]], reason: bytes | None) -> None:
        self.response_started = True
        self.status = status
        self._conn._skip_buffered_body()
        headers = list(headers) + self.extra_headers
        if self._conn.h11.their_state is h11.SEND_BODY or self._conn.server.busy_answers:
            # the body stays unread, or the model is loading (GilBoundSections): this connection ends here
            headers = list(headers) + [(b"Connection", b"close")]
        await self._conn.send(h11.Response(status_code=status, headers=with_board(headers, self._conn.board),
                                           reason=reason or _reason(status)), checkpoint=False)

    async def send(self, data: bytes) -> None:
        await self._conn.send(h11.Data(data=data))

    async def end_stream(self) -> None:
        await self._conn.send(h11.EndOfMessage(), checkpoint=False)
        self.complete = True  # before the checkpoint: the client may close the moment it has read the end
        await trio.lowlevel.checkpoint_if_cancelled()


App = Callable[[Exchange], Awaitable[None]]


class _Connection:
    def __init__(self, server: "HttpServer", stream: trio.SocketStream):
        self.server = server
        self.cfg = server.cfg
        self.stream = stream
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=self.cfg.max_header)
        self.peer_gone = False
        self.idle = True
        self.scope = trio.CancelScope()
        self.request_scope: trio.CancelScope | None = None
        self._wakeup = trio.Event()
        self._eof_fed = False
        self.served = 0
        self.overflow = False
        self.cut = False                   # the server cut this connection's request at shutdown
        self._write_deadline = math.inf    # no write may block past this (set at the cut)
        self._write_scope: trio.CancelScope | None = None
        self.bytes_out = 0
        self.exchange: Exchange | None = None   # the request being served
        self.board = server.board                # the headers naming this board, on every response
        try:
            self.client = peer_name(stream.socket.getpeername())
        except (OSError, AttributeError):
            self.client = ""

    # ---- reading ---------------------------------------------------------------------------------------
    async def _read_loop(self) -> None:
        cap = self.cfg.max_header + self.cfg.max_body + RECV_SIZE
        try:
            while True:
                data = await self.stream.receive_some(RECV_SIZE)
                if not data:
                    break
                if self.overflow or len(self.h11.trailing_data[0]) + len(data) > cap:
                    self.overflow = True  # more than we would ever read: drop it; the connection ends after
                    continue              # this response (keep reading so a close is still seen)
                self.h11.receive_data(data)
                self._wakeup.set()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        self.peer_gone = True
        if not self._eof_fed:
            self._eof_fed = True
            self.h11.receive_data(b"")
        self._wakeup.set()
        if self.request_scope is not None:
            self.request_scope.cancel()

    async def _wait_data(self) -> None:
        ev = self._wakeup
        await ev.wait()
        if self._wakeup is ev:
            self._wakeup = trio.Event()

    async def next_event(self, deadline: float, what: str):
        """The next h11 event; ApiError(408) past the deadline; PeerGone if the connection ended."""
        while True:
            try:
                ev = self.h11.next_event()
            except h11.RemoteProtocolError as e:
                if self.peer_gone:
                    raise PeerGone() from None
                raise ApiError(e.error_status_hint, f"Malformed HTTP request: {e}", code="bad_http") from None
            if ev is h11.NEED_DATA:
                with trio.move_on_at(deadline):
                    await self._wait_data()
                    continue
                raise ApiError(408, f"Timed out reading the {what}.", code="request_timeout")
            if isinstance(ev, h11.ConnectionClosed):
                raise PeerGone()
            return ev

    async def _read_request_head(self) -> h11.Request | None:
        """The next request's head; None when the connection should end (closed, idle too long, bad head)."""
        now = trio.current_time()
        idle_deadline = now + (self.cfg.keepalive_timeout if self.served else self.cfg.header_timeout)
        head_deadline = None  # starts with the first byte of the request
        while True:
            try:
                ev = self.h11.next_event()
            except h11.RemoteProtocolError as e:
                if not self.peer_gone:
                    await self._send_error(ApiError(e.error_status_hint, f"Malformed HTTP request: {e}",
                                                    code="bad_http"))
                return None
            if isinstance(ev, h11.Request):
                size = len(ev.target) + sum(len(k) + len(v) + 4 for k, v in ev.headers)
                if size > self.cfg.max_header:  # it arrived in one piece, so h11's own limit did not apply
                    await self._send_error(ApiError(431, f"Request headers are larger than the limit of "
                                                         f"{self.cfg.max_header} bytes.", code="headers_too_large"))
                    return None
                names = {k for k, _ in ev.headers}
                if b"content-length" in names and b"transfer-encoding" in names:  # RFC 9112 6.3: smuggling
                    self.exchange = Exchange(self, ev)
                    await self._send_error(ApiError(400, "Malformed HTTP request: both Content-Length and "
                                                         "Transfer-Encoding.", code="bad_http"), self.exchange)
                    return None
                return ev
            if ev is not h11.NEED_DATA:  # ConnectionClosed, PAUSED
                return None
            if head_deadline is None and self.h11.trailing_data[0]:
                head_deadline = trio.current_time() + self.cfg.header_timeout
            with trio.move_on_at(head_deadline or idle_deadline):
                await self._wait_data()
                continue
            if head_deadline is not None:
                await self._send_error(ApiError(408, "Timed out reading the request headers.",
                                                code="request_timeout"))
            return None

    # ---- writing ---------------------------------------------------------------------------------------
    async def send(self, event, checkpoint: bool = True) -> None:
        data = self.h11.send(event)
        if not data:
            return
        deadline = min(trio.current_time() + self.cfg.write_timeout, self._write_deadline)
        broken = False
        with trio.CancelScope(shield=True, deadline=deadline) as scope:  # whole chunks only
            self._write_scope = scope
            try:
                await self.stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                broken = True
        self._write_scope = None
        if broken or scope.cancelled_caught:
            self.peer_gone = True
            raise PeerGone()
        self.bytes_out += len(data)
        if checkpoint:
            await trio.lowlevel.checkpoint_if_cancelled()

    def cut_request(self, deadline: float) -> None:
        """Shutdown past the grace period: end the running request now; writes stop at `deadline`."""
        self.cut = True
        self._write_deadline = deadline
        if self._write_scope is not None:
            self._write_scope.deadline = min(self._write_scope.deadline, deadline)
        if self.request_scope is not None:
            self.request_scope.cancel()
        else:
            self.scope.cancel()

    async def _end_cut(self, exchange: Exchange) -> None:
        """The last bytes of a request cut by shutdown: 503 if nothing was sent, else the stream's error tail
        and the end of the chunked body."""
        err = server_shutdown()
        with trio.CancelScope(shield=True):
            if not exchange.response_started:
                return await self._send_error(err, exchange)
            if self.h11.our_state is not h11.SEND_BODY:
                return
            try:
                tail = exchange.stream_error(err) if exchange.stream_error is not None else b""
                if tail:
                    await self.send(h11.Data(data=tail))
                await self.send(h11.EndOfMessage())
            except (PeerGone, h11.LocalProtocolError):
                pass

    async def _send_error(self, err: ApiError, exchange: Exchange | None = None) -> None:
        """An error response that closes the connection: for `exchange`'s request, or (None) for a request head
        that could not be read, which gets its access-log line here."""
        started = time.perf_counter()
        before = self.bytes_out
        if exchange is not None:
            exchange.notes.setdefault("error", err.message)
        if self.h11.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return
        body = exchange.error_body(err) if exchange is not None else error_body(err)
        headers = [(b"Content-Type", b"application/json"), (b"Content-Length", str(len(body)).encode()),
                   (b"Connection", b"close")] + list(err.headers)
        if exchange is not None:
            headers += exchange.extra_headers
        try:
            if exchange is not None:
                exchange.status = err.status
            await self.send(h11.Response(status_code=err.status, headers=with_board(headers, self.board),
                                         reason=_reason(err.status)), checkpoint=False)
            await self.send(h11.Data(data=body), checkpoint=False)
            await self.send(h11.EndOfMessage(), checkpoint=False)
            if exchange is not None:
                exchange.complete = True
        except (PeerGone, h11.LocalProtocolError):
            pass
        if exchange is None:
            self._log_access("-", "-", err.status, self.bytes_out - before, time.perf_counter() - started,
                             request_id(None), {"error": err.message}, self.peer_gone)

    def _log_access(self, method: str, path: str, status: int | None, sent: int, duration_s: float, rid: str,
                    notes: dict, gone: bool, cut: bool = False) -> None:
        level = access_level(method, path, status, gone)
        if access_log.isEnabledFor(level):
            access_log.log(level, "%s", access_line(method=method, path=path, status=status, bytes_sent=sent,
                                                    duration_s=duration_s, rid=rid, client=self.client,
                                                    notes=notes, client_gone=gone, cut=cut))

    def _log_ended(self) -> None:
        """The access-log line of the request that just ended (once)."""
        ex, self.exchange = self.exchange, None
        if ex is None:
            return
        gone = not ex.complete and self.peer_gone
        self._log_access(ex.method, ex.path, ex.status, ex.bytes_sent, time.perf_counter() - ex.started,
                         ex.request_id, ex.notes, gone, self.cut and not ex.complete)

    # ---- the request loop ------------------------------------------------------------------------------

    async def run(self) -> None:
        with self.scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._read_loop)
                try:
                    await self._serve()
                finally:
                    self._log_ended()
                    nursery.cancel_scope.cancel()
        with trio.CancelScope(shield=True):
            await self._close()

    async def _serve(self) -> None:
        while not self.server.closing:
            self.idle = True
            req = await self._read_request_head()
            self.idle = False
            if req is None:
                return
            exchange = self.exchange = Exchange(self, req)  # logged when it has ended (_log_ended)
            with trio.CancelScope() as scope:
                self.request_scope = scope
                if self.peer_gone:
                    scope.cancel()
                try:
                    await self.server.app(exchange)
                except PeerGone:
                    return
                except ApiError as e:  # HTTP-level errors raised while reading (413, 408, malformed body)
                    if not exchange.response_started:
                        await self._send_error(e, exchange)
                    return
                except BaseException as e:
                    if _only(e, (PeerGone, trio.Cancelled)) and not _only(e, trio.Cancelled):
                        # a write failed inside a nursery (grouped by trio), maybe beside tasks that the reader's
                        # cancel of the request reached: the client is gone (a cancel still in force re-raises)
                        return
                    if not isinstance(e, Exception):
                        raise
                    # a bug in the application: log it, answer 500 if we still can, close
                    log.exception("unhandled error in %s %s", exchange.method, exchange.path)
                    if not exchange.response_started:
                        await self._send_error(internal_error(), exchange)
                    return
            self.request_scope = None
            self.served += 1
            if self.cut and not self.peer_gone and not exchange.complete:
                await self._end_cut(exchange)
                return
            if scope.cancelled_caught or self.peer_gone or not exchange.complete:
                return
            self._skip_buffered_body()
            if self.overflow or self.h11.our_state is not h11.DONE or self.h11.their_state is not h11.DONE:
                return
            self.h11.start_next_cycle()
            self._log_ended()

    def _skip_buffered_body(self) -> None:
        """Consume the rest of a request body the application did not read (a GET's empty one, or a body
        answered with 401), as far as it is already here; if it is not all here, the connection will close."""
        try:
            while self.h11.their_state is h11.SEND_BODY:
                if self.h11.next_event() in (h11.NEED_DATA, h11.PAUSED):
                    return
        except h11.RemoteProtocolError:
            return

    async def _close(self) -> None:
        unread = (self.overflow or self.h11.their_state is h11.SEND_BODY) and not self.peer_gone
        try:
            if unread:  # lingering close: drain what the client is still sending, so that it gets to read our
                await self.stream.send_eof()  # response (413 ...) instead of a connection reset
                drained = 0
                with trio.move_on_after(LINGER_S):
                    while drained < LINGER_BYTES:
                        data = await self.stream.receive_some(RECV_SIZE)
                        if not data:
                            break
                        drained += len(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        with trio.move_on_after(1.0):
            await self.stream.aclose()


class HttpServer:
    def __init__(self, cfg: ServerConfig, app: App):
        self.cfg = cfg
        self.app = app
        self.board = board_headers(cfg.board_name)   # ValueError for a name that is no header value
        self.closing = False
        self.connections: set[_Connection] = set()
        self.listeners: list[trio.SocketListener] = []
        self.ports: list[int] = []
        self._accepting = trio.CancelScope()
        self._busy = BusyResponder(BUSY_GRACE_S)
        self._bound: list[socket.socket] = []       # the listeners' sockets (bind)

    def bind(self) -> None:
        """Bind now, with or without a running event loop (errors surface here: port in use, bad host), as
        trio.open_tcp_listeners does: every address the host resolves to, SO_REUSEADDR, IPv6 sockets v6-only.
        Records the bound ports."""
        socks: list[socket.socket] = []
        try:
            for family, kind, proto, _, addr in socket.getaddrinfo(self.cfg.host, self.cfg.port, type=socket.SOCK_STREAM,
                                                                   flags=socket.AI_PASSIVE):
                sock = socket.socket(family, kind, proto)
                socks.append(sock)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind(addr)
                sock.listen(0xFFFF)  # the kernel caps it at somaxconn
        except OSError as e:
            for sock in socks:
                sock.close()
            if e.errno == errno.EADDRINUSE:
                raise OSError(e.errno, f"cannot listen on {self.cfg.host}:{self.cfg.port}: address already in use"
                              ) from None
            raise OSError(e.errno, f"cannot listen on {self.cfg.host}:{self.cfg.port}: {e.strerror or e}") from None
        self._bound = socks
        self.listeners = [trio.SocketListener(trio.socket.from_stdlib_socket(sock)) for sock in socks]
        self.ports = [ln.socket.getsockname()[1] for ln in self.listeners]

    async def listen(self) -> None:
        """bind() from inside the event loop."""
        self.bind()

    async def serve(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Accept until shutdown() is called; returns when every connection has ended."""
        if not self.listeners:
            await self.listen()
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started(self.ports)
            with self._accepting:
                async with trio.open_nursery() as accept:
                    for ln in self.listeners:
                        accept.start_soon(self._accept_loop, ln, nursery)
            await self.stop_busy_answers()
            for ln in self.listeners:
                await ln.aclose()

    async def _accept_loop(self, listener: trio.SocketListener, nursery: trio.Nursery) -> None:
        while True:
            while self._busy.running and GIL_BOUND.active:  # the busy responder takes them meanwhile
                await trio.sleep(0.005)
            # while the busy responder runs, look at GIL_BOUND again every ACCEPT_RECHECK_S (accept is cancel-safe)
            wait = GIL_BOUND.ACCEPT_RECHECK_S if self._busy.running else math.inf
            try:
                with trio.move_on_after(wait):
                    nursery.start_soon(self._handle, await listener.accept())
            except OSError as e:  # EMFILE and friends: back off instead of spinning
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    await trio.sleep(0.1)
                    continue
                raise

    async def _handle(self, stream: trio.SocketStream) -> None:
        conn = _Connection(self, stream)
        self.connections.add(conn)
        try:
            await conn.run()
        except Exception:  # one connection's failure never takes the server down
            log.exception("connection failed")
        finally:
            self.connections.discard(conn)

    def answer_while_busy(self, status: int, headers: tuple[tuple[bytes, bytes], ...], body: bytes) -> bool:
        """From now until stop_busy_answers(), a connection the event loop leaves waiting BUSY_GRACE_S is
        answered with this response by a native thread that needs no GIL (native/busy_responder.py), and
        closed. False when there is no native library (the event loop answers alone)."""
        head = [b"HTTP/1.1 %d %s" % (status, HTTPStatus(status).phrase.encode()),
                *(k + b": " + v for k, v in (*headers, *self.board)),
                b"Content-Length: %d" % len(body), b"Connection: close"]
        started = self._busy.start([ln.socket.fileno() for ln in self.listeners],
                                   b"\r\n".join(head) + b"\r\n\r\n" + body)
        if started:
            GIL_BOUND.watch(lambda: len(self.connections))
        return started

    def busy_watchdog(self, address: bytes | None, interval_s: float = 0.0) -> int:
        """While the busy answers run, systemd's WATCHDOG=1 to `address` every `interval_s` from their thread
        (BusyResponder.watchdog); None: off (the event loop pings), the count of pings it sent."""
        return self._busy.watchdog(address, interval_s)

    @property
    def busy_answers(self) -> bool:
        """Between answer_while_busy and stop_busy_answers."""
        return self._busy.running

    async def stop_busy_answers(self) -> int:
        """End answer_while_busy (the thread is joined off the event loop); how many connections it answered."""
        if not self._busy.running:
            return 0
        GIL_BOUND.watch(None)
        return await trio.to_thread.run_sync(self._busy.stop)

    def close_now(self) -> None:
        """Without an event loop (a signal before it ran): end the busy answers, close the listening sockets."""
        self._busy.watchdog(None)
        self._busy.stop()
        GIL_BOUND.watch(None)
        for sock in self._bound:  # trio's own close needs the loop
            sock.close()

    async def shutdown(self, grace_period: float | None = None) -> None:
        """Stop accepting; idle connections close now, busy ones get the grace period, then are cancelled."""
        await self.stop_busy_answers()  # before the listening sockets close
        grace = self.cfg.grace_period if grace_period is None else grace_period
        self.closing = True
        self._accepting.cancel()
        with trio.move_on_after(grace):
            while self.connections:
                for conn in list(self.connections):
                    if conn.idle:
                        conn.scope.cancel()
                await trio.sleep(0.02)
        cut_deadline = trio.current_time() + CUT_S
        for conn in list(self.connections):
            conn.cut_request(cut_deadline)
        with trio.move_on_at(cut_deadline + 0.2):
            while self.connections:
                await trio.sleep(0.02)
        for conn in list(self.connections):
            conn.scope.cancel()


_REASONS = {100: b"Continue", 200: b"OK", 204: b"No Content", 400: b"Bad Request", 401: b"Unauthorized",
            403: b"Forbidden", 404: b"Not Found", 405: b"Method Not Allowed", 408: b"Request Timeout",
            413: b"Content Too Large", 415: b"Unsupported Media Type", 422: b"Unprocessable Content",
            429: b"Too Many Requests", 431: b"Request Header Fields Too Large", 500: b"Internal Server Error",
            503: b"Service Unavailable"}


def _reason(status: int) -> bytes:
    return _REASONS.get(status, b"")
