"""ToolCallParser: Qwen3/Hermes <tool_call> blocks -> OpenAI tool_calls, incrementally."""
from __future__ import annotations

import itertools

from appliance.protocol.tool_calls import ToolCallParser


def ids():
    n = itertools.count()
    return lambda: f"call_{next(n)}"


def run(chunks):
    p = ToolCallParser(ids())
    steps = [p.push(c) for c in chunks] + [p.flush()]
    return steps, p


def call(i, name, args):
    return ("tool_call", {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": args}})


def test_plain_content_untouched_including_trailing_newlines():
    steps, p = run(["Hello\n", "\nworld\n"])
    assert steps == [[("content", "Hello")], [("content", "\n\nworld")], [("content", "\n")]]
    assert p.calls == []


def test_qwen3_call_split_over_tokens():
    toks = ["I'll check.", "\n", "<tool", "_call>", "\n{\"name\": \"get_weather\", ", "\"arguments\": {\"city\": ",
            "\"Paris 巴黎\"}}", "\n</tool_call>", "\n<tool_call>\n{\"name\": \"t\", \"arguments\": \"{}\"}\n",
            "</tool_call>", "\n"]
    steps, p = run(toks)
    assert steps == [[("content", "I'll check.")], [], [], [], [], [], [], [call(0, "get_weather",
                                                                             '{"city": "Paris 巴黎"}')],
                     [], [call(1, "t", "{}")], [], []]
    assert [c["function"]["name"] for c in p.calls] == ["get_weather", "t"]


def test_invalid_block_is_content():
    steps, p = run(["<tool_call>\nnot json\n</tool_call> after"])
    assert steps == [[("content", "<tool_call>\nnot json\n</tool_call> after")], []]
    steps, p = run(["<tool_call>{\"arguments\": {}}</tool_call>"])
    assert steps == [[("content", "<tool_call>{\"arguments\": {}}</tool_call>")], []]
    assert p.calls == []


def test_unterminated_block_is_flushed_as_content():
    steps, p = run(["x <tool_call>\n{\"name\": \"f\""])
    assert steps == [[("content", "x ")], [("content", "<tool_call>\n{\"name\": \"f\"")]]


def test_false_partial_tag_and_content_after_a_call():
    steps, p = run(["a<to", "p>", "<tool_call>{\"name\":\"f\"}</tool_call>", "\n\nDone."])
    assert steps == [[("content", "a")], [("content", "<top>")], [call(0, "f", "{}")], [("content", "\n\nDone.")],
                     []]
