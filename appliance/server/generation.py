"""One generation request from admission to the last byte (`run_ticket`: admitted, its images decoded, dropped on
a failure before it runs, entered, run): the path shared by stream and non-stream, chat and text completions,
every API. The bytes and bodies come from the protocol's assemblers; this module decides when they are written.

Policies:
- A request takes its place in line (Preparer.admit: 429 when full) before its images are decoded; a failure
  while decoding drops the ticket (counted as abandoned unless it was the request's own fault, an ApiError), and
  the context is checked again with the images' tokens.
- Each event is written with its own socket write the moment the engine's event crosses into trio; nothing
  is batched (the closing events, which exist together, are still written one by one).
- Waiting in line and in prefill: a stream gets its assembler's keep-alive (an SSE comment; an empty NDJSON
  line for Ollama) every `queue_keepalive_s` until its first token event; the comment writer runs beside the
  wait (cancelling the wait itself would lose the place in the FIFO line), shares a lock with the event writes, and each of its writes is shielded so a cancel never
  leaves half a comment on the wire.
- Engine failures: before a stream starts, an error response (400 for ContextLengthError, else 500); inside a
  stream, the assembler's error event (`{"error": ...}`: the openai and ollama clients raise it) and the stream
  ends.
- Shutdown: a request still queued when the queue closes gets 503 `server_shutdown` (a stream: that error
  event, then the end of the body); a stream the server cuts past the grace period gets the same event
  (`Exchange.stream_error`), written by the server.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence, Union

import trio

from ..engine.generate import FinishEvent, GenerationRequest, TokenEvent
from ..engine.kv_cache import ContextLengthError
from ..protocol.errors import ApiError, internal_error, server_shutdown, wrong_model_kind
from ..protocol.logprobs import entry_from_engine
from ..protocol.sse import JSON_CONTENT_TYPE, json_bytes
from ..protocol.stats import GenerationStats
from .images import image_urls
from .worker import EngineFailure, ShuttingDown, Ticket

if TYPE_CHECKING:
    from ..engine.constraint import CompiledGrammar
    from ..engine.load import LoadedModel
    from ..engine.qwen3_vl import PixelPatches
    from ..h11_server import Exchange
    from ..protocol import Assembler, Phase
    from ..protocol.requests import ChatRequest, CompletionRequest
    from .preparer import Preparer

    Request = Union[ChatRequest, CompletionRequest]  # what every API's body becomes

log = logging.getLogger("appliance.generation")


class Generation:
    """`assembler`: the API's protocol assembler (start/token/keepalive/finish/response/error_event);
    `token_bytes`: the tokenizer's id -> bytes (logprobs);
    `keepalive_s`: the interval of the assembler's keep-alive while queued or in prefill."""

    def __init__(self, prompt_ids: list[int], req: Request, assembler: Assembler, *,
                 token_bytes: Callable[[int], bytes], keepalive_s: float,
                 images: tuple[PixelPatches, ...] = (), constraint: CompiledGrammar | None = None):
        self.req = req
        self.prompt_ids = prompt_ids
        self.out = assembler
        self._token_bytes = token_bytes
        self._keepalive_s = keepalive_s
        self._phase: Phase = "queued"
        self._send_lock = trio.Lock()
        self._keepalive_scope = trio.CancelScope()
        self.request = GenerationRequest(prompt_ids=prompt_ids, sampling=req.sampling, max_tokens=req.max_tokens,
                                         stop=tuple(req.stop), ignore_eos=req.ignore_eos, images=tuple(images),
                                         constraint=constraint)

    def _logprob(self, ev: TokenEvent):
        return entry_from_engine(ev.logprob, self._token_bytes) if ev.logprob is not None else None

    async def run(self, ex: Exchange, ticket: Ticket, t_arrival: float | None = None) -> None:
        stream = self.req.stream
        t_arrival = time.perf_counter() if t_arrival is None else t_arrival
        ex.notes["prompt_tokens"] = len(self.prompt_ids)
        async with ticket:
            async with trio.open_nursery() as nursery:
                if stream:
                    await ex.start_stream(200, list(self.out.stream_headers))
                    ex.stream_error = self.out.error_event
                    for event in self.out.start():
                        await self._send(ex, event)
                    nursery.start_soon(self._keepalive, ex)
                finish: FinishEvent | None = None
                failure: BaseException | None = None
                try:
                    await ticket.wait_turn()
                except ShuttingDown:
                    failure = server_shutdown()
                else:
                    self._phase = "prefill"
                    finish, failure = await self._generate(ex, ticket)
                    # until the engine thread took the job: its turn, then the previous job's after-request work
                    trace = ticket.trace
                    assert trace is not None  # the job ran
                    queue_ms = ex.notes["queue_ms"] = (trace.started - t_arrival) * 1000.0
                ticket.finished()
                self._keepalive_scope.cancel()
        if finish is None:
            return await self._fail(ex, failure)
        stats = GenerationStats.from_finish(finish, queue_ms)
        ex.notes.update(prompt_tokens=stats.prompt_tokens, cached_tokens=stats.cached_tokens,
                        completion_tokens=stats.completion_tokens, ttft_ms=stats.ttft_ms, tok_s=stats.tok_s,
                        finish=finish.reason)  # the request's access-log line (h11_server)
        if not stream:
            body = self.out.response(finish.reason, finish.text, stats, completion_ids=finish.token_ids)
            return await ex.respond(200, [(b"Content-Type", JSON_CONTENT_TYPE)], json_bytes(body))
        for event in self.out.finish(finish.reason, finish.text, stats, self.prompt_ids, finish.token_ids):
            await ex.send(event)
        await ex.end_stream()

    async def _generate(self, ex: Exchange, ticket: Ticket) -> tuple[FinishEvent | None, BaseException | None]:
        """Run the request on the engine, writing each token event of a stream as it arrives."""
        async for ev in ticket.start(self.request):
            if isinstance(ev, TokenEvent):
                data = self.out.token(ev.text, self._logprob(ev))
                if self.req.stream and data:
                    self._keepalive_scope.cancel()
                    await self._send(ex, data)
            elif isinstance(ev, FinishEvent):
                return ev, None
            elif isinstance(ev, EngineFailure):
                return None, ev.error
        return None, None

    async def _send(self, ex: Exchange, data: bytes) -> None:
        async with self._send_lock:
            await ex.send(data)

    async def _keepalive(self, ex: Exchange) -> None:
        """The assembler's keep-alive every queue_keepalive_s until the first event after the opening one: while
        queued and during a long prefill (SSE: `: queued` / `: prefill` comments), so proxies and clients with
        read timeouts stay."""
        with self._keepalive_scope:
            while True:
                await trio.sleep(self._keepalive_s)
                with trio.CancelScope(shield=True):  # never half a comment on the wire
                    await self._send(ex, self.out.keepalive(self._phase))

    async def _fail(self, ex: Exchange, error: BaseException | None) -> None:
        if isinstance(error, ApiError):
            err = error
        elif isinstance(error, ContextLengthError):
            err = ApiError(400, str(error), param="messages", code="context_length_exceeded")
        else:
            log.error("generation failed: %r", error, exc_info=error)
            err = internal_error()
        ex.notes["error"] = err.message
        if not ex.response_started:
            raise err
        async with self._send_lock:
            await ex.send(self.out.error_event(err))
            await ex.end_stream()


