"""Defects found by probing the server as an attacker and a flaky network would, each a regression test on real
sockets against the production stack (Worker, Api, HttpServer; the real engine on tiny real checkpoints):
request preparation off the event loop, image decoding bounded by the queue and stopped when its client leaves,
FIFOs and NUL bytes under --image-dir, Content-Length with Transfer-Encoding, /metrics accounting, and the
event loop's lateness (measured by the server's own probe) under the worst inputs.

Responsiveness bounds (100 ms of loop lag, other streams' token gaps) are properties of the server, measured
against its own quiet baseline in the same run; memory budgets are the documented ones (README: Limits).
"""
from __future__ import annotations

import base64
import gc
import io
import json
import os
import socket
import threading
import time

import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from tests.support.live_server import LiveServer, RawClient, chat_body, request_bytes
from tests.support.tiny_vl import cached_qwen3_vl

LAG_BOUND_S = 0.100


def metrics(server) -> dict:
    c = RawClient(server.port)
    c.send(request_bytes("GET", "/metrics"))
    r = c.read_head()
    text = c.read_body(r).decode()
    c.close()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def requests_with(m: dict, endpoint: str, code: str) -> float:
    return m.get(("kestrel_requests_total", (("code", code), ("endpoint", endpoint))), 0.0)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRss:
    """Samples this process's RSS every 10 ms while in the with-block (the server runs in this process)."""

    def __enter__(self):
        self.base = rss_bytes()
        self.peak = self.base
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, rss_bytes())

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()

    @property
    def growth(self) -> int:
        return self.peak - self.base


def post(server, body: bytes | dict, path: str = "/v1/chat/completions", timeout: float = 120):
    c = RawClient(server.port, timeout=timeout)
    c.send(request_bytes("POST", path, body))
    r = c.read_head()
    payload = c.read_body(r)
    c.close()
    return r, payload


def p95(xs: list[float]) -> float:
    return sorted(xs)[int(0.95 * (len(xs) - 1))]


def assert_gaps_normal(quiet: list[float], attack: list[float]) -> None:
    """Token gaps under attack look like the quiet ones (p95 within 3x, or under the lag bound), and no gap
    comes near the multi-second stalls of a blocked loop. (The machine is shared: a single late wake-up of
    the reading thread is not the server's doing, so the bound on the worst gap is looser.)"""
    assert quiet and attack, "the background stream produced no tokens"
    assert p95(attack) < max(LAG_BOUND_S, 3 * p95(quiet)), (p95(attack), p95(quiet))
    assert max(attack) < 1.0, max(attack)


def loop_now(server) -> float:
    return trio.from_thread.run_sync(trio.current_time, trio_token=server.token)


@pytest.fixture(autouse=True)
def _collected_heap():
    """These servers run in the test process, whose heap holds every earlier test's objects; the real one freezes
    its start's objects out of the cyclic collector (cli.start_done). A full collection of that heap falling
    inside an attack window holds the GIL, so the loop, for its duration: the likely cause (not proven) of the
    one full-suite failure of the huge-prompt test, 103.7 ms against the 100 ms bound, 15-21 ms when run alone.
    One collection before each test leaves the next full pass far off."""
    gc.collect()
    yield


def assert_loop_responsive(server, quiet: tuple[float, float], attack: tuple[float, float]) -> None:
    """The server's own lag probe: no wake-up during the attack came later than 100 ms, or (on a loaded,
    shared machine, where the OS alone delays threads) later than three times the worst of a quiet
    window of the same server just before. A blocked loop shows as seconds."""
    lag = server.api.loop_lag
    worst_quiet, worst_attack = lag.worst_between(*quiet), lag.worst_between(*attack)
    assert worst_attack < max(LAG_BOUND_S, 3 * worst_quiet), (worst_attack, worst_quiet)
    m = metrics(server)
    assert m[("kestrel_event_loop_lag_max_seconds", ())] >= worst_attack - 1e-6


