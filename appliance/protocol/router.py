"""Generated text -> reasoning, content and tool calls, token by token: the split every API's assembler shares.

Policies:
- Every token's text goes through the reasoning splitter (when the API reports reasoning) and then, when the
  request has tools, through the tool-call parser of its tool format (the template's `<tool_call>` blocks,
  tool_calls.py, their XML `<function=...>` blocks, xml_tool_calls.py, or the generic JSON object of templates
  without tools, generic_tool_calls.py); so chat completions, the Ollama API and the Responses API
  report the same reasoning / content / tool calls for the same tokens, stream and non-stream alike.
- A token counts as a reasoning token when the splitter was or is inside a think block around it.
- Tool calls come out two ways: whole when they complete (the Routed tuple; Ollama sends calls whole), and as
  OpenAI stream deltas in `deltas` after each push: a call's first delta has index, id, type and name, later
  ones index and an arguments fragment (one entry per call index per push).
"""
from __future__ import annotations

from typing import Any, Callable

from appliance.protocol import ToolFormat, ToolsArg
from appliance.protocol.generic_tool_calls import GenericToolCallParser
from appliance.protocol.reasoning import ReasoningSplitter
from appliance.protocol.tool_calls import ToolCallParser, new_call_id
from appliance.protocol.xml_tool_calls import XmlToolCallParser

Routed = tuple[str, str, list[dict[str, Any]]]   # (reasoning, content, tool calls completed by this text)


class OutputRouter:
    def __init__(self, *, in_reasoning: bool = False, reasoning: bool = True, tools: ToolsArg = False,
                 tool_format: ToolFormat = "template", new_id: Callable[[], str] = new_call_id):
        self._splitter = ReasoningSplitter(in_reasoning) if reasoning else None
        self._tools: ToolCallParser | GenericToolCallParser | XmlToolCallParser | None = None
        if tools and tool_format == "xml":              # the request's tools type the XML parameters' values
            self._tools = XmlToolCallParser(new_id, tools)
        elif tools:
            self._tools = (GenericToolCallParser if tool_format == "generic" else ToolCallParser)(new_id)
        self.reasoning_parts: list[str] = []
        self.content_parts: list[str] = []
        self._reasoning_token_count = 0
        self._n_announced = 0
        self.deltas: list[dict[str, Any]] = []        # the OpenAI tool_calls stream deltas of the last push

    @property
    def in_reasoning(self) -> bool:
        return self._splitter is not None and self._splitter.in_reasoning

    @property
    def saw_reasoning(self) -> bool:
        return self._splitter is not None and self._splitter.saw_reasoning

    @property
    def reasoning_tokens(self) -> int | None:
        """Tokens spent inside think blocks (None when the model did not think)."""
        return self._reasoning_token_count if self.saw_reasoning else None

    @property
    def calls(self) -> list[dict[str, Any]]:
        return self._tools.calls if self._tools is not None else []

    @property
    def content(self) -> str:
        return "".join(self.content_parts)

    @property
    def reasoning(self) -> str:
        return "".join(self.reasoning_parts)

    def token(self, text: str) -> Routed:
        """One decoded token's text."""
        was_reasoning = self.in_reasoning
        routed = self.push(text, final=False)
        if was_reasoning or self.in_reasoning:
            self._reasoning_token_count += 1
        return routed

    def push(self, text: str, final: bool) -> Routed:
        """Text (final: the released tail; everything held back comes out)."""
        if self._splitter is None:
            pieces = [("content", text)] if text else []
        else:
            pieces = self._splitter.push(text) + (self._splitter.flush() if final else [])
        reasoning: list[str] = []
        content: list[str] = []
        calls: list[dict[str, Any]] = []
        self.deltas = []
        for kind, piece in pieces:
            if kind == "reasoning":
                reasoning.append(piece)
            elif self._tools is None:
                content.append(piece)
            else:
                self._sort(self._tools.push(piece), content, calls)
        if final and self._tools is not None:
            self._sort(self._tools.flush(), content, calls)
        r, c = "".join(reasoning), "".join(content)
        self.reasoning_parts.append(r)
        self.content_parts.append(c)
        return r, c, calls

    def _sort(self, pieces: list, content: list[str], calls: list[dict[str, Any]]) -> None:
        deltas = self.deltas
        for kind, value in pieces:
            if kind == "content":
                content.append(value)
            elif kind == "done":
                calls.append(value)
            elif kind == "call":
                deltas.append({"index": self._n_announced, **value})
                self._n_announced += 1
            elif deltas and deltas[-1]["index"] == self._n_announced - 1:
                deltas[-1]["function"]["arguments"] += value
            else:
                deltas.append({"index": self._n_announced - 1, "function": {"arguments": value}})
