"""The browser policy (protocol/browser_policy.py) in a real browser: Debian's chromium driven by playwright
against the real server on a tiny real checkpoint.

Names stand in for DNS: chromium maps kestrel.test (the appliance's public name behind nginx) and evil.test
(an attacker's site, and the same name re-pointed at the board: DNS rebinding) to 127.0.0.1. The attacker's
page is served by a second HTTP server on another port, so it is another origin that is not loopback.
"""
from __future__ import annotations

import http.server
import json
import os
import socket
import subprocess
import threading
import time

import pytest

from tests.support.browser import launch
from tests.support.live_server import LiveServer

NGINX = "/usr/sbin/nginx"
RULES = "--host-resolver-rules=MAP kestrel.test 127.0.0.1, MAP evil.test 127.0.0.1"
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

EVIL_PAGE = b"""<!doctype html><title>evil</title><body>
<script>
window.attack = async (target) => {
  const out = {};
  try {  // a JSON POST: preflighted
    const r = await fetch(target + "/v1/chat/completions", {method: "POST",
      headers: {"Content-Type": "application/json"},
      body: JSON.stringify({messages: [{role: "user", content: "hi"}], max_tokens: 3})});
    out.json = "read " + r.status + " " + (await r.text());
  } catch (e) { out.json = "blocked"; }
  try {  // a simple request: no preflight, the browser only hides the answer
    const r = await fetch(target + "/v1/chat/completions", {method: "POST",
      headers: {"Content-Type": "text/plain"},
      body: JSON.stringify({messages: [{role: "user", content: "hi"}], max_tokens: 3})});
    out.plain = "read " + r.status + " " + (await r.text());
  } catch (e) { out.plain = "blocked"; }
  try {
    const r = await fetch(target + "/v1/models");
    out.models = "read " + r.status;
  } catch (e) { out.models = "blocked"; }
  return out;
};
</script></body>"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tiny_qwen3_tied):
    with LiveServer(tiny_qwen3_tied, allowed_hosts="kestrel.test") as s:
        yield s


@pytest.fixture(scope="module")
def evil_site():
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(EVIL_PAGE)))
            self.end_headers()
            self.wfile.write(EVIL_PAGE)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    yield httpd.server_address[1]
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(scope="module")
def nginx(server, tmp_path_factory):
    """nginx in front of the server as a person would put it: the public name forwarded in X-Forwarded-Host;
    /noxfh/ is the same proxy without it (the control)."""
    assert os.path.exists(NGINX), "nginx is not installed (scripts/test.sh installs the Debian package)"
    d = str(tmp_path_factory.mktemp("nginx-origins"))
    port = free_port()
    up = f"http://127.0.0.1:{server.port}"
    conf = f"""
