"""systemd service notifications (sd_notify) over $NOTIFY_SOCKET with a plain datagram socket.

Policy: every call is a no-op returning False when the process is not run by systemd with Type=notify
(no $NOTIFY_SOCKET), so the server calls these unconditionally. Sending never blocks and never raises: a
notification that cannot be delivered is dropped (systemd then acts on the missing READY/WATCHDOG, which
is the right signal). The watchdog interval is half of $WATCHDOG_USEC, as sd_watchdog_enabled() advises.

The one-file executable runs Python in a child of the PyInstaller bootloader, and the bootloader is the
service's main process: notifications come from that child (the unit says NotifyAccess=all), READY does not
claim MAINPID (systemd keeps signalling the bootloader, which forwards SIGTERM once), and a WATCHDOG_PID naming
the bootloader counts as ours.

Server side, the whole API:
    notify_ready()            once the model is loaded and the socket listens
    watchdog_interval()       seconds between pings, or None when the unit has no WatchdogSec=
    notify_watchdog()         every watchdog_interval() seconds, from a task that proves the loop is alive
                              (before the loop runs, the busy responder's thread pings: notify_address())
    notify_stopping()         when shutdown begins (SIGTERM)
"""
from __future__ import annotations

import os
import socket

from . import resources


def _address() -> str | None:
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr or addr[0] not in "/@":
        return None
    return "\0" + addr[1:] if addr[0] == "@" else addr  # '@' marks a Linux abstract socket


def notify_address() -> bytes | None:
    """$NOTIFY_SOCKET as a sendto address (a leading NUL for an abstract one), None when there is none: for
    the busy responder's native watchdog (h11_server.busy_watchdog)."""
    addr = _address()
    return None if addr is None else os.fsencode(addr)


def notify(state: str) -> bool:
    """Send one sd_notify message (e.g. "READY=1\\nSTATUS=serving"); True when it was handed to systemd."""
    addr = _address()
    if addr is None:
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.setblocking(False)
            sock.sendto(state.encode("utf-8"), addr)
        return True
    except OSError:
        return False


def notify_ready(status: str = "") -> bool:
    return notify("READY=1" + (f"\nSTATUS={status}" if status else ""))


def notify_watchdog() -> bool:
    return notify("WATCHDOG=1")


def notify_stopping(status: str = "") -> bool:
    return notify("STOPPING=1" + (f"\nSTATUS={status}" if status else ""))


def watchdog_interval() -> float | None:
    """Seconds between WATCHDOG=1 pings (half the unit's WatchdogSec), or None when no watchdog is armed."""
    try:
        usec = int(os.environ.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    pid = os.environ.get("WATCHDOG_PID")
    ours = {str(os.getpid())} | ({str(os.getppid())} if resources.is_frozen() else set())
    if usec <= 0 or (pid and pid not in ours):
        return None
    return usec / 2e6
