"""The chat page as HTTP: who gets it at / and /chat/, its headers (CSP by hash), its size, /props, the API key
and --no-web. The page's behaviour in a real browser is tests/system/test_web_chat.py."""
from __future__ import annotations

import base64
import hashlib
import json
import re

import pytest

from appliance import web
from appliance.cli import build_parser
from tests.support.live_server import LiveServer, RawClient, request_bytes

KEY = "sk-web-test"
BROWSER_ACCEPT = "text/html,application/xhtml+xml,application/xml;q=0.9,image/avif,image/webp,*/*;q=0.8"


@pytest.fixture(scope="module")
def server(tiny_qwen3_tied):
    with LiveServer(tiny_qwen3_tied, api_keys=(KEY,)) as s:
        yield s


def get(server, path, headers=None):
    c = RawClient(server.port)
    c.send(request_bytes("GET", path, headers=headers))
    r = c.read_head()
    body = c.read_body(r)
    c.close()
    return r, body


def sha256(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


@pytest.mark.parametrize("path,accept", [("/", BROWSER_ACCEPT), ("/", "text/html"), ("/chat/", None),
                                         ("/chat", "*/*")])
def test_the_page_is_served_without_a_key(server, path, accept):
    r, body = get(server, path, {"Accept": accept} if accept else None)
    assert r.status == 200, body
    assert r.header("content-type") == "text/html; charset=utf-8"
    assert len(body) < 100 * 1024                     # the budget for the whole page
    html = body.decode()
    assert html.startswith("<!doctype html>") and "/*SCRIPT*/" not in html and "/*STYLE*/" not in html
    # nothing is fetched from elsewhere: no external URL in any src/href, every API path is relative
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html)
    assert "fetch(" in html and "v1/chat/completions" in html
    # the CSP allows exactly the inlined script and stylesheet
    csp = r.header("content-security-policy")
    scripts = re.findall(r"<script>(.*?)</script>", html, re.S)
    styles = re.findall(r"<style>(.*?)</style>", html, re.S)
    assert len(scripts) == 1 and len(styles) == 1
    assert f"script-src {sha256(scripts[0])};" in csp and f"style-src {sha256(styles[0])};" in csp
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert r.header("x-content-type-options") == "nosniff"


@pytest.mark.parametrize("accept", [None, "*/*", "application/json", "text/html;q=0"])
def test_root_is_not_the_page_for_api_clients(server, accept):
    r, body = get(server, "/", {"Accept": accept} if accept else None)
    assert r.status == 200 and body == b"Ollama is running"             # the probe Ollama clients send


def test_accept_negotiation():
    assert web.wants_html(BROWSER_ACCEPT) and web.wants_html("TEXT/HTML") and web.wants_html("application/xhtml+xml")
    assert not web.wants_html(None) and not web.wants_html("*/*") and not web.wants_html("text/html; q=0")
    assert not web.wants_html("text/plain, application/json")
    for malformed in ("text/html;q=.", "text/html;q=1.2.3", "text/html;q=x"):   # a malformed q is no weight
        assert web.wants_html(malformed)


def test_a_malformed_accept_gets_an_answer_not_a_500(server):
    r, body = get(server, "/", {"Accept": "text/html;q=."})
    assert r.status == 200 and body.startswith(b"<!doctype html>")


def test_props_needs_the_key_and_describes_the_model(server):
    r, body = get(server, "/props")
    assert r.status == 401
    r, body = get(server, "/props", {"Authorization": f"Bearer {KEY}"})
    assert r.status == 200
    props = json.loads(body)
    assert props["model_alias"] == server.api_cfg.model_name and props["total_slots"] == 1
    assert props["default_generation_settings"]["n_ctx"] == server.worker.loaded.context_length
    assert props["modalities"] == {"vision": False, "audio": False} and "image" not in props
    assert props["thinking_toggle"] is True and "enable_thinking" in props["chat_template"]
    assert props["build_info"].startswith("kestrel-appliance ")


def test_props_of_a_vision_model(tmp_path_factory):
    from tests.support.tiny_vl import cached_qwen3_vl
    with LiveServer(cached_qwen3_vl(tmp_path_factory)) as s:
        r, body = get(s, "/props")
        proc = s.worker.loaded.model.image_processor
    props = json.loads(body)
    assert props["modalities"]["vision"] is True
    assert props["image"] == {"min_pixels": proc.min_pixels, "max_pixels": proc.max_pixels, "pixels_per_token": 1024}


def test_no_web_turns_the_page_off(tiny_qwen3_tied):
    assert build_parser().parse_args(["--model", "m", "--no-web"]).no_web
    assert not build_parser().parse_args(["--model", "m"]).no_web
    s = LiveServer(tiny_qwen3_tied)
    s.api_cfg.web = False
    with s:
        for path in ("/chat/", "/chat"):
            r, _ = get(s, path, {"Accept": "text/html"})
            assert r.status == 404
        assert get(s, "/", {"Accept": BROWSER_ACCEPT})[1] == b"Ollama is running"
        assert get(s, "/health")[0].status == 200 and get(s, "/props")[0].status == 200


def test_inlined_text_may_not_close_its_element():
    with pytest.raises(ValueError):
        web.ChatPage("<style>/*STYLE*/</style><script>/*SCRIPT*/</script>", "", "x = '</script>';")
    page = web.ChatPage("<style>/*STYLE*/</style><script>/*SCRIPT*/</script>", "b{}", "x = 1;")
    assert page.body == b"<style>b{}</style><script>x = 1;</script>"