daemon off;
worker_processes 1;
pid {d}/nginx.pid;
error_log {d}/error.log;
{"user root;" if os.geteuid() == 0 else ""}
events {{ worker_connections 64; }}
http {{
    access_log off;
    client_body_temp_path {d}/body; proxy_temp_path {d}/proxy; fastcgi_temp_path {d}/fastcgi;
    uwsgi_temp_path {d}/uwsgi; scgi_temp_path {d}/scgi;
    server {{
        listen 127.0.0.1:{port};
        location / {{ proxy_pass {up}; proxy_set_header X-Forwarded-Host $http_host; proxy_buffering off; }}
        location /noxfh/ {{ proxy_pass {up}/; }}
    }}
}}
"""
    with open(os.path.join(d, "nginx.conf"), "w") as f:
        f.write(conf)
    proc = subprocess.Popen([NGINX, "-c", os.path.join(d, "nginx.conf"), "-p", d, "-e", os.path.join(d, "error.log")],
                            stderr=subprocess.PIPE)
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, "nginx did not start"
            time.sleep(0.05)
    yield port
    proc.terminate()
    proc.wait(10)


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        b = launch(p, (RULES,))
        yield b
        b.close()


def generations(server) -> int:
    return sum(server.worker.stats.finish_reasons.values())


def chat_through_the_page(browser, url: str) -> tuple[str, list[str]]:
    """Open the built-in page at url, ask one question as a user does; (the answer's text, the Origin headers of
    the page's chat requests)."""
    ctx = browser.new_context()
    page = ctx.new_page()
    problems: list[str] = []
    origins: list[str] = []
    page.on("pageerror", lambda e: problems.append(str(e)))

    def amend(route):
        origins.append(route.request.headers.get("origin", ""))
        body = json.loads(route.request.post_data)
        route.continue_(post_data=json.dumps({**body, "max_tokens": 5, "ignore_eos": True}))

    page.route("**/v1/chat/completions", amend)
    try:
        page.goto(url)
        page.wait_for_selector("#dot.ready", timeout=30000)
        page.focus("#input")
        page.keyboard.type("Hello")
        page.keyboard.press("Enter")
        page.wait_for_selector("#log .msg.bot:last-child:not(.live)", timeout=60000)
        text = page.locator("#log .msg.bot").last.inner_text()
        assert not problems, problems
        return text, origins
    finally:
        ctx.close()


def test_a_page_from_another_origin_cannot_read_a_completion(browser, server, evil_site):
    ctx = browser.new_context()
    page = ctx.new_page()
    try:
        page.goto(f"http://evil.test:{evil_site}/")
        before = generations(server)
        out = page.evaluate("(t) => window.attack(t)", f"http://127.0.0.1:{server.port}")
        assert out == {"json": "blocked", "plain": "blocked", "models": "blocked"}, out
        out = page.evaluate("(t) => window.attack(t)", f"http://localhost:{server.port}")
        assert out == {"json": "blocked", "plain": "blocked", "models": "blocked"}, out
        time.sleep(0.5)
        assert generations(server) == before    # not even the text/plain POST ran
    finally:
        ctx.close()


def test_a_rebound_name_cannot_read_a_completion(browser, server):
    """evil.test re-pointed at the board: the page and its requests are same-origin for the browser, so only the
    Host rule stands between it and the model."""
    ctx = browser.new_context()
    page = ctx.new_page()
    try:
        r = page.goto(f"http://evil.test:{server.port}/v1/models")
        assert r.status == 403 and "forbidden_host" in page.content()
        before = generations(server)
        out = page.evaluate("""async () => {
            const r = await fetch("/v1/chat/completions", {method: "POST", headers: {"Content-Type": "text/plain",
                "X-Forwarded-Host": "localhost"}, body: JSON.stringify({messages: [{role: "user", content: "hi"}],
                max_tokens: 3})});
            return r.status + " " + (await r.text());
        }""")
        assert out.startswith("403 ") and "forbidden_host" in out and "choices" not in out
        assert generations(server) == before
    finally:
        ctx.close()


def test_the_built_in_page_still_works(browser, server):
    text, origins = chat_through_the_page(browser, f"http://127.0.0.1:{server.port}/")
    assert text.strip() and origins


def test_the_built_in_page_behind_nginx(browser, server, nginx):
    text, origins = chat_through_the_page(browser, f"http://kestrel.test:{nginx}/")
    assert text.strip()
    assert origins == [f"http://kestrel.test:{nginx}"]   # not loopback: allowed as the host the page came from
    ctx = browser.new_context()
    page = ctx.new_page()
    try:
        page.goto(f"http://kestrel.test:{nginx}/v1/models")
        # the control: the same request through a proxy that does not forward the public name is refused
        out = page.evaluate("""async () => {
            const r = await fetch("/noxfh/v1/chat/completions", {method: "POST",
                headers: {"Content-Type": "application/json"},
                body: JSON.stringify({messages: [{role: "user", content: "hi"}], max_tokens: 2})});
            return r.status + " " + (await r.text());
        }""")
        assert out.startswith("403 ") and "forbidden_origin" in out
        # a rebound name reaching nginx: forwarded as evil.test, refused
        r = page.goto(f"http://evil.test:{nginx}/")
        assert r.status == 403 and "forbidden_host" in page.content()
    finally:
        ctx.close()
