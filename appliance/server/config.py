"""The server's settings (from the CLI's flags) and the shape of a route table every API module exports."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Awaitable, Callable

from ..h11_server import Exchange

Handler = Callable[[Exchange], Awaitable[None]]
Routes = dict[str, dict[str, Handler]]     # path -> method -> handler (methods in the order Allow lists them)


@dataclass
class ApiConfig:
    model_name: str = "model"
    api_keys: tuple[str, ...] = ()
    extension_events: bool = False     # metrics/tokens events on every stream unless the request says no
    queue_keepalive_s: float = 5.0     # SSE comment interval while a stream waits in the queue
    cors_origins: str = ""             # --cors-origins: origins beyond the defaults (protocol/browser_policy.py)
    allowed_hosts: str = ""            # --allowed-hosts: Host names beyond the listening addresses
    listen_host: str = "127.0.0.1"     # --host: what the Host rule counts as ours
    image_dirs: tuple[str, ...] = ()   # local image files allowed from these directories (none: data URIs only)
    web: bool = True                   # the chat page at / (for browsers) and /chat/ (--no-web turns it off)
