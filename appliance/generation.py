"""One generation request from admission to the last byte: the path shared by stream and non-stream,
chat and text completions.

Policies:
- Framing is decided per event as it arrives; nothing is batched. A stream writes each event with its own
  socket write, the moment the engine's event crosses into trio.
- Chat output: text goes through a ReasoningSplitter (think blocks -> reasoning_content); one chunk per
  TokenEvent that releases text (content and reasoning_content in the same delta if one token carries both).
  Logprobs of tokens that released no text yet ride on the next chunk that does, so every token's logprob is
  sent exactly once.
- Waiting in line: a stream gets an SSE comment every `queue_keepalive_s`; the comment writer runs beside the
  wait (cancelling the wait itself would lose the place in the FIFO line) and each write is shielded so a
  cancel never leaves half an event on the wire.
- Engine failures: before a stream starts, an error response (400 for ContextLengthError, else 500); inside a
  stream, an `{"error": ...}` event (the openai client raises it as APIError) and the stream ends.
"""
from __future__ import annotations

import time
from typing import Any

import trio

from .engine.generate import FinishEvent, GenerationRequest, TokenEvent
from .engine.kv_cache import ContextLengthError
from .protocol.chunks import (ChatChunks, CompletionChunks, chat_completion, metrics_event, new_completion_id,
                              text_completion, tokens_event)
from .protocol.errors import ApiError, internal_error
from .protocol.logprobs import entry_from_engine
from .protocol.reasoning import ReasoningSplitter, prompt_ends_in_reasoning
from .protocol.sse import SSE_DONE, SSE_HEADERS, sse_comment, sse_event
from .protocol.stats import GenerationStats
from .worker import EngineFailure, Ticket


class ChatOutput:
    def __init__(self, req: Any, prompt: str, loaded: Any):
        self.chunks = ChatChunks(new_completion_id(), loaded.name, int(time.time()), include_usage=req.include_usage)
        self.splitter = ReasoningSplitter(prompt_ends_in_reasoning(prompt))
        self._token_bytes = loaded.tokenizer.token_bytes
        self.want_logprobs = req.sampling.logprobs
        self.pending_lp: list = []
        self.all_lp: list = []
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.reasoning_tokens = 0

    def first_event(self) -> dict | None:
        return self.chunks.role()

    def _delta(self, pieces: list[tuple[str, str]]) -> dict | None:
        content = "".join(t for k, t in pieces if k == "content")
        reasoning = "".join(t for k, t in pieces if k == "reasoning")
        self.content.append(content)
        self.reasoning.append(reasoning)
        if not content and not reasoning:
            return None
        lp, self.pending_lp = (self.pending_lp if self.want_logprobs else None), []
        return self.chunks.delta(content=content or None, reasoning_content=reasoning or None, logprobs=lp)

    def on_token(self, ev: TokenEvent) -> dict | None:
        was_reasoning = self.splitter.in_reasoning
        pieces = self.splitter.push(ev.text) if ev.text else []
        if was_reasoning or any(k == "reasoning" for k, _ in pieces):
            self.reasoning_tokens += 1
        if self.want_logprobs and ev.logprob is not None:
            entry = entry_from_engine(ev.logprob, self._token_bytes)
            self.pending_lp.append(entry)
            self.all_lp.append(entry)
        return self._delta(pieces)

    def on_finish(self, ev: FinishEvent, stats: GenerationStats) -> list[dict]:
        out = []
        tail = self._delta(self.splitter.push(ev.text) + self.splitter.flush())
        if tail is None and self.pending_lp:
            tail = self.chunks.delta(content="", logprobs=self.pending_lp)
            self.pending_lp = []
        if tail is not None:
            out.append(tail)
        out.append(self.chunks.finish(ev.reason, timings=stats))
        return out

    def usage(self, ev: FinishEvent) -> dict:
        return _image_usage(self.chunks.usage(ev.prompt_tokens, ev.completion_tokens, self._reasoning_tokens()), ev)

    def _reasoning_tokens(self) -> int | None:
        return self.reasoning_tokens if self.splitter.saw_reasoning else None

    def response(self, ev: FinishEvent, stats: GenerationStats) -> dict:
        return _image_usage(chat_completion(self.chunks.completion_id, self.chunks.model, self.chunks.created,
                               content="".join(self.content), finish_reason=ev.reason,
                               prompt_tokens=ev.prompt_tokens, completion_tokens=ev.completion_tokens,
                               reasoning_content="".join(self.reasoning) if self.splitter.saw_reasoning else None,
                               timings=stats, logprobs=self.all_lp if self.want_logprobs else None,
                               reasoning_tokens=self._reasoning_tokens()), ev)


def _image_usage(body: dict, ev: FinishEvent) -> dict:
    """With images: usage.prompt_tokens_details splits prompt_tokens into text and image tokens (OpenAI's names)."""
    n = getattr(ev.timings, "image_tokens", 0)
    if n and body.get("usage"):
        u = body["usage"]
        u["prompt_tokens_details"] = {"text_tokens": u["prompt_tokens"] - n, "image_tokens": n}
    return body


