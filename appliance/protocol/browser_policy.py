"""Where browsers may drive the appliance from: the Origin (CORS) and Host (DNS rebinding) rules, sans-I/O.

A web page the person opens elsewhere must not get completions out of the board. Two holes, two rules:

- Cross-origin requests. A page on another origin can send a "simple" request (a text/plain POST) without any
  preflight; the browser only hides the answer, the server still runs it. So a request whose `Origin` is not
  allowed is refused (403) before anything runs, and preflights are answered only for allowed origins and the
  request headers we accept (`ACCEPTED_HEADERS`, the `x-stainless-*` ones the OpenAI SDKs send); a preflight
  asking for any other header is refused. Allowed by default: the appliance's own page (an Origin equal to the
  host the request was sent to, once that host passed the Host rule) and loopback pages on any port
  (http(s)://localhost, 127.0.0.1, [::1]: Ollama's and llama-server's defaults). `--cors-origins` adds
  `scheme://host[:port|:*]` entries; `*` opens it deliberately (then `Access-Control-Allow-Origin: *`). Requests
  without an Origin (curl, SDKs, the page's own GETs) are not browsers' cross-origin requests and pass.
  `Origin: null` (sandboxed frames, file: pages) is refused unless listed.
- DNS rebinding. A page on attacker.example re-points its own name at the board; its requests are then
  same-origin for the browser (no preflight, custom headers allowed) but carry `Host: attacker.example`. So the
  Host header (port ignored) must be one the server answers to: the addresses it listens on, localhost names
  (localhost, *.localhost), loopback IP literals, and when bound to a wildcard address (0.0.0.0, ::) the
  machine's hostname (+ .local, its FQDN), its interface addresses and any private/link-local IP literal (an IP
  literal cannot be rebound: there is no name to re-point), plus `--allowed-hosts` (`*`: no Host check).
  Unlike Ollama (which checks Host only when bound to loopback) the check holds on every address.
- Behind a reverse proxy. `X-Forwarded-Host` is never a way around the Host rule: a rebinding page can set it
  itself (its requests are same-origin), so trusting it would reopen the hole; Ollama and llama-server ignore it.
  We use it for one thing only: the proxy's public name as "the host the page was served from", so the built-in
  page works behind nginx (`proxy_set_header X-Forwarded-Host $http_host`). It must itself pass the Host rule
  (`--allowed-hosts` the proxy's name), otherwise the request is refused: a proxy forwarding a Host we do not
  serve (nginx's catch-all server block reached by a rebound name) is the rebinding case again. The Host header
  nginx sends by default (the upstream address) passes as a listen address.

The API key (`--api-key`) is a separate matter (who, not where from): it does not change these rules; a page on
another origin that holds the key still needs its origin listed. Everything here is a pure function of the
policy and the request head, tested byte for byte (tests/protocol/test_browser_policy.py); the I/O side (the
listening addresses, the hostname, the interfaces) is collected by server/app.py.
"""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Mapping

ACCEPTED_HEADERS = frozenset({"accept", "accept-language", "authorization", "content-type", "x-request-id",
                              "openai-organization", "openai-project", "ollama-version",
                              "x-api-key", "anthropic-version", "anthropic-beta",
                              "anthropic-dangerous-direct-browser-access", "x-session-id"})
ACCEPTED_HEADER_PREFIXES = ("x-stainless-",)       # the OpenAI / Anthropic JS SDKs' client descriptions
ALLOW_METHODS = b"GET, HEAD, POST, DELETE, OPTIONS"
PREFLIGHT_METHODS = frozenset({"GET", "HEAD", "POST", "DELETE"})
MAX_AGE = b"600"
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
DEFAULT_PORTS = {"http": 80, "https": 443}
ANY_PORT = -1

Header = tuple[bytes, bytes]


@dataclass(frozen=True)
class OriginRule:
    scheme: str
    host: str               # lower case, IPv6 without brackets
    port: int               # ANY_PORT: every port

    def matches(self, origin: "Origin") -> bool:
        return (self.scheme == origin.scheme and self.host == origin.host
                and self.port in (ANY_PORT, origin.port))


@dataclass(frozen=True)
class Origin:
    scheme: str
    host: str
    port: int


DEFAULT_ORIGINS = tuple(OriginRule(s, h, ANY_PORT) for h in LOOPBACK_NAMES for s in ("http", "https"))


