"""Sans-I/O protocol layer: request parsing/validation, response and chunk building, SSE framing, errors.

Nothing here touches sockets, threads or trio; every function maps values to values (or bytes) so the wire
format is tested byte-for-byte without a server. appliance/h11_server.py is the only caller that does I/O.

  errors.py       ApiError + error_body (OpenAI error JSON), constructors for the server's own errors
  fields.py       typed JSON field reads; body bytes -> JSON object
  messages.py     chat messages and tools -> what the chat template renders
  requests.py     parse_chat_request / parse_completion_request -> ChatRequest / CompletionRequest
  sse.py          sse_event, sse_comment, SSE_DONE, SSE_HEADERS, json_bytes
  chunks.py       ChatChunks / CompletionChunks, chat_completion / text_completion, extension events
  logprobs.py     LogprobEntry and OpenAI's two logprobs shapes
  stats.py        GenerationStats -> llama.cpp-style timings and the seed's metrics
  reasoning.py    ReasoningSplitter (<think> blocks -> reasoning_content)
  tool_calls.py   ToolCallParser (<tool_call> blocks -> tool_calls)
  assemble.py     Chat/CompletionAssembler: engine events -> SSE bytes or the non-stream body
  prometheus.py   render_metrics (Prometheus text exposition)
"""
