"""A real server (worker thread + trio + h11 on a real loopback socket) running in a background thread, and a
raw-socket HTTP/SSE client that timestamps what it receives.

The server is the production stack (Worker, Api, HttpServer) with the real engine on a real checkpoint; the
test thread can read the worker's engine-side counters (JobTrace) directly, which a subprocess would hide.
"""
from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import trio

from appliance.engine.constraint import build_grammar_tokenizer
from appliance.engine.load import load_model, model_name
from appliance.h11_server import HttpServer, ServerConfig
from appliance.server.app import Api, ApiConfig
from appliance.server.worker import Worker


def serving_model(model_dir: str, ctx: int | None, prefill_chunk: int):
    """The model loaded as the server loads it (cli serve; without the warm-up pass)."""
    loaded = load_model(model_dir, context_length=ctx, prefill_chunk=prefill_chunk)
    build_grammar_tokenizer(loaded.tokenizer, loaded.engine.model.config.vocab_size, loaded.eos_ids)
    return loaded


class LiveServer:
    def __init__(self, model_dir: str, *, queue: int = 4, api_keys: tuple[str, ...] = (),
                 extension_events: bool = False, prefill_chunk: int = 256, ctx: int | None = None,
                 queue_keepalive_s: float = 5.0, load=None, wait_ready: bool = True, image_dirs=(),
                 cors_origins: str = "", allowed_hosts: str = "", **server_cfg):
        self.model_dir = model_dir
        self.queue = queue
        self.api_cfg = ApiConfig(model_name=model_name(model_dir), api_keys=api_keys,
                                 extension_events=extension_events, queue_keepalive_s=queue_keepalive_s,
                                 image_dirs=tuple(image_dirs), cors_origins=cors_origins,
                                 allowed_hosts=allowed_hosts, listen_host="127.0.0.1")
        self.server_cfg = ServerConfig(host="127.0.0.1", port=0, **server_cfg)
        self._load = load or (lambda: serving_model(model_dir, ctx, prefill_chunk))
        self._ready = threading.Event()
        self._bound = threading.Event()
        self.wait_ready = wait_ready
        self._error: BaseException | None = None
        self.port = 0

    def __enter__(self) -> "LiveServer":
        self._thread = threading.Thread(target=self._run, name="live-server", daemon=True)
        self._thread.start()
        if not (self._ready if self.wait_ready else self._bound).wait(120):
            raise RuntimeError("server did not become ready")
        if self._error is not None:
            raise self._error
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as e:  # surfaced to the test thread
            self._error = e
            self._ready.set()
            self._bound.set()

    async def _main(self) -> None:
        self.token = trio.lowlevel.current_trio_token()
        self.worker = Worker(load=self._load, queue_limit=self.queue)
        self.api = Api(self.worker, self.api_cfg)
        self.server = HttpServer(self.server_cfg, self.api)
        await self.server.listen()
        self.port = self.server.ports[0]
        await self.worker.start()
        self._bound.set()
        self._stop = trio.Event()

        async def ready():
            await self.worker.ready.wait()
            self._ready.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.server.serve)
            nursery.start_soon(ready)
            nursery.start_soon(self.api.loop_lag.run)
            await self._stop.wait()
            self.worker.close_queue()
            await self.server.shutdown(self._grace)
            nursery.cancel_scope.cancel()

    def stop(self, grace: float = 2.0) -> None:
        if getattr(self, "token", None) is None or not self._thread.is_alive():
            return
        self._grace = grace
        try:
            trio.from_thread.run_sync(self._stop.set, trio_token=self.token)
        except trio.RunFinishedError:
            pass
        self._thread.join(30)
        self.worker.stop(5)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def traces(self) -> list:
        return list(self.worker.stats.traces)

    def wait_for(self, predicate, timeout: float = 30.0, what: str = "condition") -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            time.sleep(0.002)


# ---- a raw HTTP client ----------------------------------------------------------------------------------

def request_bytes(method: str, path: str, body: bytes | dict | None = None, headers: dict | None = None,
                  version: str = "1.1") -> bytes:
    if isinstance(body, dict):
        body = json.dumps(body).encode()
    h = {"Host": "127.0.0.1"}
    if body is not None:
        h["Content-Type"] = "application/json"
        h["Content-Length"] = str(len(body))
    h.update(headers or {})
    head = f"{method} {path} HTTP/{version}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in h.items()) + "\r\n"
    return head.encode("latin-1") + (body or b"")


@dataclass
class Received:
    head: bytes = b""
    status: int = 0
    headers: list[tuple[str, str]] = field(default_factory=list)
    raw_body: bytes = b""                      # as on the wire (chunked framing included)
    events: list[tuple[float, bytes]] = field(default_factory=list)   # (perf_counter at arrival, event bytes)
    _pending: bytes = b""      # body bytes not yet de-chunked
    _text: bytes = b""         # payload not yet split into events
    _finished: bool = False

    def header(self, name: str) -> str | None:
        for k, v in self.headers:
            if k.lower() == name.lower():
                return v
        return None

    def data_events(self) -> list[bytes]:
        return [e for _, e in self.events if e.startswith(b"data: ")]

    def json_events(self) -> list[dict]:
        return [json.loads(e[6:]) for e in self.data_events() if e != b"data: [DONE]\n\n"]