@dataclass(frozen=True)
class BrowserPolicy:
    origins: tuple[OriginRule, ...] = DEFAULT_ORIGINS
    any_origin: bool = False
    hosts: frozenset[str] = frozenset({"localhost"})   # names and IP literals (lower case, unbracketed)
    any_host: bool = False
    wildcard_bind: bool = False     # bound to 0.0.0.0 / ::: private and link-local IP literals are ours too
    extra_origins: tuple[str, ...] = field(default=(), compare=False)   # as given, for the start-up log


@dataclass(frozen=True)
class Verdict:
    """What to do with a request: go on (status 0) adding `headers` to its response, answer a preflight
    (204 with `headers`), or refuse it (403, `message`, `code`, with `headers`)."""
    status: int
    headers: tuple[Header, ...] = ()
    message: str = ""
    code: str = ""


# ---- parsing ---------------------------------------------------------------------------------------------

def split_host(value: str) -> tuple[str, int | None] | None:
    """A Host (or X-Forwarded-Host) value -> (host lower case, IPv6 unbracketed; port or None); None if
    malformed."""
    v = value.strip().lower()
    if not v or any(c in v for c in " /\\@?#"):
        return None
    if v.startswith("["):
        end = v.find("]")
        if end < 0:
            return None
        host, rest = v[1:end], v[end + 1:]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            return None
    else:
        host, sep, port_text = v.partition(":")
        rest = sep + port_text
        if ":" in port_text:
            return None
    if not rest:
        return host, None
    if not rest.startswith(":") or not rest[1:].isdigit() or not 0 < int(rest[1:]) < 65536:
        return None
    return (host, int(rest[1:])) if host else None


def parse_origin(value: str) -> Origin | None:
    """An Origin header (`scheme://host[:port]`) -> Origin with the scheme's default port; None if it is not a
    http(s) origin (`null`, file:, extensions...)."""
    scheme, sep, rest = value.strip().lower().partition("://")
    if not sep or scheme not in DEFAULT_PORTS or not rest:
        return None
    hp = split_host(rest)
    if hp is None:
        return None
    host, port = hp
    return Origin(scheme, host, DEFAULT_PORTS[scheme] if port is None else port)


def parse_origin_rules(text: str) -> tuple[tuple[OriginRule, ...], bool]:
    """`--cors-origins`: comma list of `scheme://host[:port|:*]` (or `*`) -> (rules beyond the defaults, any).
    Raises ValueError naming the entry that is not an origin."""
    rules: list[OriginRule] = []
    any_origin = False
    for entry in (e.strip() for e in text.split(",")):
        if not entry:
            continue
        if entry == "*":
            any_origin = True
            continue
        wild = entry.endswith(":*")
        o = parse_origin(entry[:-2] if wild else entry)
        if o is None or entry.rstrip("/") != entry:
            raise ValueError(f"--cors-origins: {entry!r} is not an origin (scheme://host[:port], "
                             f"scheme://host:* or *)")
        rules.append(OriginRule(o.scheme, o.host, ANY_PORT if wild else o.port))
    return tuple(rules), any_origin


def parse_host_list(text: str) -> tuple[frozenset[str], bool]:
    """`--allowed-hosts`: comma list of host names or IP literals (a port is ignored), or `*` -> (hosts, any)."""
    hosts: set[str] = set()
    any_host = False
    for entry in (e.strip() for e in text.split(",")):
        if not entry:
            continue
        if entry == "*":
            any_host = True
            continue
        hp = split_host(entry)
        if hp is None:
            raise ValueError(f"--allowed-hosts: {entry!r} is not a host name or address")
        hosts.add(hp[0])
    return frozenset(hosts), any_host


