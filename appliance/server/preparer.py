"""The seam between the API modules and the rest of the server: what every API does to a request before it
queues, typed, in one place (openai.py, ollama.py and responses.py hold a Preparer, never the application).

Policies:
- Order of checks (app.py's dispatcher does the first ones): route (404/405) -> API key (401) -> model loaded
  (503, `loaded()`) -> body (413) -> fields (400) -> template + tokenizer + context (400) -> queue (429, `admit()`)
  -> images (400/413, `images()`). Everything but the images is answered before the request takes a place in
  line; images are decoded only by a request that holds one (so a full queue turns image requests away before
  any pixel is decoded), one image at a time server-wide, stopping between images when the client leaves.
- Parsing, template rendering, tokenization and image decoding run in worker threads (`prepare`, `images`:
  offload.off_loop under their limiters), never on the event loop; the methods documented "worker thread" run
  there. Tokenization releases the GIL. A prompt proven to be longer than the context (by its bytes, or by the
  tokens of a prefix: engine/token_bounds.py) is refused after tokenizing about a context's worth of it, so a
  4 MB body costs neither seconds of tokenizer work nor its memory.
- The context is checked by `check_context` (the one check every API uses; the engine's own is the last guard).
"""
from __future__ import annotations

import threading
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Sequence, TypeVar, cast

import trio

from ..engine.constraint import GrammarError, think_mode
from ..engine.grammar_probe import prepared_constraint
from ..engine.image_processing import ImageError
from ..engine.token_bounds import TooManyTokens
from ..h11_server import Exchange
from ..protocol.errors import ApiError, body_too_large, context_length_exceeded, not_ready, queue_full, server_shutdown
from ..protocol.generic_tools import generic_tool_request
from ..protocol.reasoning import prompt_ends_in_reasoning
from ..protocol.requests import ChatRequest
from ..protocol.sse import JSON_CONTENT_TYPE, json_bytes
from .config import ApiConfig
from .images import ImageBytesLimit, ImageTokensOverContext, InvalidImage, image_urls, prepare_images
from .offload import IMAGE_THREADS, PREP_THREADS, TRIM_BYTES, off_loop, trim_memory
from .worker import NotReady, QueueFull, ShuttingDown, Ticket, Worker

if TYPE_CHECKING:
    from ..engine.constraint import CompiledGrammar
    from ..engine.generate import ImageLM
    from ..engine.load import LoadedModel

T = TypeVar("T")


