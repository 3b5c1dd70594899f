"""The busy responder (native/busy_responder.py) on a plain listening socket nobody else accepts on: a connection
that waits past the grace is answered with the fixed response and closed, requests with a body too, a thread
holding the GIL does not delay it; stop() joins it and counts what it answered. GilBoundSections waits for the
watched connections to end (bounded)."""
from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from appliance.native import busy_responder as br

RESPONSE = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: 2\r\n"
            b"Connection: close\r\n\r\n{}")

pytestmark = pytest.mark.skipif(br._library() is None, reason="native library not built")


def listening() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    s.setblocking(False)  # as trio's listeners are
    return s


def exchange(port: int, data: bytes) -> tuple[bytes, float]:
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
        c.sendall(data)
        got = b""
        while chunk := c.recv(4096):
            got += chunk
    return got, time.monotonic() - t0


def test_answers_waiting_connections_and_counts_them():
    s = listening()
    r = br.BusyResponder(grace_s=0.05)
    try:
        assert r.start([s.fileno()], RESPONSE)
        got, _ = exchange(s.getsockname()[1], b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert got == RESPONSE
        body = b"x" * 100_000  # a body is read away, so the close does not reset the answer
        got, _ = exchange(s.getsockname()[1], b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                          b"Content-Length: %d\r\n\r\n" % len(body) + body)
        assert got == RESPONSE
    finally:
        assert r.stop() == 2
        s.close()
    assert not r.running and r.stop() == 0


def test_answers_while_this_thread_holds_the_gil():
    s = listening()
    r = br.BusyResponder(grace_s=0.05)
    shuffled = [(i * 7919) % 1_000_003 for i in range(3_000_000)]
    try:
        assert r.start([s.fileno()], RESPONSE)
        with socket.create_connection(s.getsockname(), timeout=10) as c:
            c.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            t0 = time.monotonic()
            shuffled.sort()  # one C call holding the GIL, well past the grace
            held = time.monotonic() - t0
            got = c.recv(4096, socket.MSG_DONTWAIT)  # already there: answered while the GIL was held
        assert held > 0.2 and got == RESPONSE, (held, got)
    finally:
        r.stop()
        s.close()


def test_gil_bound_section_waits_for_open_connections_within_drain():
    sections = br.GilBoundSections()
    open_now = [1]
    sections.watch(lambda: open_now[0])
    threading.Timer(0.1, lambda: open_now.__setitem__(0, 0)).start()
    t0 = time.monotonic()
    with sections.section("test"):
        assert sections.active == 1
        waited = time.monotonic() - t0
    assert 0.09 < waited < sections.DRAIN_S + 0.2 and sections.active == 0
    open_now[0] = 5  # never drains: the section starts anyway after DRAIN_S
    t0 = time.monotonic()
    with sections.section("stuck"):
        assert time.monotonic() - t0 >= sections.DRAIN_S
    sections.watch(None)
    t0 = time.monotonic()
    with sections.section("unwatched"):
        assert time.monotonic() - t0 < 0.05


@pytest.mark.parametrize("abstract", [False, True])
def test_watchdog_pings_from_the_thread_while_this_one_holds_the_gil(tmp_path, abstract):
    """WATCHDOG=1 datagrams to the notify socket (a path or an abstract name) while the GIL is held; off returns
    the count sent, and no ping comes after it."""
    name = ("\0kestrel-test-%d" % os.getpid()) if abstract else str(tmp_path / "notify")
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(name)
    s = listening()
    r = br.BusyResponder(grace_s=0.05)
    shuffled = [(i * 7919) % 1_000_003 for i in range(3_000_000)]
    try:
        r.watchdog(os.fsencode(name), 0.02)
        assert r.start([s.fileno()], RESPONSE)
        t0 = time.monotonic()
        shuffled.sort()  # one C call holding the GIL
        held = time.monotonic() - t0
        got = []
        notify.setblocking(False)
        while True:
            try:
                got.append(notify.recv(64))
            except BlockingIOError:
                break
        sent = r.watchdog(None)
        assert held > 0.2 and set(got) == {b"WATCHDOG=1"}, (held, got)
        assert len(got) >= 3 and sent >= len(got), (held, len(got), sent)
        time.sleep(0.1)
        with pytest.raises(BlockingIOError):
            notify.recv(64)
    finally:
        r.stop()
        s.close()
        notify.close()


def test_watchdog_refuses_an_address_too_long():
    with pytest.raises(OSError):
        br.BusyResponder().watchdog(b"/" + b"x" * 200, 0.1)