async def run_ticket(prep: Preparer, ex: Exchange, loaded: LoadedModel, req: Request, ids: list[int],
                     out: Assembler, *, body_size: int = 0, constraint: CompiledGrammar | None = None,
                     messages: Sequence[dict[str, Any]] = (),
                     on_prompt: Callable[[list[int]], None] | None = None) -> None:
    """A prepared request (any API's) through admission, the images of its chat `messages` (none for a text
    completion), and the engine (`constraint`: its compiled output format, from Preparer.compile_constraint;
    `on_prompt`: told the prompt's final ids, image tokens expanded, before the stream opens)."""
    t_arrival = time.perf_counter()
    if loaded.kind != "generate":  # an embedding model or a reranker (server/embeddings.py serves those)
        raise wrong_model_kind(loaded.kind, prep.model_name, "generate")
    ticket = prep.admit()
    urls = image_urls(messages)
    if urls:
        try:
            ids, images = await prep.images(loaded, ex, urls, ids, body_size)
            prep.check_context(loaded, len(ids), req.max_tokens)
        except BaseException as e:
            ticket.drop(abandoned=not isinstance(e, ApiError))
            raise
    else:
        images = ()
    if on_prompt is not None:
        on_prompt(ids)
    gen = Generation(ids, req, out, token_bytes=loaded.tokenizer.token_bytes,
                     keepalive_s=prep.cfg.queue_keepalive_s, images=images, constraint=constraint)
    await gen.run(ex, ticket, t_arrival)
