"""Sans-I/O protocol layer: request parsing/validation, response and chunk building, SSE framing, errors.

Nothing here touches sockets, threads or trio; every function maps values to values (or bytes) so the wire
format is tested byte-for-byte without a server. appliance/h11_server.py is the only caller that does I/O.

  errors.py       ApiError + error_body (OpenAI error JSON), constructors for the server's own errors
  fields.py       typed JSON field reads; body bytes -> JSON object
  messages.py     chat messages and tools -> what the chat template renders
  requests.py     parse_chat_request / parse_completion_request -> ChatRequest / CompletionRequest
  ollama_requests.py, responses_requests.py   the Ollama and Responses APIs' bodies -> the same ChatRequest
  structured.py   response_format / tool_choice -> OutputFormat (constrained decoding), schema limits
  json_schema.py  a JSON schema's sub-schemas, levels and probe points (parts stepped into before admission)
  sse.py          sse_event, sse_comment, SSE_DONE, SSE_HEADERS, json_bytes
  chunks.py       ChatChunks / CompletionChunks, chat_completion / text_completion, extension events
  logprobs.py     LogprobEntry and OpenAI's two logprobs shapes
  stats.py        GenerationStats -> llama.cpp-style timings and the seed's metrics
  reasoning.py    ReasoningSplitter (<think> blocks -> reasoning_content)
  tool_calls.py   ToolCallParser (<tool_call> blocks -> tool_calls)
  xml_tool_calls.py XmlToolCallParser (Qwen3.5 / Qwen3-Coder <function=...> blocks -> tool_calls)
  router.py       OutputRouter: each token's text through both -> reasoning / content / tool calls
  assemble.py     Chat/CompletionAssembler: engine events -> SSE bytes or the non-stream body
  ollama_stream.py, responses_stream.py   the same for Ollama's NDJSON and the Responses API's typed events
  anthropic_requests.py, anthropic_stream.py   Anthropic's Messages API: bodies -> ChatRequest; its events,
                  message object and error shape
  prometheus.py   render_metrics (Prometheus text exposition)

Every assembler (assemble.py, ollama_stream.py, responses_stream.py) is an `Assembler`, below, the interface
server/generation.py's Generation drives.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, Protocol, Sequence

if TYPE_CHECKING:
    from .errors import ApiError
    from .logprobs import LogprobEntry
    from .stats import GenerationStats

Phase = Literal["queued", "prefill"]  # where a request waits for its first token (the keep-alive says which)
ToolFormat = Literal["template", "generic", "xml"]  # how tool calls are written: the template's JSON blocks,
                                                    # generic JSON, or the template's XML blocks (Qwen3.5)
ToolsArg = bool | Sequence[Any]   # an assembler's `tools`: parse calls (the request's tools: their parameters' types)


class Assembler(Protocol):
    """One request's response in its API's shape, built from the engine's events."""

    stream_headers: list[tuple[bytes, bytes]]  # the streamed response's headers (SSE or NDJSON)

    def start(self) -> list[bytes]:
        """The opening events of a stream (one bytes per event)."""
        ...

    def token(self, text: str, logprob: LogprobEntry | None = None) -> bytes:
        """One token's event (b"" while its text is held back); the non-stream path ignores the bytes."""
        ...

    def keepalive(self, phase: Phase) -> bytes:
        """What keeps a waiting stream alive (an SSE comment, an empty NDJSON line)."""
        ...

    def error_event(self, err: ApiError) -> bytes:
        """An error after the stream began, in the API's own shape."""
        ...

    def finish(self, reason: str, text: str, stats: GenerationStats, prompt_ids: Sequence[int] = (),
               completion_ids: Sequence[int] = ()) -> list[bytes]:
        """The closing events of a stream, after the last token."""
        ...

    def response(self, reason: str, text: str, stats: GenerationStats,
                 completion_ids: Sequence[int] = ()) -> dict[str, Any]:
        """The non-stream body, after every token went through token()."""
        ...
