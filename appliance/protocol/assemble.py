"""One generation's engine events -> the bytes of its SSE stream, or its non-stream response.

Policies:
- Stream and non-stream share one path: every token's text goes through the reasoning splitter (and the tool-call
  parser when the request has tools), so both report the same content / reasoning_content / tool_calls.
- One event per decoded token: a token whose text is all held back (part of a character, a possible stop string,
  a partial tag, a tool-call block) sends nothing, and its logprob rides on the next event that does.
- After the last token: any released tail, the finish chunk (with timings), then usage / metrics / tokens when
  asked, then [DONE]; start() and finish() return their events as a list, one bytes per event (each is written
  on its own). finish_reason becomes "tool_calls" when the model stopped after calling tools.
- Tool calls stream as OpenAI's do (OutputRouter.deltas): the first delta of a call has index, id, type and
  function.name, later ones index and function.arguments fragments.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

from appliance.protocol import Phase, ToolFormat, ToolsArg
from appliance.protocol.chunks import ChatChunks, CompletionChunks, chat_completion, new_completion_id, text_completion
from appliance.protocol.errors import ApiError
from appliance.protocol.logprobs import LogprobEntry
from appliance.protocol.router import OutputRouter
from appliance.protocol.sse import SSE_DONE, SSE_HEADERS, sse_comment, sse_event
from appliance.protocol.stats import GenerationStats
from appliance.protocol.tool_calls import new_call_id


class _Tail:
    """The closing events both endpoints share, and their SSE framing (other APIs' assemblers have their own)."""
    stream_headers = SSE_HEADERS

    def keepalive(self, phase: Phase) -> bytes:
        """Sent while the request waits in the queue or in a long prefill."""
        return sse_comment(phase)

    def error_event(self, err: ApiError) -> bytes:
        """An error after the stream began (the openai client raises it as APIError)."""
        return sse_event(err.to_dict())

    def __init__(self, include_metrics: bool, include_tokens: bool):
        self.include_metrics = include_metrics
        self.include_tokens = include_tokens

    def tail(self, head: bytes, chunks: Any, finish: dict, stats: GenerationStats, prompt_ids: Sequence[int],
             completion_ids: Sequence[int], reasoning_tokens: int | None = None) -> list[bytes]:
        """The closing events: `head` (the released tail's event, b"" if none), the finish chunk, the extras,
        [DONE]."""
        out = [head] if head else []
        out.append(sse_event(finish))
        if chunks.include_usage:
            out.append(sse_event(chunks.usage(stats.prompt_tokens, stats.completion_tokens, reasoning_tokens,
                                              stats.prompt_tokens_details())))
        if self.include_metrics:
            out.append(sse_event(chunks.metrics(stats)))
        if self.include_tokens:
            out.append(sse_event(chunks.tokens([*prompt_ids, *completion_ids])))
        out.append(SSE_DONE)
        return out


class ChatAssembler(_Tail):
    """`chunks.include_usage` decides the usage event (its chunks then carry "usage": null, as OpenAI's do)."""

    def __init__(self, chunks: ChatChunks, *, in_reasoning: bool = False, reasoning: bool = True,
                 tools: ToolsArg = False, tool_format: ToolFormat = "template", logprobs: bool = False,
                 include_metrics: bool = False, include_tokens: bool = False,
                 new_id: Callable[[], str] = new_call_id):
        super().__init__(include_metrics, include_tokens)
        self.chunks = chunks
        self.router = OutputRouter(in_reasoning=in_reasoning, reasoning=reasoning, tools=tools,
                                   tool_format=tool_format, new_id=new_id)
        self._logprobs = logprobs
        self._pending_lp: list[LogprobEntry] = []
        self.logprob_entries: list[LogprobEntry] = []

    @property
    def reasoning_tokens(self) -> int | None:
        """Tokens spent inside think blocks (None when the model did not think)."""
        return self.router.reasoning_tokens

    @classmethod
    def for_request(cls, req: Any, *, model: str, created: int, in_reasoning: bool = False,
                    completion_id: str | None = None, reasoning: bool = True) -> "ChatAssembler":
        """From a parsed ChatRequest; `in_reasoning`: the rendered prompt left a think block open."""
        chunks = ChatChunks(completion_id or new_completion_id("chatcmpl"), model, created,
                            include_usage=req.include_usage)
        return cls(chunks, in_reasoning=in_reasoning, reasoning=reasoning, tools=req.tools or False,
                   tool_format=req.tool_format, logprobs=req.sampling.logprobs, include_metrics=req.include_metrics,
                   include_tokens=req.include_tokens)

    def _delta(self, routed: tuple[str, str, list[dict[str, Any]]], logprob: LogprobEntry | None,
               final: bool) -> bytes:
        if logprob is not None and self._logprobs:
            self._pending_lp.append(logprob)
            self.logprob_entries.append(logprob)
        r, c, _ = routed
        deltas = self.router.deltas or None
        if not (r or c or deltas or (final and self._pending_lp)):
            return b""
        lp = self._pending_lp if self._logprobs else None
        self._pending_lp = []
        return sse_event(self.chunks.delta(content=c or None, reasoning_content=r or None, logprobs=lp,
                                           tool_calls=deltas))

    @property
    def calls(self) -> list[dict[str, Any]]:
        return self.router.calls

    def finish_reason(self, reason: str) -> str:
        return "tool_calls" if reason == "stop" and self.calls else reason

    # -- stream ------------------------------------------------------------------------------------------
    def start(self) -> list[bytes]:
        """The role frame, sent before prefill."""
        return [sse_event(self.chunks.role())]

    def token(self, text: str, logprob: LogprobEntry | None = None) -> bytes:
        """The event of one decoded token (b"" when its text is held back)."""
        return self._delta(self.router.token(text), logprob, final=False)

    def finish(self, reason: str, text: str, stats: GenerationStats, prompt_ids: Sequence[int] = (),
               completion_ids: Sequence[int] = ()) -> list[bytes]:
        """Everything after the last token, through [DONE]."""
        head = self._delta(self.router.push(text, final=True), None, final=True)
        return self.tail(head, self.chunks, self.chunks.finish(self.finish_reason(reason), stats), stats,
                         prompt_ids, completion_ids, self.reasoning_tokens)

    # -- non-stream ----------------------------------------------------------------------------------------
    def response(self, reason: str, text: str, stats: GenerationStats,
                 completion_ids: Sequence[int] = ()) -> dict[str, Any]:
        """The chat.completion object, after every token went through token() (their bytes ignored)."""
        self._delta(self.router.push(text, final=True), None, final=True)
        content = self.router.content
        return chat_completion(self.chunks.completion_id, self.chunks.model, self.chunks.created,
                               content=None if (self.calls and not content) else content,
                               reasoning_content=self.router.reasoning if self.router.saw_reasoning else None,
                               finish_reason=self.finish_reason(reason), prompt_tokens=stats.prompt_tokens,
                               completion_tokens=stats.completion_tokens, timings=stats,
                               logprobs=self.logprob_entries if self._logprobs else None,
                               tool_calls=self.calls or None, reasoning_tokens=self.reasoning_tokens,
                               prompt_details=stats.prompt_tokens_details(),
                               system_fingerprint=self.chunks.system_fingerprint)


class CompletionAssembler(_Tail):
    def __init__(self, chunks: CompletionChunks, *, echo: str = "", logprobs: bool = False,
                 include_metrics: bool = False, include_tokens: bool = False):
        super().__init__(include_metrics, include_tokens)
        self.chunks = chunks
        self.echo = echo
        self._logprobs = logprobs
        self._pending_lp: list[LogprobEntry] = []
        self.logprob_entries: list[LogprobEntry] = []
        self.parts: list[str] = []
        self._emitted = len(echo)      # characters streamed so far (text_offset of the next piece)

    @classmethod
    def for_request(cls, req: Any, *, model: str, created: int, echo_text: str = "",
                    completion_id: str | None = None) -> "CompletionAssembler":
        """From a parsed CompletionRequest; `echo_text`: the prompt as text, echoed when req.echo."""
        chunks = CompletionChunks(completion_id or new_completion_id("cmpl"), model, created,
                                  include_usage=req.include_usage)
        return cls(chunks, echo=echo_text if req.echo else "", logprobs=req.sampling.logprobs,
                   include_metrics=req.include_metrics, include_tokens=req.include_tokens)

    def start(self) -> list[bytes]:
        """The echoed prompt, if asked (otherwise nothing: completions have no role frame)."""
        return [sse_event(self.chunks.text(self.echo))] if self.echo else []

    def _piece(self, text: str, logprob: LogprobEntry | None, final: bool) -> bytes:
        if logprob is not None and self._logprobs:
            self._pending_lp.append(logprob)
            self.logprob_entries.append(logprob)
        if text:
            self.parts.append(text)
        if not text and not (final and self._pending_lp):
            return b""
        lp = self._pending_lp if self._logprobs else None
        self._pending_lp = []
        ev = sse_event(self.chunks.text(text, lp, text_offset=self._emitted))
        self._emitted += len(text)
        return ev

    def token(self, text: str, logprob: LogprobEntry | None = None) -> bytes:
        return self._piece(text, logprob, final=False)

    def finish(self, reason: str, text: str, stats: GenerationStats, prompt_ids: Sequence[int] = (),
               completion_ids: Sequence[int] = ()) -> list[bytes]:
        head = self._piece(text, None, final=True)
        return self.tail(head, self.chunks, self.chunks.finish(reason, stats), stats, prompt_ids, completion_ids)

    def response(self, reason: str, text: str, stats: GenerationStats,
                 completion_ids: Sequence[int] = ()) -> dict[str, Any]:
        if text:
            self.parts.append(text)
        return text_completion(self.chunks.completion_id, self.chunks.model, self.chunks.created,
                               text=self.echo + "".join(self.parts), finish_reason=reason,
                               prompt_tokens=stats.prompt_tokens, completion_tokens=stats.completion_tokens,
                               timings=stats, logprobs=self.logprob_entries if self._logprobs else None,
                               text_offset=len(self.echo), prompt_details=stats.prompt_tokens_details(),
                               system_fingerprint=self.chunks.system_fingerprint)
