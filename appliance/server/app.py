"""The application: dispatch, the API key, CORS, /health /metrics /props /v1/models and the chat page. It builds
one Preparer (preparer.py) and takes the route tables of the API modules over it: openai.py (/v1/chat/completions,
/v1/completions), ollama.py (/api/*, the / probe), responses.py (/v1/responses), anthropic.py (/v1/messages),
embeddings.py (/v1/embeddings, /api/embed, /v1/rerank, /tokenize, /detokenize, /apply-template). Adding an
endpoint touches one API module (and its line here if it is a new module).

Policies:
- Order of checks: Host and Origin (403, protocol/browser_policy.py: DNS rebinding and cross-origin pages; every
  path, /health included) -> route (404/405) -> a CORS preflight is answered here -> API key (401; /health,
  /v1/models, /, /api/version and preflights stay open) -> the API module's (preparer.py: model loaded 503, body 413, fields, template, context 400,
  queue 429, images 400/413).
- /metrics counts every request with the status it ended with (Exchange.outcome, recorded once the last byte is
  written, so a client closing right after reading is not "gone"): one that ends because its client left before
  is counted with code 499 (nginx's "client closed request"); a queued request that never ran is also in
  kestrel_queue_abandoned_total.
- Errors are OpenAI's error JSON, except under /api/ (Ollama's `{"error": "..."}`) and /v1/messages (Anthropic's
  `{"type": "error", "error": {...}}`).
- The key: `Authorization: Bearer KEY`, or `x-api-key: KEY` (Anthropic's clients send that one).
- The browser policy is built once at start from --cors-origins, --allowed-hosts and the address we listen on
  (for a wildcard address also the machine's names and interface addresses, read here: the I/O side of it);
  its CORS headers for a request go into `Exchange.extra_headers`, so every response to it carries them.
- Keys are compared with hmac.compare_digest against every configured key (no early exit on the first match).
"""
from __future__ import annotations

import hmac
import ipaddress
import socket
import time
from collections import Counter
from typing import Any

from .. import web
from ..h11_server import Exchange
from ..protocol import prometheus
from ..protocol.anthropic_stream import error_body as anthropic_error_body
from ..protocol.browser_policy import BrowserPolicy, decide, make_policy
from ..protocol.chunks import model_list
from ..protocol.errors import ApiError, error_body, invalid_api_key, method_not_allowed, missing_api_key, not_found
from ..protocol.ollama_stream import error_body as ollama_error_body
from ..protocol.sse import JSON_CONTENT_TYPE, json_bytes
from .anthropic import AnthropicApi, is_anthropic_path
from .config import ApiConfig, Handler, Routes
from .embeddings import EmbeddingsApi
from .loop_lag import LoopLag
from .ollama import OllamaApi, is_ollama_path
from .openai import OpenAiApi
from .preparer import Preparer
from .responses import ResponsesApi
from .worker import Worker

__all__ = ["Api", "ApiConfig"]


OPEN_PATHS = {"/health", "/v1/models", "/", "/api/version", "/chat"}
WILDCARD_ADDRESSES = ("0.0.0.0", "::", "")


def machine_names() -> tuple[str, ...]:
    """The names and addresses this machine answers to: hostname, FQDN, what they resolve to, and the
    interfaces' addresses (IPv4 by SIOCGIFADDR, IPv6 from /proc/net/if_inet6)."""
    names = {socket.gethostname(), socket.getfqdn()}
    for name in list(names):
        try:
            names.update(str(ai[4][0]).split("%")[0] for ai in socket.getaddrinfo(name, None))
        except OSError:
            pass
    try:
        import fcntl
        import struct
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for _, ifname in socket.if_nameindex():
                try:
                    packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", ifname.encode()[:15]))  # SIOCGIFADDR
                    names.add(socket.inet_ntoa(packed[20:24]))
                except OSError:
                    continue
    except (ImportError, OSError):
        pass
    try:
        with open("/proc/net/if_inet6", encoding="ascii") as f:
            for line in f:
                names.add(str(ipaddress.IPv6Address(bytes.fromhex(line.split()[0]))))
    except (OSError, ValueError, IndexError):
        pass
    return tuple(sorted(n for n in names if n))


