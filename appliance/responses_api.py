"""POST /v1/responses: OpenAI's Responses API, stateless. Parsing and the event stream live in
protocol/responses_*.py; the request goes through the same preparation (worker thread), admission, image
decoding and Generation path as /v1/chat/completions. Errors are OpenAI's error JSON, the 429 included."""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from .h11_server import Exchange
from .protocol.reasoning import prompt_ends_in_reasoning
from .protocol.responses_requests import parse_responses_request
from .protocol.responses_stream import ResponsesAssembler


class ResponsesApi:
    def __init__(self, api: Any):
        self.api = api
        api.routes["/v1/responses"] = {"POST": self.create}

    def _prepare(self, loaded: Any, body: bytes):
        """Worker thread: body -> (parsed request, prompt text, prompt ids, constraint)."""
        r = parse_responses_request(body, defaults=loaded.default_sampling, context_length=loaded.context_length,
                                    images_supported=loaded.multimodal)
        r = replace(r, request=self.api.fit_tools(loaded, r.request))
        prompt, ids = self.api.render_prompt(loaded, r.request, len(body))
        param = "tools" if r.request.tool_choice in ("required", "function") or r.request.tool_format == "generic" \
            else "text.format"
        return r, prompt, ids, self.api.compile_constraint(loaded, r.request, prompt, param)

    async def create(self, ex: Exchange) -> None:
        loaded = self.api.loaded()
        body = await ex.read_body()
        r, prompt, ids, constraint = await self.api.prepare(lambda: self._prepare(loaded, body))
        out = ResponsesAssembler(self.api.cfg.model_name, int(time.time()), r.echo,
                                 in_reasoning=prompt_ends_in_reasoning(prompt), tools=bool(r.request.tools),
                                 tool_format=r.request.tool_format)
        await self.api.generate_chat(ex, loaded, r.request, ids, out, len(body), constraint)
