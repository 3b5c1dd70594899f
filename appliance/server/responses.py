"""POST /v1/responses: OpenAI's Responses API, stateless. Parsing and the event stream live in
protocol/responses_*.py; the request goes through the same preparation (worker thread), admission, image
decoding and Generation path as /v1/chat/completions. Errors are OpenAI's error JSON, the 429 included."""
from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING

from ..h11_server import Exchange
from ..protocol.reasoning import prompt_ends_in_reasoning
from ..protocol.responses_requests import parse_responses_request
from ..protocol.responses_stream import ResponsesAssembler
from .config import Routes
from .generation import run_ticket
from .preparer import Preparer

if TYPE_CHECKING:
    from ..engine.load import LoadedModel


class ResponsesApi:
    def __init__(self, prep: Preparer):
        self.prep = prep

    def routes(self) -> Routes:
        return {"/v1/responses": {"POST": self.create}}

    def _prepare(self, loaded: LoadedModel, body: bytes):
        """Worker thread: body -> (parsed request, prompt text, prompt ids, constraint)."""
        prep = self.prep
        r = parse_responses_request(body, defaults=loaded.default_sampling, context_length=loaded.context_length,
                                    images_supported=loaded.multimodal, images_hint=loaded.images_hint)
        r = replace(r, request=prep.fit_tools(loaded, r.request))
        prompt, ids = prep.render_prompt(loaded, r.request, len(body))
        param = "tools" if r.request.tool_choice in ("required", "function") or r.request.tool_format == "generic" \
            else "text.format"
        return r, prompt, ids, prep.compile_constraint(loaded, r.request, prompt, param)

    async def create(self, ex: Exchange) -> None:
        prep = self.prep
        loaded = prep.loaded()
        body = await ex.read_body()
        r, prompt, ids, constraint = await prep.prepare(lambda: self._prepare(loaded, body))
        out = ResponsesAssembler(prep.model_name, int(time.time()), r.echo,
                                 in_reasoning=prompt_ends_in_reasoning(prompt), tools=r.request.tools or False,
                                 tool_format=r.request.tool_format)
        await run_ticket(prep, ex, loaded, r.request, ids, out, body_size=len(body), constraint=constraint,
                         messages=r.request.messages)
