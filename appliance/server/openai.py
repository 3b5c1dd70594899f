"""The OpenAI generation endpoints: POST /v1/chat/completions and /v1/completions (the Responses API is
responses.py; /v1/models is app.py's). Parsing and response shapes live in protocol/ (requests.py, assemble.py).

Policies:
- Stream and non-stream share one generation path (generation.run_ticket); only the framing differs. A stream's
  status line, SSE headers and first event (the chat role frame) go out before queueing and prefill; while
  queued it gets SSE comments; then one event per TokenEvent that releases text, the finish chunk (with
  timings), the usage chunk if asked, the extension events if asked, and `data: [DONE]`.
- The `model` field is not checked: the appliance serves one model and names it in every response.
- A text completion's prompt is a string (tokenized) or token ids (checked against the vocabulary); `echo`
  returns the ids' text as the model reads it (special tokens included).
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ..h11_server import Exchange
from ..protocol.assemble import ChatAssembler, CompletionAssembler
from ..protocol.reasoning import prompt_ends_in_reasoning
from ..protocol.requests import ChatRequest, CompletionRequest, parse_chat_request, parse_completion_request
from .config import Routes
from .generation import run_ticket
from .preparer import Preparer

if TYPE_CHECKING:
    from ..engine.load import LoadedModel


class OpenAiApi:
    def __init__(self, prep: Preparer):
        self.prep = prep

    def routes(self) -> Routes:
        return {"/v1/chat/completions": {"POST": self.chat}, "/v1/completions": {"POST": self.completions}}

    async def chat(self, ex: Exchange) -> None:
        prep = self.prep
        loaded = prep.loaded()
        body = await ex.read_body()
        req, prompt, ids, constraint = await prep.prepare(lambda: self._prepare_chat(loaded, body))
        out = ChatAssembler.for_request(req, model=prep.model_name, created=int(time.time()),
                                        in_reasoning=prompt_ends_in_reasoning(prompt))
        await run_ticket(prep, ex, loaded, req, ids, out, body_size=len(body), constraint=constraint,
                         messages=req.messages)

    def _prepare_chat(self, loaded: LoadedModel, body: bytes):
        """Worker thread: body -> (request, prompt text, prompt ids, constraint); ApiError for anything wrong."""
        prep = self.prep
        req: ChatRequest = parse_chat_request(body, defaults=loaded.default_sampling,
                                              context_length=loaded.context_length,
                                              images_supported=loaded.multimodal,
                                              images_hint=loaded.images_hint,
                                              stream_extensions=prep.cfg.extension_events)
        req = prep.fit_tools(loaded, req)
        prompt, ids = prep.render_prompt(loaded, req, len(body))
        param = "tools" if req.tool_choice in ("required", "function") or req.tool_format == "generic" \
            else "response_format"
        return req, prompt, ids, prep.compile_constraint(loaded, req, prompt, param)

    async def completions(self, ex: Exchange) -> None:
        prep = self.prep
        loaded = prep.loaded()
        body = await ex.read_body()
        req, ids, prompt_text = await prep.prepare(lambda: self._prepare_completion(loaded, body))
        out = CompletionAssembler.for_request(req, model=prep.model_name, created=int(time.time()),
                                              echo_text=prompt_text)
        await run_ticket(prep, ex, loaded, req, ids, out)

    def _prepare_completion(self, loaded: LoadedModel, body: bytes):
        """Worker thread: body -> (request, prompt ids, prompt text to echo)."""
        prep = self.prep
        req: CompletionRequest = parse_completion_request(body, defaults=loaded.default_sampling,
                                                          context_length=loaded.context_length,
                                                          stream_extensions=prep.cfg.extension_events)
        if isinstance(req.prompt, str):
            ids = prep.encode(loaded, req.prompt, req.max_tokens, len(body))
            prompt_text = req.prompt
        else:
            ids = prep.check_token_ids(loaded, req.prompt, "prompt")
            prompt_text = loaded.tokenizer.decode(ids, skip_special_tokens=False) if req.echo else ""
        prep.check_context(loaded, len(ids), req.max_tokens)
        return req, ids, prompt_text
