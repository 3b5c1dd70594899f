"""The application: routes, auth, CORS, the OpenAI generation endpoints (the Ollama API is ollama_api.py, the
Responses API responses_api.py).

Policies:
- Order of checks: route (404/405) -> API key (401; /health, /v1/models, /, /api/version and CORS preflights
  stay open) -> model loaded (503) -> body (413) -> fields (400) -> template + tokenizer + context (400) -> queue (429)
  -> images (400/413). Everything but the images is answered before the request takes a place in line;
  images are decoded only by a request that holds one (so a full queue turns image requests away before
  any pixel is decoded), one image at a time server-wide, stopping between images when the client leaves.
- Parsing, template rendering, tokenization and image decoding run in worker threads (offload.off_loop),
  never on the event loop, and tokenization releases the GIL. A prompt proven to be longer than the context
  (by its bytes, or by the tokens of a prefix: engine/token_bounds.py) is refused after tokenizing about a
  context's worth of it, so a 4 MB body costs neither seconds of tokenizer work nor its memory.
- /metrics counts every request with the status it ended with (Exchange.outcome, recorded once the last byte is
  written, so a client closing right after reading is not "gone"): one that ends because its client left before
  is counted with code 499 (nginx's "client closed request"); a queued request that never ran is also in
  kestrel_queue_abandoned_total.
- A stream's status line, SSE headers and first event (the chat role frame) go out before queueing and
  prefill; while queued it gets SSE comments; then one event per TokenEvent that releases text, the finish
  chunk (with timings), the usage chunk if asked, the extension events if asked, and `data: [DONE]`.
- Stream and non-stream share one generation path (Generation below); only the framing differs.
- The `model` field is not checked: the appliance serves one model and names it in every response.
- Errors are OpenAI's error JSON, except under /api/ (Ollama's `{"error": "..."}`).
- Keys are compared with hmac.compare_digest against every configured key (no early exit on the first match).
"""
from __future__ import annotations

import hmac
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import trio

from .engine.constraint import GrammarError, think_mode
from .engine.grammar_probe import prepared_constraint
from .engine.image_processing import ImageError
from .engine.token_bounds import TooManyTokens
from . import web
from .generation import Generation
from .h11_server import Exchange
from .ollama_api import OllamaApi, is_ollama_path
from .responses_api import ResponsesApi
from .image_inputs import ImageBytesLimit, ImageTokensOverContext, InvalidImage, image_urls, prepare_images
from .offload import IMAGE_THREADS, PREP_THREADS, TRIM_BYTES, LoopLag, off_loop, trim_memory
from .protocol import prometheus
from .protocol.assemble import ChatAssembler, CompletionAssembler
from .protocol.chunks import model_list
from .protocol.ollama_stream import error_body as ollama_error_body
from .protocol.generic_tools import generic_tool_request
from .protocol.errors import (ApiError, body_too_large, context_length_exceeded, error_body, invalid_api_key,
                              method_not_allowed, missing_api_key, not_found, not_ready, queue_full,
                              server_shutdown)
from .protocol.reasoning import prompt_ends_in_reasoning
from .protocol.requests import parse_chat_request, parse_completion_request
from .protocol.sse import JSON_CONTENT_TYPE, json_bytes
from .worker import NotReady, QueueFull, ShuttingDown, Worker


@dataclass
class ApiConfig:
    model_name: str = "model"
    api_keys: tuple[str, ...] = ()
    extension_events: bool = False     # metrics/tokens events on every stream unless the request says no
    queue_keepalive_s: float = 5.0     # SSE comment interval while a stream waits in the queue
    cors_origin: str = "*"
    image_dirs: tuple[str, ...] = ()   # local image files allowed from these directories (none: data URIs only)
    web: bool = True                   # the chat page at / (for browsers) and /chat/ (--no-web turns it off)


OPEN_PATHS = {"/health", "/v1/models", "/", "/api/version", "/chat"}
CORS_METHODS = b"GET, HEAD, POST, DELETE, OPTIONS"
CORS_DEFAULT_HEADERS = b"Authorization, Content-Type"