def make_policy(*, listen_hosts: tuple[str, ...], machine_names: tuple[str, ...] = (),
                cors_origins: str = "", allowed_hosts: str = "") -> BrowserPolicy:
    """The policy of a server listening on `listen_hosts` (the --host value and the bound addresses); when one is
    a wildcard address, `machine_names` (hostname, FQDN, interface addresses: collected by the caller) count."""
    rules, any_origin = parse_origin_rules(cors_origins)
    extra, any_host = parse_host_list(allowed_hosts)
    listen = {h.strip("[]").lower() for h in listen_hosts}
    wildcard = bool(listen & {"0.0.0.0", "::", ""})
    hosts = {"localhost"} | {h for h in listen if h not in ("0.0.0.0", "::", "")} | set(extra)
    if wildcard:
        for name in machine_names:
            n = name.strip("[]").lower()
            if n:
                hosts.add(n)
                if not _is_ip(n) and "." not in n:
                    hosts.add(n + ".local")
    return BrowserPolicy(origins=DEFAULT_ORIGINS + rules, any_origin=any_origin, hosts=frozenset(hosts),
                         any_host=any_host, wildcard_bind=wildcard,
                         extra_origins=tuple(e.strip() for e in cors_origins.split(",") if e.strip()))


# ---- the rules -------------------------------------------------------------------------------------------

def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def host_allowed(policy: BrowserPolicy, host: str) -> bool:
    if policy.any_host or host in policy.hosts or host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    if ip.is_loopback:
        return True
    return policy.wildcard_bind and (ip.is_private or ip.is_link_local)


def origin_allowed(policy: BrowserPolicy, origin: Origin, served: list[tuple[str, int | None]]) -> bool:
    """The origin is listed (defaults included), or is the host the request was sent to (`served`: the Host and
    X-Forwarded-Host values, each already allowed), the port defaulting to the origin scheme's."""
    if any(rule.matches(origin) for rule in policy.origins):
        return True
    return any(origin.host == host and origin.port == (DEFAULT_PORTS[origin.scheme] if port is None else port)
               for host, port in served)


def header_accepted(name: str) -> bool:
    return name in ACCEPTED_HEADERS or name.startswith(ACCEPTED_HEADER_PREFIXES)


def _refuse(message: str, code: str) -> Verdict:
    return Verdict(403, (), message, code)


def decide(policy: BrowserPolicy, method: str, headers: Mapping[str, str]) -> Verdict:
    """The verdict on one request head (`headers`: lower-case names). Order: Host, X-Forwarded-Host, Origin,
    then (OPTIONS with Access-Control-Request-Method) the preflight."""
    served: list[tuple[str, int | None]] = []
    for name in ("host", "x-forwarded-host"):
        value = headers.get(name)
        if value is None:
            continue
        hp = split_host(value.split(",")[0])    # a chain of proxies: the first is the one the browser used
        if hp is None:
            return _refuse(f"Malformed {name.title()} header.", "forbidden_host")
        if not host_allowed(policy, hp[0]):
            return _refuse(f"Host {hp[0]!r} is not one this server answers to; start it with --allowed-hosts "
                           f"{hp[0]} to allow it.", "forbidden_host")
        served.append(hp)

    vary: tuple[Header, ...] = () if policy.any_origin else ((b"Vary", b"Origin"),)
    raw_origin = headers.get("origin")
    if raw_origin is None:
        cors: tuple[Header, ...] = ((b"Access-Control-Allow-Origin", b"*"),) if policy.any_origin else vary
    else:
        origin = parse_origin(raw_origin)
        if policy.any_origin:
            cors = ((b"Access-Control-Allow-Origin", b"*"),)
        elif origin is not None and origin_allowed(policy, origin, served):
            cors = ((b"Access-Control-Allow-Origin", raw_origin.strip().encode("latin-1")),) + vary
        else:
            return _refuse(f"Origin {raw_origin.strip()!r} is not allowed; start the server with --cors-origins "
                           f"{raw_origin.strip()} to allow it.", "forbidden_origin")

    asked_method = headers.get("access-control-request-method")
    if method != "OPTIONS" or raw_origin is None or asked_method is None:
        return Verdict(0, cors)
    if asked_method.strip().upper() not in PREFLIGHT_METHODS:
        return _refuse(f"Method {asked_method.strip()!r} is not allowed.", "forbidden_method")
    asked = [h.strip().lower() for h in (headers.get("access-control-request-headers") or "").split(",")]
    asked = [h for h in asked if h]
    refused = [h for h in asked if not header_accepted(h)]
    if refused:
        return _refuse(f"Request header {refused[0]!r} is not accepted.", "forbidden_header")
    out = cors + ((b"Access-Control-Allow-Methods", ALLOW_METHODS),)
    if asked:
        out += ((b"Access-Control-Allow-Headers", ", ".join(asked).encode("latin-1")),)
    return Verdict(204, out + ((b"Access-Control-Max-Age", MAX_AGE),))