def browser_policy(cfg: ApiConfig) -> BrowserPolicy:
    """cfg's policy (ValueError for a malformed --cors-origins / --allowed-hosts entry)."""
    listen = [cfg.listen_host]
    if cfg.listen_host not in WILDCARD_ADDRESSES:
        try:
            listen += [str(ai[4][0]) for ai in socket.getaddrinfo(cfg.listen_host, None)]
        except OSError:
            pass
    wildcard = cfg.listen_host in WILDCARD_ADDRESSES
    return make_policy(listen_hosts=tuple(listen), machine_names=machine_names() if wildcard else (),
                       cors_origins=cfg.cors_origins, allowed_hosts=cfg.allowed_hosts)


LOADING_BODY = {"status": "loading", "error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}


def loading_response() -> tuple[int, tuple[tuple[bytes, bytes], ...], bytes]:
    """/health while the model loads (llama-server's body, with our "status"); also what the busy responder
    (h11_server.answer_while_busy) sends to any request the event loop cannot take in time during the load."""
    return 503, ((b"Content-Type", JSON_CONTENT_TYPE), (b"Retry-After", b"1")), json_bytes(LOADING_BODY)


class Api:
    def __init__(self, worker: Worker, cfg: ApiConfig):
        self.worker = worker
        self.cfg = cfg
        self.created = int(time.time())
        self.requests: Counter = Counter()          # (endpoint, status) -> count
        self.rejected = 0
        self.loop_lag = LoopLag()   # run by whoever runs the server (cli.serve): `nursery.start_soon(api.loop_lag.run)`
        self._keys = tuple(k.encode("utf-8") for k in cfg.api_keys)
        self.browser = browser_policy(cfg)
        self.prep = Preparer(worker, cfg)
        self.routes: Routes = {
            "/health": {"GET": self.health},
            "/metrics": {"GET": self.metrics},
            "/v1/models": {"GET": self.models},
            "/props": {"GET": self.props},
        }
        self.routes.update(OpenAiApi(self.prep).routes())
        # GET / for a browser (Accept: text/html): the chat page, when it is on; otherwise (and for every other
        # client) / answers Ollama's plain-text probe.
        html_root: Handler | None = self.page if cfg.web else None
        self.routes.update(OllamaApi(self.prep, html_root=html_root).routes())
        self.routes.update(ResponsesApi(self.prep).routes())
        self.routes.update(AnthropicApi(self.prep).routes())
        self.routes.update(EmbeddingsApi(self.prep).routes())
        if cfg.web:  # the chat page (appliance/web)
            self.routes["/chat"] = {"GET": self.page}

    # ---- dispatch --------------------------------------------------------------------------------------
    async def __call__(self, ex: Exchange) -> None:
        path = ex.path.rstrip("/") or "/"
        endpoint = path if path in self.routes else "/v1/models/{id}" if path.startswith("/v1/models/") else "other"
        ex.error_body = ollama_error_body if is_ollama_path(path) else \
            anthropic_error_body if is_anthropic_path(path) else error_body   # also the server's own 500 / 503
        try:
            verdict = decide(self.browser, ex.method, ex.headers)
            ex.extra_headers = list(verdict.headers)
            if verdict.status == 403:
                raise ApiError(403, verdict.message, code=verdict.code)
            handlers = self.routes.get(path)
            if handlers is None and path.startswith("/v1/models/"):
                handlers = {"GET": self.model_info}
            if handlers is None:
                raise not_found(ex.path)
            if ex.method == "OPTIONS":  # a preflight (answered by the policy) or a plain OPTIONS
                allow = ", ".join(tuple(handlers) + ("OPTIONS",)).encode("ascii")
                return await ex.respond(204, [] if verdict.status == 204 else [(b"Allow", allow)], b"")
            handler = handlers.get(ex.method)
            if handler is None:
                raise method_not_allowed(ex.method, path, tuple(handlers) + ("OPTIONS",))
            if path not in OPEN_PATHS and not path.startswith("/v1/models/"):
                self._check_key(ex)
            await handler(ex)
        except ApiError as e:
            if e.status == 429:
                self.rejected += 1
            ex.notes["error"] = e.message
            if ex.response_started:  # an HTTP-level error after a stream began cannot be reported
                raise
            await ex.respond(e.status, [(b"Content-Type", JSON_CONTENT_TYPE)] + list(e.headers), ex.error_body(e))
        finally:  # what it really ended with: sent whole, client gone (499), cut by shutdown, or a failure (500)
            self.requests[(endpoint, ex.outcome)] += 1

    async def send_json(self, ex: Exchange, obj: Any, status: int = 200) -> None:
        await self.prep.send_json(ex, obj, status)

    def _check_key(self, ex: Exchange) -> None:
        if not self._keys:
            return
        auth, x_key = ex.header("authorization"), ex.header("x-api-key")   # x-api-key: Anthropic's clients
        if not auth and not x_key:
            raise missing_api_key()
        scheme, _, token = (auth or "").strip().partition(" ")
        given = (token.strip() if scheme.lower() == "bearer" else (x_key or "").strip()).encode("latin-1", "replace")
        ok = False
        for key in self._keys:
            ok |= hmac.compare_digest(given, key)
        if not ok:
            raise invalid_api_key()

    # ---- simple endpoints ------------------------------------------------------------------------------
    async def page(self, ex: Exchange) -> None:
        page = web.chat_page()
        await ex.respond(200, page.headers, page.body)

    async def props(self, ex: Exchange) -> None:
        from ..version import version
        loaded = self.worker.loaded if self.worker.state == "ready" else None
        await self.send_json(ex, web.props(self.cfg.model_name, loaded, f"kestrel-appliance {version()}"))

    async def health(self, ex: Exchange) -> None:
        w = self.worker
        if w.state == "ready":
            body = {"status": "ok", "model": self.cfg.model_name, "queue_depth": w.waiting, "busy": w.busy,
                    "queue_limit": w.queue_limit}
            return await self.send_json(ex, body)
        if w.state == "loading":
            status, headers, loading = loading_response()
            return await ex.respond(status, list(headers), loading)
        await ex.respond(503, [(b"Content-Type", JSON_CONTENT_TYPE), (b"Retry-After", b"1")],
                         json_bytes({"status": "unavailable"}))

    async def models(self, ex: Exchange) -> None:
        await self.send_json(ex, model_list([self.cfg.model_name], self.created))

    async def model_info(self, ex: Exchange) -> None:
        wanted = ex.path[len("/v1/models/"):]
        if wanted != self.cfg.model_name:
            raise ApiError(404, f"The model '{wanted}' does not exist.", param="model", code="model_not_found")
        await self.send_json(ex, model_list([self.cfg.model_name], self.created)["data"][0])

    def metric_values(self, open_connections: int | None = None) -> dict[str, Any]:
        w, s = self.worker, self.worker.stats
        loaded = w.loaded
        return {
            "kestrel_requests_total": {(("endpoint", e), ("code", str(c))): n
                                       for (e, c), n in sorted(self.requests.items())},
            "kestrel_generations_total": {(("reason", r),): n for r, n in sorted(s.finish_reasons.items())},
            "kestrel_prompt_tokens_total": s.prompt_tokens,
            "kestrel_prompt_tokens_cached_total": s.cached_tokens,
            "kestrel_prompt_tokens_prefilled_total": s.prompt_tokens - s.cached_tokens,
            "kestrel_generated_tokens_total": s.completion_tokens,
            "kestrel_draft_tokens_total": s.draft_tokens,
            "kestrel_draft_tokens_accepted_total": s.draft_tokens_accepted,
            "kestrel_prefill_seconds_total": s.prefill_seconds,
            "kestrel_decode_seconds_total": s.decode_seconds,
            "kestrel_rejected_total": self.rejected,
            "kestrel_cancelled_total": s.requests_cancelled,
            "kestrel_queue_abandoned_total": s.requests_abandoned,
            "kestrel_images_decoded_total": self.prep.images_decoded,
            "kestrel_event_loop_lag_seconds": self.loop_lag.recent_s,
            "kestrel_event_loop_lag_max_seconds": self.loop_lag.max_s,
            "kestrel_event_loop_stalls_total": self.loop_lag.stalls,
            "kestrel_queue_depth": w.waiting,
            "kestrel_busy": w.busy,
            "kestrel_ready": w.state == "ready",
            "kestrel_context_length": loaded.context_length if loaded is not None else 0,
            **({} if open_connections is None else {"kestrel_open_connections": open_connections}),
        }

    async def metrics(self, ex: Exchange) -> None:
        await ex.respond(200, [(b"Content-Type", prometheus.CONTENT_TYPE)],
                         prometheus.render_metrics(self.metric_values(ex.open_connections)))
