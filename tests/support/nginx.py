"""A real nginx (the Debian package) run by a test on loopback: its own prefix directory, in the foreground, as
the user running the tests; stopped by the caller (`with Nginx(...) as n:`)."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time

NGINX = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main_config(d: str, http: str, workers: int = 1) -> str:
    """A whole nginx.conf around `http` (the directives of the http block), everything under directory d."""
    return f"""
daemon off;
worker_processes {workers};
pid {d}/nginx.pid;
error_log {d}/error.log;
{"user root;" if os.geteuid() == 0 else ""}
events {{ worker_connections 256; }}
http {{
    access_log off;
    client_body_temp_path {d}/body;
    proxy_temp_path {d}/proxy;
    fastcgi_temp_path {d}/fastcgi;
    uwsgi_temp_path {d}/uwsgi;
    scgi_temp_path {d}/scgi;
{http}
}}
"""


def check(conf_path: str, prefix: str) -> subprocess.CompletedProcess:
    """`nginx -t` on a configuration file."""
    assert NGINX, "nginx is not installed (scripts/test.sh installs the Debian package)"
    return subprocess.run([NGINX, "-t", "-c", conf_path, "-p", prefix, "-e", os.path.join(prefix, "error.log")],
                          capture_output=True, text=True, timeout=30, check=False)


class Nginx:
    """nginx on `port` with the http-level configuration `http` (written to DIR/nginx.conf)."""

    def __init__(self, d: str, http: str, port: int, workers: int = 1):
        assert NGINX, "nginx is not installed (scripts/test.sh installs the Debian package)"
        self.dir, self.port = d, port
        self.conf = os.path.join(d, "nginx.conf")
        with open(self.conf, "w") as f:
            f.write(main_config(d, http, workers))

    def __enter__(self) -> Nginx:
        cmd = [NGINX, "-c", self.conf, "-p", self.dir, "-e", os.path.join(self.dir, "error.log")]
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return self
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError(self.proc.stderr.read().decode()) from None
                if time.monotonic() > deadline:
                    self.__exit__()
                    raise RuntimeError("nginx did not start") from None
                time.sleep(0.05)

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stderr.close()

    def error_log(self) -> str:
        with open(os.path.join(self.dir, "error.log"), errors="replace") as f:
            return f.read()