def dechunk(buf: bytes) -> tuple[bytes, bytes, bool]:
    """Decode complete chunks of a chunked body: (payload, rest, finished)."""
    out = b""
    while True:
        i = buf.find(b"\r\n")
        if i < 0:
            return out, buf, False
        size = int(buf[:i].split(b";")[0], 16)
        if size == 0:
            return out, buf[i + 2:], True
        if len(buf) < i + 2 + size + 2:
            return out, buf, False
        out += buf[i + 2:i + 2 + size]
        buf = buf[i + 2 + size + 2:]


class RawClient:
    """One TCP connection; reads a response head, then its body event by event with arrival times."""

    def __init__(self, port: int, timeout: float = 60.0):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def close(self) -> None:
        self.sock.close()

    def _recv(self) -> bytes:
        data = self.sock.recv(65536)
        return data

    def read_head(self) -> Received:
        while b"\r\n\r\n" not in self.buf:
            data = self._recv()
            if not data:
                raise ConnectionError(f"closed before a response head; got {self.buf!r}")
            self.buf += data
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        r = Received(head=head + b"\r\n\r\n", status=int(lines[0].split(" ")[1]))
        r.headers = [tuple(x.strip() for x in ln.split(":", 1)) for ln in lines[1:]]
        return r

    def read_events(self, r: Received, stop_after: int | None = None, until=None) -> Received:
        """Read SSE events until the body ends (or `stop_after` data events, or `until(r)` holds), timestamping
        each event. Can be called again on the same Received to continue."""
        if stop_after is not None:
            until = lambda r: len(r.data_events()) >= stop_after
        chunked = (r.header("transfer-encoding") or "").lower() == "chunked"
        while True:
            if until is not None and until(r):
                return r
            if self.buf:
                r._pending += self.buf
                r.raw_body += self.buf
                self.buf = b""
                if chunked:
                    payload, r._pending, r._finished = dechunk(r._pending)
                else:
                    payload, r._pending = r._pending, b""
                r._text += payload
                now = time.perf_counter()
                while b"\n\n" in r._text:
                    ev, r._text = r._text.split(b"\n\n", 1)
                    r.events.append((now, ev + b"\n\n"))
                continue
            if r._finished:
                return r
            data = self._recv()
            if not data:
                return r
            self.buf += data

    def read_body(self, r: Received) -> bytes:
        length = r.header("content-length")
        if length is not None:
            n = int(length)
            while len(self.buf) < n:
                data = self._recv()
                if not data:
                    break
                self.buf += data
            body, self.buf = self.buf[:n], self.buf[n:]
            r.raw_body = body
            return body
        while True:
            data = self._recv()
            if not data:
                break
            self.buf += data
        r.raw_body, self.buf = self.buf, b""
        return r.raw_body


def start_cli_server(model: str, *extra: str, timeout: float = 120.0, **popen) -> tuple[subprocess.Popen, int]:
    """`python -m appliance --model MODEL --port 0 *extra` as a process (stderr piped, text): (process, port) once
    /health says ok. A start that fails (exits, no 'listening on' line, not healthy within `timeout`) kills the
    process before raising; stopping it afterwards is the caller's (tests: the cli_server fixture)."""
    proc = subprocess.Popen([sys.executable, "-m", "appliance", "--model", model, "--port", "0", *extra],
                            stderr=subprocess.PIPE, text=True, **popen)
    try:
        deadline = time.monotonic() + timeout
        port = None
        while port is None:
            line = proc.stderr.readline()
            assert line or proc.poll() is None, "server exited"
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
            port = int(m.group(1)) if m else None
            assert time.monotonic() < deadline, "no 'listening on' line in time"
        assert wait_healthy(port, max(1.0, deadline - time.monotonic()), proc), "the server did not become healthy"
        return proc, port
    except BaseException:
        proc.kill()
        proc.wait()
        raise


def drain_stderr(proc: subprocess.Popen) -> threading.Thread:
    """Read a server process's stderr away in a daemon thread (its access log would fill the pipe of a test that
    makes many requests and reads nothing) until it closes."""
    def drain():
        try:
            for _ in proc.stderr:
                pass
        except (OSError, ValueError):  # closed by the fixture's teardown
            pass
    t = threading.Thread(target=drain, daemon=True)
    t.start()
    return t


def wait_healthy(port: int, timeout: float, proc=None) -> bool:
    """Poll GET /health on a server started as a process until it answers 200 (a refused connection or a 503 while
    the model loads: not yet). False when `proc` (a Popen) exits first or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and (proc is None or proc.poll() is None):
        try:
            c = RawClient(port, timeout=10)
            try:
                c.send(request_bytes("GET", "/health"))
                r = c.read_head()
                c.read_body(r)
            finally:
                c.close()
            if r.status == 200:
                return True
        except OSError:
            pass
        time.sleep(0.05)
    return False


def chat_body(content: str = "Count from 1 to 20.", **extra) -> dict:
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}]}
    body.update(extra)
    return body