class BackgroundStream:
    """A long stream read in a thread: the token gaps another client sees while the test attacks."""

    def __init__(self, server, max_tokens: int = 4000):
        self.client = RawClient(server.port)
        self.client.send(request_bytes("POST", "/v1/chat/completions",
                                       chat_body("Tell a story.", stream=True, max_tokens=max_tokens, ignore_eos=True)))
        self.r = self.client.read_head()
        assert self.r.status == 200
        self.client.read_events(self.r, stop_after=3)
        self._t = threading.Thread(target=self._read, daemon=True)
        self._t.start()

    def _read(self):
        try:
            self.client.read_events(self.r)
        except OSError:  # closed by the test
            pass

    def quiet_window(self, server, seconds: float) -> tuple[list[float], tuple[float, float]]:
        """Token gaps of `seconds` with nothing else running, and that window on the loop's clock."""
        q0 = loop_now(server)
        time.sleep(seconds)
        return self.gaps_between(0, time.perf_counter()), (q0, loop_now(server))

    def times(self) -> list[float]:
        return [t for t, e in list(self.r.events) if e.startswith(b"data: {")]

    def gaps_between(self, t0: float, t1: float) -> list[float]:
        ts = [t for t in self.times() if t0 <= t <= t1]
        return [b - a for a, b in zip(ts, ts[1:])]

    def close(self):
        try:
            self.client.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._t.join(10)
        self.client.close()


@pytest.fixture(scope="module")
def server(tiny_qwen3_tied):
    with LiveServer(tiny_qwen3_tied, queue=1) as s:
        yield s


# ---- 1: request preparation runs off the event loop ------------------------------------------------------