class Preparer:
    """Render, encode, the context check, token-id checks, the output constraint and images of one request,
    plus the model (`loaded`) and the queue (`admit`) it needs them for."""

    def __init__(self, worker: Worker, cfg: ApiConfig):
        self.worker = worker
        self.cfg = cfg
        self.images_decoded = 0
        self._prep_limiter = trio.CapacityLimiter(PREP_THREADS)
        self._image_limiter = trio.CapacityLimiter(IMAGE_THREADS)

    @property
    def model_name(self) -> str:
        return self.cfg.model_name

    def loaded(self) -> LoadedModel:
        loaded = self.worker.loaded
        if self.worker.state != "ready" or loaded is None:  # ready: loaded
            raise not_ready()
        return loaded

    def admit(self) -> Ticket:
        try:
            return self.worker.admit()
        except QueueFull as e:
            raise queue_full(e.retry_after) from None
        except NotReady:
            raise not_ready() from None
        except ShuttingDown:
            raise server_shutdown() from None

    async def prepare(self, fn: Callable[[], T]) -> T:
        """Run a request's preparation (parsing, template, tokenizer) in a worker thread, off the event loop."""
        return await off_loop(lambda stop: fn(), self._prep_limiter)

    # ---- worker thread ---------------------------------------------------------------------------------
    def fit_tools(self, loaded: LoadedModel, req: ChatRequest) -> ChatRequest:
        """A ChatRequest as the model's template can take its tools: unchanged when the template renders tools in
        Hermes JSON blocks, its calls parsed as XML when it writes them as Qwen3.5's `<function=...>` blocks (a
        forced call constrained to that form), else in the generic tool format (protocol/generic_tools.py)."""
        if not getattr(loaded.chat_template, "renders_tools", True):
            return generic_tool_request(req)
        if getattr(loaded.chat_template, "tool_format", "json") != "xml" or not req.tools:
            return req
        fmt = req.output_format
        if fmt is not None and fmt.kind == "tool_calls":
            fmt = replace(fmt, kind="xml_tool_calls")
        return replace(req, tool_format="xml", output_format=fmt)

    def compile_constraint(self, loaded: LoadedModel, req: ChatRequest, prompt: str,
                           param: str) -> CompiledGrammar | None:
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

    def render_prompt(self, loaded: LoadedModel, req: ChatRequest, body_size: int,
                      check: bool = True, continue_final: Callable[[str], str] | None = None) -> tuple[str, list[int]]:
        """Worker thread: a ChatRequest's prompt text and ids (the context is checked here unless the request
        has images, whose tokens are counted after decoding, or the caller checks it itself). `continue_final`:
        the last message is the assistant's to continue; renders it closed and returns the prompt cut open."""
        try:
            prompt = loaded.chat_template.render(req.messages, tools=req.tools,
                                                 add_generation_prompt=continue_final is None, **req.template_kwargs)
        except ValueError as e:  # ChatTemplateError: the template refused these messages
            raise ApiError(400, str(e), param="messages", code="invalid_messages") from None
        if continue_final is not None:
            prompt = continue_final(prompt)
        ids = self.encode(loaded, prompt, req.max_tokens, body_size)
        if check and not image_urls(req.messages):
            self.check_context(loaded, len(ids), req.max_tokens)
        return prompt, ids

    def encode(self, loaded: LoadedModel, text: str, max_tokens: int | None, body_size: int) -> list[int]:
        """Token ids of text; a text proven to need the whole context or more is refused (400) after tokenizing
        about a context's worth of it (its bytes alone, or a prefix: engine/token_bounds.py)."""
        try:
            return loaded.tokenizer.encode_within(text, loaded.context_length)
        except TooManyTokens as e:
            raise context_length_exceeded(e.at_least, max_tokens, loaded.context_length, at_least=True) from None
        finally:
            if body_size >= TRIM_BYTES:
                trim_memory()

    def check_token_ids(self, loaded: LoadedModel, ids: Sequence[int], param: str) -> list[int]:
        """Token ids a client sent (non-negative, checked by the parser) as a list; 400 on `param` for one past
        the vocabulary."""
        vocab = len(loaded.tokenizer)
        bad = next((t for t in ids if t >= vocab), None)
        if bad is not None:
            raise ApiError(400, f"Invalid '{param}': token id {bad} is out of range (vocabulary size {vocab}).",
                           param=param, code="invalid_value")
        return list(ids)

    def check_context(self, loaded: LoadedModel, n_prompt: int, max_tokens: int | None) -> None:
        ctx = loaded.context_length
        if n_prompt == 0:
            raise ApiError(400, "The prompt is empty.", param="messages", code="invalid_value")
        if n_prompt >= ctx or (max_tokens is not None and n_prompt + max_tokens > ctx):
            raise context_length_exceeded(n_prompt, max_tokens, ctx)

    # ---- images ----------------------------------------------------------------------------------------
    async def images(self, loaded: LoadedModel, ex: Exchange, urls: list, ids: list[int],
                     body_size: int) -> tuple[list[int], tuple]:
        """Decode and preprocess the request's images off the event loop (one request's images at a time,
        server-wide); expand their prompt tokens. Stops between images when the client leaves."""
        model = cast("ImageLM", loaded.model)  # the caller checked loaded.multimodal

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

    # ---- responses -------------------------------------------------------------------------------------
    async def send_json(self, ex: Exchange, obj: Any, status: int = 200) -> None:
        await ex.respond(status, [(b"Content-Type", JSON_CONTENT_TYPE)], json_bytes(obj))