class Api:
    def __init__(self, worker: Worker, cfg: ApiConfig):
        self.worker = worker
        self.cfg = cfg
        self.created = int(time.time())
        self.requests: Counter = Counter()          # (endpoint, status) -> count
        self.rejected = 0
        self.images_decoded = 0
        self.loop_lag = LoopLag()   # run by whoever runs the server (cli.serve): `nursery.start_soon(api.loop_lag.run)`
        self._prep_limiter = trio.CapacityLimiter(PREP_THREADS)
        self._image_limiter = trio.CapacityLimiter(IMAGE_THREADS)
        self._keys = tuple(k.encode("utf-8") for k in cfg.api_keys)
        self.routes: dict[str, dict[str, Callable[[Exchange], Awaitable[None]]]] = {
            "/health": {"GET": self.health},
            "/metrics": {"GET": self.metrics},
            "/v1/models": {"GET": self.models},
            "/v1/chat/completions": {"POST": self.chat},
            "/v1/completions": {"POST": self.completions},
            "/props": {"GET": self.props},
        }
        # GET / for a browser (Accept: text/html): the chat page's handler, when one is installed; otherwise
        # (and for every other client) / answers Ollama's plain-text probe.
        self.html_root: Callable[[Exchange], Awaitable[None]] | None = None
        self.ollama = OllamaApi(self)
        self.responses = ResponsesApi(self)
        if cfg.web:  # the chat page (appliance/web)
            self.html_root = self.page
            self.routes["/chat"] = {"GET": self.page}

    # ---- dispatch --------------------------------------------------------------------------------------
    async def __call__(self, ex: Exchange) -> None:
        path = ex.path.rstrip("/") or "/"
        endpoint = path if path in self.routes else "/v1/models/{id}" if path.startswith("/v1/models/") else "other"
        try:
            handlers = self.routes.get(path)
            if handlers is None and path.startswith("/v1/models/"):
                handlers = {"GET": self.model_info}
            if handlers is None:
                raise not_found(ex.path)
            if ex.method == "OPTIONS":
                return await ex.respond(204, self._preflight_headers(ex) + self.cors_headers(), b"")
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
            body = ollama_error_body(e) if is_ollama_path(path) else error_body(e)
            await ex.respond(e.status, [(b"Content-Type", JSON_CONTENT_TYPE)] + list(e.headers) + self.cors_headers(),
                             body)
        finally:  # what it really ended with: sent whole, client gone (499), cut by shutdown, or a failure (500)
            self.requests[(endpoint, ex.outcome)] += 1

    async def send_json(self, ex: Exchange, obj: Any, status: int = 200) -> None:
        await ex.respond(status, [(b"Content-Type", JSON_CONTENT_TYPE)] + self.cors_headers(), json_bytes(obj))

    def cors_headers(self) -> list[tuple[bytes, bytes]]:
        return [(b"Access-Control-Allow-Origin", self.cfg.cors_origin.encode("latin-1"))]

    def _preflight_headers(self, ex: Exchange) -> list[tuple[bytes, bytes]]:
        asked = ex.header("access-control-request-headers")
        return [(b"Access-Control-Allow-Methods", CORS_METHODS),
                (b"Access-Control-Allow-Headers", asked.encode("latin-1") if asked else CORS_DEFAULT_HEADERS),
                (b"Access-Control-Max-Age", b"86400")]

    def _check_key(self, ex: Exchange) -> None:
        if not self._keys:
            return
        auth = ex.header("authorization")
        if not auth:
            raise missing_api_key()
        scheme, _, token = auth.strip().partition(" ")
        given = token.strip().encode("latin-1", "replace") if scheme.lower() == "bearer" else b""
        ok = False
        for key in self._keys:
            ok |= hmac.compare_digest(given, key)
        if not ok:
            raise invalid_api_key()

    def loaded(self) -> Any:
        if self.worker.state != "ready":
            raise not_ready()
        return self.worker.loaded

    # ---- simple endpoints ------------------------------------------------------------------------------
    async def page(self, ex: Exchange) -> None:
        page = web.chat_page()
        await ex.respond(200, page.headers, page.body)

    async def props(self, ex: Exchange) -> None:
        from .version import version
        loaded = self.worker.loaded if self.worker.state == "ready" else None
        await self.send_json(ex, web.props(self.cfg.model_name, loaded, f"kestrel-appliance {version()}"))

    async def health(self, ex: Exchange) -> None:
        w = self.worker
        if w.state == "ready":
            body = {"status": "ok", "model": self.cfg.model_name, "queue_depth": w.waiting, "busy": w.busy,
                    "queue_limit": w.queue_limit}
            return await self.send_json(ex, body)
        body = {"status": "loading" if w.state == "loading" else "unavailable"}
        await ex.respond(503, [(b"Content-Type", JSON_CONTENT_TYPE), (b"Retry-After", b"1")]
                         + self.cors_headers(), json_bytes(body))

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
            "kestrel_prefill_seconds_total": s.prefill_seconds,
            "kestrel_decode_seconds_total": s.decode_seconds,
            "kestrel_rejected_total": self.rejected,
            "kestrel_cancelled_total": s.requests_cancelled,
            "kestrel_queue_abandoned_total": s.requests_abandoned,
            "kestrel_images_decoded_total": self.images_decoded,
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
        await ex.respond(200, [(b"Content-Type", prometheus.CONTENT_TYPE)] + self.cors_headers(),
                         prometheus.render_metrics(self.metric_values(ex.open_connections)))

    # ---- generation endpoints --------------------------------------------------------------------------
    async def chat(self, ex: Exchange) -> None:
        loaded = self.loaded()
        body = await ex.read_body()
        req, prompt, ids, constraint = await off_loop(lambda stop: self._prepare_chat(loaded, body),
                                                      self._prep_limiter)
        out = ChatAssembler.for_request(req, model=self.cfg.model_name, created=int(time.time()),
                                        in_reasoning=prompt_ends_in_reasoning(prompt))
        await self.generate_chat(ex, loaded, req, ids, out, len(body), constraint)

    async def prepare(self, fn: Callable[[], Any]) -> Any:
        """Run a request's preparation (parsing, template, tokenizer) in a worker thread, off the event loop."""
        return await off_loop(lambda stop: fn(), self._prep_limiter)

    async def generate_chat(self, ex: Exchange, loaded: Any, req: Any, ids: list[int], out: Any,
                            body_size: int, constraint: Any = None) -> None:
        """A prepared chat-shaped request (any API's) through admission, its images, and the engine
        (`constraint`: its compiled output format, from compile_constraint)."""
        t_arrival = time.perf_counter()
        ticket = self.admit()
        urls = image_urls(req.messages)
        if urls:
            try:
                ids, images = await self._images(loaded, ex, urls, ids, body_size)
                self.check_context(loaded, len(ids), req.max_tokens)
            except BaseException as e:
                ticket.drop(abandoned=not isinstance(e, ApiError))
                raise
        else:
            images = ()
        await self._generation(loaded, ids, req, out, images, constraint).run(ex, ticket, t_arrival)

    def _generation(self, loaded: Any, ids: list[int], req: Any, out: Any, images: tuple = (),
                    constraint: Any = None) -> Generation:
        return Generation(ids, req, out, token_bytes=loaded.tokenizer.token_bytes, headers=self.cors_headers(),
                          keepalive_s=self.cfg.queue_keepalive_s, images=images, constraint=constraint)

    def _prepare_chat(self, loaded: Any, body: bytes):
        """Worker thread: body -> (request, prompt text, prompt ids, constraint); ApiError for anything wrong."""
        req = parse_chat_request(body, defaults=loaded.default_sampling, context_length=loaded.context_length,
                                 images_supported=loaded.multimodal, stream_extensions=self.cfg.extension_events)
        req = self.fit_tools(loaded, req)
        prompt, ids = self.render_prompt(loaded, req, len(body))
        param = "tools" if req.tool_choice in ("required", "function") or req.tool_format == "generic" \
            else "response_format"
        return req, prompt, ids, self.compile_constraint(loaded, req, prompt, param)

    def fit_tools(self, loaded: Any, req: Any) -> Any:
        """A ChatRequest as the model's template can take its tools: unchanged when the template renders tools,
        else in the generic tool format (protocol/generic_tools.py)."""
        if getattr(loaded.chat_template, "renders_tools", True):
            return req
        return generic_tool_request(req)

    def compile_constraint(self, loaded: Any, req: Any, prompt: str, param: str) -> Any:
        """Worker thread: the compiled constraint of a ChatRequest's output_format (None: unconstrained), letting
        a thinking model think first when its thinking is on; a grammar llguidance refuses, built or in its first
        steps (grammar_probe), is a 400 on the part it names (else `param`) with its reason. Bounded by
        llguidance's limits and the probe's budget; the tokenizer's table it needs (3.4 s for Qwen3's
        151,936 tokens on the shared x86 test machine, bench/RESULTS.md) was built while the model loaded."""
        if req.output_format is None:
            return None
        think = think_mode(loaded.tokenizer, prompt_ends_in_reasoning(prompt), req.enable_thinking)
        try:
            return prepared_constraint(req.output_format, loaded.tokenizer, loaded.engine.model.config.vocab_size,
                                       loaded.eos_ids, think)
        except GrammarError as e:
            part = e.part or param
            raise ApiError(400, f"Invalid schema for '{part}': {e}", param=part, code="invalid_schema") from None

    def render_prompt(self, loaded: Any, req: Any, body_size: int, check: bool = True) -> tuple[str, list[int]]:
        """Worker thread: a ChatRequest's prompt text and ids (the context is checked here unless the request
        has images, whose tokens are counted after decoding, or the caller checks it itself)."""
        try:
            prompt = loaded.chat_template.render(req.messages, tools=req.tools, add_generation_prompt=True,
                                                 **req.template_kwargs)
        except ValueError as e:  # ChatTemplateError: the template refused these messages
            raise ApiError(400, str(e), param="messages", code="invalid_messages") from None
        ids = self.encode(loaded, prompt, req.max_tokens, body_size)
        if check and not image_urls(req.messages):
            self.check_context(loaded, len(ids), req.max_tokens)
        return prompt, ids

    async def completions(self, ex: Exchange) -> None:
        loaded = self.loaded()
        body = await ex.read_body()
        req, ids, prompt_text = await off_loop(lambda stop: self._prepare_completion(loaded, body),
                                               self._prep_limiter)
        out = CompletionAssembler.for_request(req, model=self.cfg.model_name, created=int(time.time()),
                                              echo_text=prompt_text)
        t_arrival = time.perf_counter()
        await self._generation(loaded, ids, req, out).run(ex, self.admit(), t_arrival)

    def _prepare_completion(self, loaded: Any, body: bytes):
        """Worker thread: body -> (request, prompt ids, prompt text to echo)."""
        req = parse_completion_request(body, defaults=loaded.default_sampling,
                                       context_length=loaded.context_length,
                                       stream_extensions=self.cfg.extension_events)
        if isinstance(req.prompt, str):
            ids = self.encode(loaded, req.prompt, req.max_tokens, len(body))
            prompt_text = req.prompt
        else:
            ids = self.check_token_ids(loaded, req.prompt, "prompt")
            prompt_text = loaded.tokenizer.decode(ids, skip_special_tokens=False) if req.echo else ""
        self.check_context(loaded, len(ids), req.max_tokens)
        return req, ids, prompt_text

    def encode(self, loaded: Any, text: str, max_tokens: int | None, body_size: int) -> list[int]:
        """Token ids of text; a text proven to need the whole context or more is refused (400) after tokenizing
        about a context's worth of it (its bytes alone, or a prefix: engine/token_bounds.py)."""
        try:
            return loaded.tokenizer.encode_within(text, loaded.context_length)
        except TooManyTokens as e:
            raise context_length_exceeded(e.at_least, max_tokens, loaded.context_length, at_least=True) from None
        finally:
            if body_size >= TRIM_BYTES:
                trim_memory()

    async def _images(self, loaded: Any, ex: Exchange, urls: list, ids: list[int], body_size: int):
        """Decode and preprocess the request's images off the event loop (one request's images at a time,
        server-wide); expand their prompt tokens. Stops between images when the client leaves."""
        model = loaded.model

        def work(stop: threading.Event):
            try:
                return prepare_images(model.image_processor, model.image_token_id, ids, urls,
                                      allowed_dirs=self.cfg.image_dirs, body_size=body_size, body_limit=ex.max_body,
                                      max_tokens=loaded.context_length, should_stop=stop.is_set,
                                      on_decoded=self._count_image)
            finally:
                trim_memory()
        try:
            return await off_loop(work, self._image_limiter)
        except ImageBytesLimit as e:
            raise body_too_large(e.limit) from None
        except ImageTokensOverContext as e:
            raise ApiError(400, f"This model's maximum context length is {e.limit} tokens; {e}.", param="messages",
                           code="context_length_exceeded") from None
        except ImageError as e:  # param: the top field the client sent it in (messages, input, images)
            param = e.where.partition("[")[0] if isinstance(e, InvalidImage) else "messages"
            raise ApiError(400, str(e), param=param, code="invalid_image") from None

    def _count_image(self) -> None:  # image threads run one at a time (IMAGE_THREADS)
        self.images_decoded += 1

    def check_token_ids(self, loaded: Any, ids: Any, param: str) -> list[int]:
        """Token ids a client sent (non-negative, checked by the parser) as a list; 400 on `param` for one past
        the vocabulary."""
        vocab = len(loaded.tokenizer)
        bad = next((t for t in ids if t >= vocab), None)
        if bad is not None:
            raise ApiError(400, f"Invalid '{param}': token id {bad} is out of range (vocabulary size {vocab}).",
                           param=param, code="invalid_value")
        return list(ids)

    def check_context(self, loaded: Any, n_prompt: int, max_tokens: int | None) -> None:
        ctx = loaded.context_length
        if n_prompt == 0:
            raise ApiError(400, "The prompt is empty.", param="messages", code="invalid_value")
        if n_prompt >= ctx or (max_tokens is not None and n_prompt + max_tokens > ctx):
            raise context_length_exceeded(n_prompt, max_tokens, ctx)

    def admit(self):
        try:
            return self.worker.admit()
        except QueueFull as e:
            raise queue_full(e.retry_after) from None
        except NotReady:
            raise not_ready() from None
        except ShuttingDown:
            raise server_shutdown() from None