def test_huge_prompt_does_not_stall_the_loop_or_other_streams(server):
    """A 3.9 MB body of "a a a ..." (under the 4 MB limit): refused (400, context) without tokenizing 2M
    tokens on the event loop; /health answers, another stream's tokens keep flowing, the loop's own lag
    probe stays under 100 ms, and the process does not keep (or briefly need) hundreds of MB."""
    body = json.dumps(chat_body("a " * (3_900_000 // 2 - 100))).encode()
    assert 3_800_000 < len(body) < 4 * 1024 * 1024
    bg = BackgroundStream(server)
    try:
        quiet, quiet_window = bg.quiet_window(server, 2.0)
        health = []

        def poll_health():
            for _ in range(10):
                t = time.perf_counter()
                c = RawClient(server.port, timeout=30)
                c.send(request_bytes("GET", "/health"))
                c.read_body(c.read_head())
                c.close()
                health.append(time.perf_counter() - t)
                time.sleep(0.05)
        poller = threading.Thread(target=poll_health)
        with PeakRss() as mem:
            t0, a0 = time.perf_counter(), loop_now(server)
            poller.start()
            results = []
            threads = [threading.Thread(target=lambda: results.append(post(server, body))) for _ in range(3)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            poller.join(30)
            t1, a1 = time.perf_counter(), loop_now(server)
        attack_gaps = bg.gaps_between(t0, t1)
    finally:
        bg.close()
    for r, payload in results:
        assert r.status == 400, payload
        assert json.loads(payload)["error"]["code"] == "context_length_exceeded"
    assert len(results) == 3
    assert_gaps_normal(quiet, attack_gaps)
    assert max(health) < 2.0, health  # a blocked loop held /health for 3.7-4.6 s
    assert_loop_responsive(server, quiet_window, (a0, a1))
    assert mem.growth < 150 * 2**20, f"RSS grew {mem.growth / 2**20:.0f} MB for three 3.9 MB prompts"


# ---- structured output: the grammar tokenizer table is built while the model loads ------------------------

ATTACK_MIN_S = 1.0


def test_first_structured_request_does_not_stall_the_loop(tiny_qwen3_tied):
    """llguidance's tokenizer table for a 150k vocabulary is seconds of work that holds the GIL (tokenizers'
    to_str, llguidance's LLTokenizer): built by the first request with a response_format, it stalled the event
    loop, /health and every other client's stream for 4.5 s (found by the soak's mixed load). The server builds
    it while the model loads; the first structured request is then as quick for the loop as any other."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
    body = chat_body("State?", max_tokens=16,
                     response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    with LiveServer(tiny_qwen3_tied, queue=1) as server:  # its own tokenizer object: nothing built before it
        bg = BackgroundStream(server)
        try:
            quiet, quiet_window = bg.quiet_window(server, 1.5)
            results = []
            client = threading.Thread(target=lambda: results.append(post(server, body)))
            t0, a0 = time.perf_counter(), loop_now(server)
            client.start()
            server.wait_for(lambda: server.worker.waiting == 1, 120, "the structured request to be prepared")
            # a window of at least ATTACK_MIN_S: a preparation quicker than a token gap leaves no gap to compare
            time.sleep(max(0.0, t0 + ATTACK_MIN_S - time.perf_counter()))
            t1, a1 = time.perf_counter(), loop_now(server)
            attack_gaps = bg.gaps_between(t0, t1)
        finally:
            bg.close()
        client.join(60)
        r, payload = results[0]
        assert_gaps_normal(quiet, attack_gaps)
        assert_loop_responsive(server, quiet_window, (a0, a1))
    assert r.status == 200, payload  # queued behind the stream, served once it was closed
    choice = json.loads(payload)["choices"][0]
    assert choice["finish_reason"] == "stop" and json.loads(choice["message"]["content"]) in ({"ok": True}, {"ok": False})


# ---- 7: Content-Length with Transfer-Encoding ------------------------------------------------------------

def test_content_length_with_transfer_encoding_is_refused_and_closes(server):
    """RFC 9112 6.3: both headers is a smuggling vector: 400, Connection: close, the pipelined request after
    it is never served."""
    body = json.dumps(chat_body("Hi", max_tokens=2)).encode()
    smuggled = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n"
                % (len(body) + 7, len(body), body))
    c = RawClient(server.port, timeout=10)
    c.send(smuggled + request_bytes("GET", "/health"))
    r = c.read_head()
    payload = c.read_body(r)
    assert r.status == 400 and r.header("connection") == "close"
    assert json.loads(payload)["error"]["code"] == "bad_http"
    assert c.sock.recv(65536) == b""  # closed: the pipelined GET was not answered
    c.close()


# ---- 8: /metrics counts disconnected and queued-cancelled requests ---------------------------------------

def test_metrics_count_disconnected_and_abandoned_requests(server):
    server.wait_for(lambda: not server.worker.busy and server.worker.waiting == 0, what="an idle server")
    before = metrics(server)
    a = RawClient(server.port)
    a.send(request_bytes("POST", "/v1/chat/completions",
                         chat_body("Story", stream=True, max_tokens=3000, ignore_eos=True)))
    ra = a.read_head()
    a.read_events(ra, stop_after=3)
    b = RawClient(server.port)  # queued behind a
    b.send(request_bytes("POST", "/v1/chat/completions", chat_body("Next", stream=True, max_tokens=5)))
    rb = b.read_head()
    assert rb.status == 200
    b.read_events(rb, stop_after=1)
    server.wait_for(lambda: server.worker.waiting == 1, what="b to queue")
    b.close()   # gone while queued
    server.wait_for(lambda: server.worker.waiting == 0, what="b to leave the line")
    a.close()   # gone mid-stream
    server.wait_for(lambda: not server.worker.busy, what="a's generation to stop")
    deadline = time.monotonic() + 10
    while True:
        after = metrics(server)
        n499 = requests_with(after, "/v1/chat/completions", "499") - requests_with(before, "/v1/chat/completions", "499")
        if n499 >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert n499 == 2
    key = ("kestrel_queue_abandoned_total", ())
    assert after[key] - before[key] == 1
    assert after[("kestrel_cancelled_total", ())] - before[("kestrel_cancelled_total", ())] == 1


# ---- images: 2 (bounded by the queue, stopped when the client leaves), 5 (FIFO), 6 (NUL) -------------------

def big_png(mode: str, size: int = 8000) -> bytes:
    from PIL import Image
    buf = io.BytesIO()
    Image.new(mode, (size, size), 1 if mode == "1" else (40, 90, 200, 255)[:len(mode)]).save(buf, "PNG")
    return buf.getvalue()


def image_chat(*urls: str, **extra) -> dict:
    parts = [{"type": "text", "text": "Describe."}] + [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    body = {"model": "tiny", "messages": [{"role": "user", "content": parts}], "max_tokens": 2}
    body.update(extra)
    return body


def data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return cached_qwen3_vl(tmp_path_factory)


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("robust-images")
    os.mkfifo(d / "fifo.png")
    (d / "one-bit.png").write_bytes(big_png("1"))
    return d


@pytest.fixture(scope="module")
def vl_server(vl_dir, image_dir):
    with LiveServer(vl_dir, queue=0, ctx=4096, image_dirs=(str(image_dir),)) as s:
        yield s


def test_fifo_and_nul_paths_are_400_at_once(vl_server, image_dir):
    for path, words in [(f"{image_dir}/fifo.png", "not a regular file"),
                        (f"file://{image_dir}/a\x00b.png", "NUL byte")]:
        t = time.monotonic()
        r, payload = post(vl_server, image_chat(path), timeout=10)
        assert r.status == 400, payload
        err = json.loads(payload)["error"]
        assert err["code"] == "invalid_image" and words in err["message"]
        assert time.monotonic() - t < 5


def test_four_8000x8000_pngs_with_no_queue(vl_server):
    """--queue 0, four concurrent requests with an 8000x8000 RGBA PNG each while a stream runs: the three that
    find the engine busy get 429 before any pixel is decoded; the loop never stalls; RSS stays in budget."""
    png = big_png("RGBA")
    body = json.dumps(image_chat(data_uri(png))).encode()
    before = metrics(vl_server)
    decoded_before = before[("kestrel_images_decoded_total", ())]
    bg = BackgroundStream(vl_server, max_tokens=3000)
    try:
        q0 = loop_now(vl_server)
        time.sleep(1.5)
        q1 = loop_now(vl_server)
        results = []
        with PeakRss() as mem:
            threads = [threading.Thread(target=lambda: results.append(post(vl_server, body))) for _ in range(4)]
            t0, a0 = time.perf_counter(), loop_now(vl_server)
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            t1, a1 = time.perf_counter(), loop_now(vl_server)
        m = metrics(vl_server)
        quiet = bg.gaps_between(0, t0)
        gaps = bg.gaps_between(t0, t1)
    finally:
        bg.close()
    assert sorted(r.status for r, _ in results) == [429] * 4
    assert max(t1 - t0, 0) < 5
    assert m.get(("kestrel_images_decoded_total", ()), 0) == decoded_before
    assert_loop_responsive(vl_server, (q0, q1), (a0, a1))
    if len(gaps) > 1:
        assert_gaps_normal(quiet, gaps)
    assert mem.growth < 100 * 2**20, f"RSS grew {mem.growth / 2**20:.0f} MB"


def test_image_decoding_is_serialized_bounded_and_stops_when_the_client_leaves(vl_server, image_dir):
    """Admitted requests decode one image at a time server-wide (peak RSS in budget: one 8000x8000 decode);
    a request with 12 such images whose client leaves stops decoding at the next image boundary; memory goes
    back after the burst."""
    path = f"{image_dir}/one-bit.png"
    body = request_bytes("POST", "/v1/chat/completions", image_chat(*[path] * 12))
    with PeakRss() as mem:
        c = RawClient(vl_server.port)
        c.send(body)
        vl_server.wait_for(lambda: metrics(vl_server).get(("kestrel_images_decoded_total", ()), 0) >= 1,
                           what="the first image to be decoded")
        c.close()
        left = metrics(vl_server)[("kestrel_images_decoded_total", ())]
        vl_server.wait_for(lambda: vl_server.worker.waiting == 0 and not vl_server.worker.busy, what="idle")
        time.sleep(3)
        after = metrics(vl_server)[("kestrel_images_decoded_total", ())]
    assert after - left <= 1, f"{after - left} images decoded after the client left"
    assert mem.growth < 1200 * 2**20, f"peak RSS grew {mem.growth / 2**20:.0f} MB"
    assert rss_bytes() - mem.base < 200 * 2**20, "memory stayed resident after the burst"


# ---- found by the generated requests of the system tier ------------------------------------------------------

def test_a_positive_temperature_below_float32_is_served(server):
    """temperature=1e-300 is > 0 (so not greedy) but 0 in float32: it divided by zero and answered 500."""
    for body in (chat_body("Hi", max_tokens=2, temperature=1e-300), chat_body("Hi", max_tokens=2, temperature=5e-45)):
        r, payload = post(server, body)
        assert r.status == 200, payload


def test_head_requests_get_a_head_without_a_body_and_the_connection_goes_on(server):
    """HEAD on any path was answered with a body h11 refused to frame (an unhandled error, the connection cut)."""
    c = RawClient(server.port, timeout=10)
    c.send(request_bytes("HEAD", "/metrics") + request_bytes("GET", "/health"))
    r = c.read_head()
    assert r.status == 405 and int(r.header("content-length")) > 0
    r2 = c.read_head()  # no body in between: the next response follows at once on the same connection
    assert r2.status == 200 and json.loads(c.read_body(r2))["status"] == "ok"
    c.close()
