"""appliance.systemd speaks the sd_notify datagram protocol to a real AF_UNIX socket, as systemd listens."""
from __future__ import annotations

import os
import socket
import sys

import pytest

from appliance import resources, systemd


@pytest.fixture
def notify_socket(tmp_path, monkeypatch):
    path = str(tmp_path / "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(2)
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    yield sock
    sock.close()


def test_ready_watchdog_stopping_reach_the_socket(notify_socket):
    assert systemd.notify_ready("serving tiny") is True
    msg = notify_socket.recv(4096).decode()
    assert msg.split("\n") == ["READY=1", "STATUS=serving tiny"]  # no MAINPID: the main process stays put
    assert systemd.notify_watchdog() is True
    assert notify_socket.recv(4096) == b"WATCHDOG=1"
    assert systemd.notify_stopping() is True
    assert notify_socket.recv(4096) == b"STOPPING=1"


def test_abstract_socket_address(monkeypatch):
    name = f"kestrel-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(2)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert systemd.notify_watchdog() is True
        assert sock.recv(64) == b"WATCHDOG=1"


def test_without_systemd_everything_is_a_quiet_no_op(monkeypatch, tmp_path):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert systemd.notify_ready() is False
    monkeypatch.setenv("NOTIFY_SOCKET", "relative/not-a-socket")
    assert systemd.notify_watchdog() is False
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "nobody-listens"))
    assert systemd.notify_stopping() is False  # dropped, never raised


def test_watchdog_interval_is_half_of_watchdog_usec(monkeypatch):
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    assert systemd.watchdog_interval() is None
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    assert systemd.watchdog_interval() == 15.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert systemd.watchdog_interval() == 15.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))  # the watchdog is meant for another process
    assert systemd.watchdog_interval() is None
    monkeypatch.setenv("WATCHDOG_PID", str(os.getppid()))  # from source: the parent is not ours
    assert systemd.watchdog_interval() is None
    monkeypatch.setattr(sys, "frozen", True, raising=False)  # one-file: the parent is the bootloader, main PID
    monkeypatch.setattr(sys, "_MEIPASS", "/nonexistent", raising=False)
    assert systemd.watchdog_interval() == 15.0
    monkeypatch.setenv("WATCHDOG_USEC", "garbage")
    assert systemd.watchdog_interval() is None


def test_resources_from_source_tree_and_frozen_layout(monkeypatch, tmp_path):
    import appliance

    assert not resources.is_frozen()
    assert resources.resource_path("systemd.py") == os.path.abspath(systemd.__file__)
    assert resources.find_resource("no-such-file") is None
    assert os.path.dirname(appliance.__file__) == resources.package_dir()
    monkeypatch.setattr(sys, "frozen", True, raising=False)
    monkeypatch.setattr(sys, "_MEIPASS", str(tmp_path), raising=False)
    assert resources.is_frozen()
    (tmp_path / "appliance" / "native").mkdir(parents=True)
    (tmp_path / "appliance" / "native" / "lib.so").write_bytes(b"")
    assert resources.find_resource("native", "lib.so") == str(tmp_path / "appliance" / "native" / "lib.so")
