"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API (what the `anthropic` SDKs and agent
tools such as Claude Code send). Parsing lives in protocol/anthropic_requests.py, the event stream and the error
shape in protocol/anthropic_stream.py; the request goes through the same preparation (worker thread), admission
(429), image decoding, Generation path (message_start before prefill, pings while queued, one event per token,
cancel on disconnect) and prefix reuse as every other API.

Policies:
- Errors under /v1/messages are Anthropic's `{"type": "error", "error": {...}}` (app.py renders them by path),
  the 401 of a missing or wrong key and the 429 of a full queue included; the key may come as Anthropic's
  `x-api-key` header or as `Authorization: Bearer`.
- max_tokens is lowered to the room the prompt leaves in the context (never a 400 for a large max_tokens; the
  stop_reason says which limit ended it); a prompt that leaves no room is the usual 400.
- A final assistant message (prefill) is rendered as the template closes it and cut after its text
  (Preparer.render_prompt's continue_final), so the model continues it.
- count_tokens renders and tokenizes exactly what /v1/messages would prefill (template, tools, thinking switch,
  images) without running the model; a request with images takes a place in line (429 when full) while they are
  decoded, as only a request holding one decodes images, and gives it back at once.
"""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from ..h11_server import Exchange
from ..protocol.anthropic_requests import (
    AnthropicRequest,
    continue_final_message,
    parse_count_tokens_request,
    parse_messages_request,
)
from ..protocol.anthropic_stream import AnthropicAssembler
from ..protocol.reasoning import prompt_ends_in_reasoning
from .config import Routes
from .generation import run_ticket
from .images import image_urls
from .preparer import Preparer

if TYPE_CHECKING:
    from ..engine.load import LoadedModel


def is_anthropic_path(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


class AnthropicApi:
    def __init__(self, prep: Preparer):
        self.prep = prep

    def routes(self) -> Routes:
        return {"/v1/messages": {"POST": self.create}, "/v1/messages/count_tokens": {"POST": self.count_tokens}}

    def _prepare(self, loaded: LoadedModel, body: bytes):
        """Worker thread: body -> (parsed request, its ChatRequest fitted to the context, prompt, ids, constraint)."""
        prep = self.prep
        a: AnthropicRequest = parse_messages_request(body, defaults=loaded.default_sampling,
                                                     images_supported=loaded.multimodal)
        req = prep.fit_tools(loaded, a.request)
        prompt, ids = prep.render_prompt(loaded, req, len(body), check=False, continue_final=self._prefill(a))
        room = loaded.context_length - len(ids)
        if room > 0 and a.max_tokens is not None and a.max_tokens > room:
            req = replace(req, max_tokens=room)
        if not image_urls(req.messages):
            prep.check_context(loaded, len(ids), req.max_tokens)
        param = "tools" if req.tool_choice in ("required", "function") or req.tool_format == "generic" else "messages"
        return a, req, prompt, ids, prep.compile_constraint(loaded, req, prompt, param)

    async def create(self, ex: Exchange) -> None:
        prep = self.prep
        loaded = prep.loaded()
        body = await ex.read_body()
        a, req, prompt, ids, constraint = await prep.prepare(lambda: self._prepare(loaded, body))
        out = AnthropicAssembler(prep.model_name, len(ids), a.max_tokens or 0,
                                 in_reasoning=prompt_ends_in_reasoning(prompt), tools=req.tools or False,
                                 tool_format=req.tool_format)

        def expanded(final_ids: list[int]) -> None:   # image tokens counted once the images are decoded
            out.prompt_tokens = len(final_ids)
        await run_ticket(prep, ex, loaded, req, ids, out, body_size=len(body), constraint=constraint,
                         messages=req.messages, on_prompt=expanded)

    @staticmethod
    def _prefill(a: AnthropicRequest):
        text = a.prefill_text
        return None if text is None else lambda prompt: continue_final_message(prompt, text)

    def _count(self, loaded: LoadedModel, body: bytes):
        """Worker thread: (the request fitted as /v1/messages fits it, its prompt ids before image expansion)."""
        prep = self.prep
        a = parse_count_tokens_request(body, images_supported=loaded.multimodal)
        req = prep.fit_tools(loaded, a.request)
        _, ids = prep.render_prompt(loaded, req, len(body), check=False, continue_final=self._prefill(a))
        return req, ids

    async def count_tokens(self, ex: Exchange) -> None:
        prep = self.prep
        loaded = prep.loaded()
        body = await ex.read_body()
        req, ids = await prep.prepare(lambda: self._count(loaded, body))
        urls = image_urls(req.messages)
        if urls:   # their tokens are known once decoded, which a request holding a place in line does
            ticket = prep.admit()
            try:
                ids, _ = await prep.images(loaded, ex, urls, ids, len(body))
            finally:
                ticket.drop(abandoned=False)
        await prep.send_json(ex, {"input_tokens": len(ids)})
