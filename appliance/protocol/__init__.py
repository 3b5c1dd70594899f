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
  router.py       OutputRouter: each token's text through both -> reasoning / content / tool calls
  assemble.py     Chat/CompletionAssembler: engine events -> SSE bytes or the non-stream body
  ollama_stream.py, responses_stream.py   the same for Ollama's NDJSON and the Responses API's typed events
  anthropic_requests.py, anthropic_stream.py   Anthropic's Messages API: bodies -> ChatRequest; its events,
                  message object and error shape
  prometheus.py   render_metrics (Prometheus text exposition)

Every assembler has one interface, which generation.Generation drives: stream_headers; start() and finish()
-> the opening / closing events as a list (one bytes per event); token() -> one event's bytes (b"" when held
back); keepalive(phase) and error_event(err) -> bytes; response() -> the non-stream body.
"""
