"""The browser policy (protocol/browser_policy.py) byte for byte: which Host and Origin values pass, the CORS
headers each request gets, and how preflights are answered."""
from __future__ import annotations

import pytest

from appliance.protocol.browser_policy import (
    ANY_PORT,
    DEFAULT_ORIGINS,
    OriginRule,
    decide,
    make_policy,
    parse_host_list,
    parse_origin,
    parse_origin_rules,
    split_host,
)

LOCAL = make_policy(listen_hosts=("127.0.0.1",))
VARY = (b"Vary", b"Origin")


def acao(origin: str) -> tuple[bytes, bytes]:
    return (b"Access-Control-Allow-Origin", origin.encode())


@pytest.mark.parametrize("value, expected", [
    ("127.0.0.1", ("127.0.0.1", None)), ("LocalHost:8080", ("localhost", 8080)), ("[::1]:80", ("::1", 80)),
    ("[::1]", ("::1", None)), ("board.lan:65535", ("board.lan", 65535)),
    ("", None), ("a:b", None), ("a:0", None), ("a:70000", None), ("::1", None), ("[zz]:1", None),
    ("[::1", None), ("a b", None), ("evil.example/x", None), ("user@host", None), (":80", None),
])
def test_split_host(value, expected):
    assert split_host(value) == expected


def test_parse_origin():
    o = parse_origin("HTTPS://Board.Example")
    assert (o.scheme, o.host, o.port) == ("https", "board.example", 443)
    o = parse_origin("http://[::1]:5173")
    assert (o.scheme, o.host, o.port) == ("http", "::1", 5173)
    for bad in ("null", "file://", "chrome-extension://abc", "http://", "http://a:b", "ftp://x"):
        assert parse_origin(bad) is None, bad


def test_flag_parsing():
    rules, any_origin = parse_origin_rules("https://ui.example, http://dev.example:*,http://x.example:3000")
    assert not any_origin and rules == (OriginRule("https", "ui.example", 443), OriginRule("http", "dev.example", ANY_PORT),
                                        OriginRule("http", "x.example", 3000))
    assert parse_origin_rules("*") == ((), True)
    for bad in ("ui.example", "https://ui.example/", "null", "https://a.example:x"):
        with pytest.raises(ValueError, match="--cors-origins"):
            parse_origin_rules(bad)
    assert parse_host_list("Board.Lan, kestrel.example:443") == (frozenset({"board.lan", "kestrel.example"}), False)
    assert parse_host_list("*") == (frozenset(), True)
    with pytest.raises(ValueError, match="--allowed-hosts"):
        parse_host_list("a/b")


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.1:8080", "localhost:8080", "[::1]:8080", "127.9.9.9",
                                  "app.localhost", "LOCALHOST"])
def test_loopback_hosts_pass(host):
    assert decide(LOCAL, "GET", {"host": host}).status == 0


@pytest.mark.parametrize("host", ["attacker.example", "attacker.example:8080", "192.168.1.5", "10.0.0.1:80",
                                  "localhost.attacker.example", "8.8.8.8", "x"])
def test_foreign_hosts_are_refused_on_loopback(host):
    v = decide(LOCAL, "GET", {"host": host})
    assert v.status == 403 and v.code == "forbidden_host" and v.headers == ()


def test_malformed_host_is_refused():
    v = decide(LOCAL, "GET", {"host": "a b"})
    assert (v.status, v.code, v.message) == (403, "forbidden_host", "Malformed Host header.")


def test_wildcard_bind_allows_machine_names_and_private_literals():
    p = make_policy(listen_hosts=("0.0.0.0",), machine_names=("rk3588", "rk3588.lan", "203.0.113.7"))
    for host in ("rk3588:8080", "rk3588.local", "rk3588.lan", "203.0.113.7", "192.168.1.5:8080", "10.1.2.3",
                 "[fe80::1]", "[fd00::5]", "localhost"):
        assert decide(p, "GET", {"host": host}).status == 0, host
    for host in ("attacker.example", "8.8.8.8", "rk3588.attacker.example"):
        assert decide(p, "GET", {"host": host}).status == 403, host
    # a specific LAN address: that address, not the rest of the LAN
    p = make_policy(listen_hosts=("192.168.1.5",))
    assert decide(p, "GET", {"host": "192.168.1.5:8080"}).status == 0
    assert decide(p, "GET", {"host": "192.168.1.6:8080"}).status == 403


def test_allowed_hosts_flag():
    p = make_policy(listen_hosts=("127.0.0.1",), allowed_hosts="kestrel.example")
    assert decide(p, "GET", {"host": "kestrel.example"}).status == 0
    assert decide(p, "GET", {"host": "other.example"}).status == 403
    p = make_policy(listen_hosts=("127.0.0.1",), allowed_hosts="*")
    assert decide(p, "GET", {"host": "other.example"}).status == 0


def test_no_origin_passes_with_vary_only():
    assert decide(LOCAL, "POST", {"host": "127.0.0.1:8080"}).headers == (VARY,)
    assert decide(LOCAL, "POST", {}).status == 0   # HTTP/1.0 without Host: not a browser


@pytest.mark.parametrize("origin", ["http://localhost:5173", "http://127.0.0.1", "https://localhost",
                                    "http://[::1]:3000", "http://127.0.0.1:8080"])
def test_loopback_origins_are_echoed(origin):
    v = decide(LOCAL, "POST", {"host": "127.0.0.1:8080", "origin": origin})
    assert v == decide(LOCAL, "POST", {"host": "127.0.0.1:8080", "origin": origin})
    assert (v.status, v.headers) == (0, (acao(origin), VARY))


