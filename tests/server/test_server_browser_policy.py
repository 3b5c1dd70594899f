"""The browser policy over a real socket (protocol/browser_policy.py wired in server/app.py): hostile Origin and
Host values are refused before anything runs, preflights only for allowed origins and headers, with and without
--api-key, and the CLI flags. The same rules in a real browser: tests/system/test_browser_origins.py."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.live_server import LiveServer, RawClient, chat_body, request_bytes

EVIL = "http://evil.example"


@pytest.fixture(scope="module")
def server(tiny_qwen3_tied):
    with LiveServer(tiny_qwen3_tied, cors_origins="https://ui.example") as s:
        yield s


def send(server, method, path, body=None, headers=None):
    c = RawClient(server.port, timeout=30)
    try:
        c.send(request_bytes(method, path, body, headers))
        r = c.read_head()
        return r, c.read_body(r)
    finally:
        c.close()


def generations(server) -> int:
    return sum(server.worker.stats.finish_reasons.values())


def test_text_plain_post_from_an_evil_origin_is_refused_before_it_runs(server):
    before = generations(server)
    raw = json.dumps(chat_body(max_tokens=4)).encode()
    r, b = send(server, "POST", "/v1/chat/completions", raw, {"Content-Type": "text/plain", "Origin": EVIL})
    assert r.status == 403 and r.header("Access-Control-Allow-Origin") is None
    err = json.loads(b)["error"]
    assert err["code"] == "forbidden_origin" and err["type"] == "permission_error"
    assert "--cors-origins" in err["message"]
    # Ollama's API, Ollama's error shape; the Responses API; the legacy completions
    r, b = send(server, "POST", "/api/generate", {"model": "tiny", "prompt": "hi"}, {"Origin": EVIL})
    assert r.status == 403 and set(json.loads(b)) == {"error"}
    for path in ("/v1/completions", "/v1/responses"):
        r, _ = send(server, "POST", path, {"model": "tiny", "prompt": "hi", "input": "hi"}, {"Origin": EVIL})
        assert r.status == 403, path
    r, _ = send(server, "GET", "/v1/models", headers={"Origin": "null"})
    assert r.status == 403
    assert generations(server) == before


def test_allowed_origins_get_their_origin_back(server):
    for origin in ("http://localhost:5173", "http://127.0.0.1:9999", "https://ui.example"):
        r, b = send(server, "POST", "/v1/chat/completions", chat_body(max_tokens=2), {"Origin": origin})
        assert r.status == 200, (origin, b)
        assert r.header("Access-Control-Allow-Origin") == origin and r.header("Vary") == "Origin"
    # the page served by this server, reached by the address it listens on
    own = f"http://127.0.0.1:{server.port}"
    r, _ = send(server, "GET", "/v1/models", headers={"Origin": own, "Host": f"127.0.0.1:{server.port}"})
    assert r.status == 200 and r.header("Access-Control-Allow-Origin") == own
    # streams and errors carry the same headers
    r, _ = send(server, "POST", "/v1/chat/completions", chat_body(max_tokens=2, stream=True),
                {"Origin": "https://ui.example"})
    assert r.header("Content-Type").startswith("text/event-stream")
    assert r.header("Access-Control-Allow-Origin") == "https://ui.example"
    r, _ = send(server, "POST", "/v1/chat/completions", {"messages": 5}, {"Origin": "https://ui.example"})
    assert r.status == 400 and r.header("Access-Control-Allow-Origin") == "https://ui.example"


def test_dns_rebinding_hosts_are_refused(server):
    before = generations(server)
    for host in ("attacker.example", f"attacker.example:{server.port}", "192.168.1.50", "8.8.8.8:80"):
        for extra in ({}, {"Origin": f"http://{host}"}, {"X-Forwarded-Host": "localhost"}):
            r, b = send(server, "POST", "/v1/chat/completions", chat_body(max_tokens=4), {"Host": host, **extra})
            assert r.status == 403, (host, extra)
            assert json.loads(b)["error"]["code"] == "forbidden_host"
    r, _ = send(server, "GET", "/health", headers={"Host": "attacker.example"})
    assert r.status == 403
    r, _ = send(server, "GET", "/", headers={"Host": "attacker.example", "Accept": "text/html"})
    assert r.status == 403
    assert generations(server) == before
    for host in ("localhost", f"localhost:{server.port}", f"[::1]:{server.port}", "127.0.0.1"):
        r, _ = send(server, "GET", "/health", headers={"Host": host})
        assert r.status == 200, host


def test_preflights(server):
    ask = {"Origin": "https://ui.example", "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "content-type,authorization,x-stainless-arch"}
    r, b = send(server, "OPTIONS", "/v1/chat/completions", headers=ask)
    assert r.status == 204 and b == b""
    assert r.header("Access-Control-Allow-Origin") == "https://ui.example"
    assert r.header("Access-Control-Allow-Headers") == "content-type, authorization, x-stainless-arch"
    r, _ = send(server, "OPTIONS", "/v1/chat/completions", headers={**ask, "Origin": EVIL})
    assert r.status == 403 and r.header("Access-Control-Allow-Origin") is None
    r, _ = send(server, "OPTIONS", "/v1/chat/completions",
                headers={**ask, "Access-Control-Request-Headers": "content-type, x-custom-thing"})
    assert r.status == 403 and r.header("Access-Control-Allow-Headers") is None
    assert r.header("Access-Control-Allow-Origin") is None
    # not a preflight: a plain OPTIONS says what the path allows
    r, _ = send(server, "OPTIONS", "/v1/chat/completions")
    assert r.status == 204 and r.header("Allow") == "POST, OPTIONS"


def test_with_an_api_key_the_rules_are_the_same(tiny_qwen3_tied):
    key = {"Authorization": "Bearer k3y"}
    with LiveServer(tiny_qwen3_tied, api_keys=("k3y",)) as s:
        r, _ = send(s, "POST", "/v1/chat/completions", chat_body(max_tokens=2), {**key, "Origin": EVIL})
        assert r.status == 403
        r, _ = send(s, "POST", "/v1/chat/completions", chat_body(max_tokens=2), {**key, "Host": "attacker.example"})
        assert r.status == 403
        r, _ = send(s, "POST", "/v1/chat/completions", chat_body(max_tokens=2), {**key, "Origin": "http://localhost"})
        assert r.status == 200
        r, _ = send(s, "OPTIONS", "/v1/chat/completions", headers={
            "Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization"})
        assert r.status == 204   # a preflight carries no key


def test_star_opens_origins_not_hosts(tiny_qwen3_tied):
    with LiveServer(tiny_qwen3_tied, cors_origins="*", allowed_hosts="kestrel.example") as s:
        r, _ = send(s, "POST", "/v1/chat/completions", chat_body(max_tokens=2), {"Origin": EVIL})
        assert r.status == 200 and r.header("Access-Control-Allow-Origin") == "*"
        r, _ = send(s, "GET", "/health", headers={"Host": "kestrel.example:443"})
        assert r.status == 200
        r, _ = send(s, "GET", "/health", headers={"Host": "attacker.example"})
        assert r.status == 403


@pytest.mark.parametrize("flag, value, says", [
    ("--cors-origins", "evil.example", "--cors-origins: 'evil.example' is not an origin"),
    ("--allowed-hosts", "a/b", "--allowed-hosts: 'a/b' is not a host name or address"),
])
def test_malformed_flags_exit_2(tiny_qwen3_tied, flag, value, says):
    p = subprocess.run([sys.executable, "-m", "appliance", "--model", tiny_qwen3_tied, flag, value],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and says in p.stderr and "Traceback" not in p.stderr