class CompletionOutput:
    def __init__(self, req: Any, prompt_text: str, loaded: Any):
        self.chunks = CompletionChunks(new_completion_id("cmpl"), loaded.name, int(time.time()),
                                       include_usage=req.include_usage)
        self._token_bytes = loaded.tokenizer.token_bytes
        self.want_logprobs = req.sampling.logprobs
        self.echo = prompt_text if req.echo else ""
        self.pending_lp: list = []
        self.all_lp: list = []
        self.text: list[str] = []
        self.offset = len(self.echo)

    def first_event(self) -> dict | None:
        return self.chunks.text(self.echo) if self.echo else None

    def _chunk(self, text: str) -> dict | None:
        if not text:
            return None
        self.text.append(text)
        lp, self.pending_lp = (self.pending_lp if self.want_logprobs else None), []
        chunk = self.chunks.text(text, logprobs=lp, text_offset=self.offset)
        self.offset += len(text)
        return chunk

    def on_token(self, ev: TokenEvent) -> dict | None:
        if self.want_logprobs and ev.logprob is not None:
            entry = entry_from_engine(ev.logprob, self._token_bytes)
            self.pending_lp.append(entry)
            self.all_lp.append(entry)
        return self._chunk(ev.text)

    def on_finish(self, ev: FinishEvent, stats: GenerationStats) -> list[dict]:
        out = []
        tail = self._chunk(ev.text)
        if tail is None and self.pending_lp:
            tail = self.chunks.text("", logprobs=self.pending_lp, text_offset=self.offset)
            self.pending_lp = []
        if tail is not None:
            out.append(tail)
        out.append(self.chunks.finish(ev.reason, timings=stats))
        return out

    def usage(self, ev: FinishEvent) -> dict:
        return self.chunks.usage(ev.prompt_tokens, ev.completion_tokens)

    def response(self, ev: FinishEvent, stats: GenerationStats) -> dict:
        return text_completion(self.chunks.completion_id, self.chunks.model, self.chunks.created,
                               text=self.echo + "".join(self.text), finish_reason=ev.reason,
                               prompt_tokens=ev.prompt_tokens, completion_tokens=ev.completion_tokens,
                               timings=stats, logprobs=self.all_lp if self.want_logprobs else None,
                               text_offset=len(self.echo))


class Generation:
    def __init__(self, api: Any, loaded: Any, prompt_ids: list[int], req: Any, output: ChatOutput | CompletionOutput,
                 images: tuple = ()):
        self.api = api
        self.req = req
        self.prompt_ids = prompt_ids
        self.output = output
        self.request = GenerationRequest(prompt_ids=prompt_ids, sampling=req.sampling, max_tokens=req.max_tokens,
                                         stop=tuple(req.stop), ignore_eos=req.ignore_eos, images=tuple(images))

    async def run(self, ex: Any, ticket: Ticket) -> None:
        stream = self.req.stream
        async with ticket:
            t_arrival = time.perf_counter()
            if stream:
                await ex.start_stream(200, list(SSE_HEADERS) + self.api.cors_headers())
                first = self.output.first_event()
                if first is not None:
                    await ex.send(sse_event(first))
                await self._wait_turn_streaming(ex, ticket)
            else:
                await ticket.wait_turn()
            queue_ms = (time.perf_counter() - t_arrival) * 1000.0
            finish, failure = None, None
            events = ticket.start(self.request)
            async for ev in events:
                if isinstance(ev, TokenEvent):
                    chunk = self.output.on_token(ev)
                    if stream and chunk is not None:
                        await ex.send(sse_event(chunk))
                elif isinstance(ev, FinishEvent):
                    finish = ev
                    break
                elif isinstance(ev, EngineFailure):
                    failure = ev.error
                    break
            ticket.finished()
        if finish is None:
            return await self._fail(ex, failure)
        stats = GenerationStats.from_finish(finish, queue_ms)
        if not stream:
            return await self.api.send_json(ex, self.output.response(finish, stats))
        for chunk in self.output.on_finish(finish, stats):
            await ex.send(sse_event(chunk))
        if self.req.include_usage:
            await ex.send(sse_event(self.output.usage(finish)))
        if self.req.include_metrics:
            await ex.send(sse_event(metrics_event(stats)))
        if self.req.include_tokens:
            await ex.send(sse_event(tokens_event(list(self.prompt_ids) + list(finish.token_ids))))
        await ex.send(SSE_DONE)
        await ex.end_stream()

    async def _wait_turn_streaming(self, ex: Any, ticket: Ticket) -> None:
        interval = self.api.cfg.queue_keepalive_s

        async def keepalive() -> None:
            while True:
                await trio.sleep(interval)
                with trio.CancelScope(shield=True):
                    await ex.send(sse_comment("queued"))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(keepalive)
            await ticket.wait_turn()
            nursery.cancel_scope.cancel()

    async def _fail(self, ex: Any, error: BaseException | None) -> None:
        if isinstance(error, ContextLengthError):
            err = ApiError(400, str(error), param="messages", code="context_length_exceeded")
        else:
            err = internal_error()
        if not ex.response_started:
            raise err
        await ex.send(sse_event(err.to_dict()))
        await ex.end_stream()