@pytest.mark.parametrize("origin", ["http://evil.example", "https://evil.example:8080", "null",
                                    "http://localhost.evil.example", "http://127.0.0.1.evil.example",
                                    "file://", "chrome-extension://abcdef"])
def test_foreign_origins_are_refused(origin):
    v = decide(LOCAL, "POST", {"host": "127.0.0.1:8080", "origin": origin, "content-type": "text/plain"})
    assert (v.status, v.code, v.headers) == (403, "forbidden_origin", ())
    assert v.message == (f"Origin {origin!r} is not allowed; start the server with --cors-origins {origin} to "
                         f"allow it.")


def test_the_page_served_from_the_host_itself():
    p = make_policy(listen_hosts=("0.0.0.0",), machine_names=("rk3588",))
    v = decide(p, "POST", {"host": "192.168.1.5:8080", "origin": "http://192.168.1.5:8080"})
    assert v.headers == (acao("http://192.168.1.5:8080"), VARY)
    v = decide(p, "POST", {"host": "rk3588:8080", "origin": "http://rk3588:8080"})
    assert v.status == 0
    # same host, another port: another origin
    assert decide(p, "POST", {"host": "rk3588:8080", "origin": "http://rk3588:9000"}).status == 403
    # no port in Host: the origin scheme's default port
    assert decide(p, "POST", {"host": "rk3588", "origin": "http://rk3588"}).status == 0
    assert decide(p, "POST", {"host": "rk3588", "origin": "http://rk3588:81"}).status == 403


def test_dns_rebinding_is_refused_even_with_a_forged_forwarded_host():
    # the rebinding page's own requests: Host and Origin are the attacker's name; it may add any header
    h = {"host": "attacker.example:8080", "origin": "http://attacker.example:8080", "x-forwarded-host": "localhost"}
    assert decide(LOCAL, "POST", h).code == "forbidden_host"


def test_forwarded_host_behind_a_proxy():
    p = make_policy(listen_hosts=("127.0.0.1",), allowed_hosts="kestrel.example")
    page = {"host": "127.0.0.1:8080", "x-forwarded-host": "kestrel.example", "origin": "https://kestrel.example"}
    assert decide(p, "POST", page).headers == (acao("https://kestrel.example"), VARY)
    # a proxy forwarding a name we do not serve (a rebound name reaching its catch-all server): refused
    rebound = {"host": "127.0.0.1:8080", "x-forwarded-host": "attacker.example",
               "origin": "http://attacker.example"}
    assert decide(p, "POST", rebound).code == "forbidden_host"
    # without --allowed-hosts the proxy's name is not ours either
    assert decide(LOCAL, "POST", page).code == "forbidden_host"
    # a cross-origin page through the proxy: the forwarded host is fine, the origin is not
    cross = dict(page, origin="https://evil.example")
    assert decide(p, "POST", cross).code == "forbidden_origin"


def test_cors_origins_flag_and_star():
    p = make_policy(listen_hosts=("127.0.0.1",), cors_origins="https://ui.example,http://dev.example:*")
    assert p.origins[:len(DEFAULT_ORIGINS)] == DEFAULT_ORIGINS
    assert decide(p, "POST", {"origin": "https://ui.example"}).headers == (acao("https://ui.example"), VARY)
    assert decide(p, "POST", {"origin": "http://dev.example:1234"}).status == 0
    assert decide(p, "POST", {"origin": "http://ui.example"}).status == 403
    star = make_policy(listen_hosts=("127.0.0.1",), cors_origins="*")
    for h in ({}, {"origin": "http://evil.example"}, {"origin": "null"}):
        assert decide(star, "POST", h).headers == ((b"Access-Control-Allow-Origin", b"*"),)
    # `*` opens origins, not hosts: DNS rebinding stays refused
    assert decide(star, "POST", {"host": "attacker.example", "origin": "http://attacker.example"}).status == 403


def test_preflight_answered_for_allowed_origins_and_headers():
    h = {"host": "127.0.0.1:8080", "origin": "http://localhost:5173", "access-control-request-method": "POST",
         "access-control-request-headers": "Authorization, content-type,x-stainless-os"}
    v = decide(LOCAL, "OPTIONS", h)
    assert v.status == 204
    assert v.headers == (acao("http://localhost:5173"), VARY,
                         (b"Access-Control-Allow-Methods", b"GET, HEAD, POST, DELETE, OPTIONS"),
                         (b"Access-Control-Allow-Headers", b"authorization, content-type, x-stainless-os"),
                         (b"Access-Control-Max-Age", b"600"))
    v = decide(LOCAL, "OPTIONS", {k: v for k, v in h.items() if k != "access-control-request-headers"})
    assert [k for k, _ in v.headers] == [b"Access-Control-Allow-Origin", b"Vary", b"Access-Control-Allow-Methods",
                                         b"Access-Control-Max-Age"]


def test_preflight_refusals():
    base = {"host": "127.0.0.1:8080", "origin": "http://localhost:5173", "access-control-request-method": "POST"}
    v = decide(LOCAL, "OPTIONS", dict(base, **{"access-control-request-headers": "content-type, x-evil"}))
    assert (v.status, v.code, v.message, v.headers) == (403, "forbidden_header",
                                                         "Request header 'x-evil' is not accepted.", ())
    v = decide(LOCAL, "OPTIONS", dict(base, **{"access-control-request-method": "PUT"}))
    assert (v.status, v.code) == (403, "forbidden_method")
    v = decide(LOCAL, "OPTIONS", dict(base, origin="http://evil.example"))
    assert (v.status, v.code) == (403, "forbidden_origin")
    # OPTIONS without Access-Control-Request-Method is not a preflight
    assert decide(LOCAL, "OPTIONS", {"host": "127.0.0.1"}).status == 0
