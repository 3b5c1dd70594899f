"""ToolCallParser: Qwen3/Hermes <tool_call> blocks -> OpenAI tool_calls, incrementally."""
from __future__ import annotations

import itertools

import pytest

from appliance.protocol.tool_calls import ToolCallParser


def ids():
    n = itertools.count()
    return lambda: f"call_{next(n)}"


def run(chunks):
    """Each push's pieces without the ("done", call) markers; those are checked to come once per call, in order."""
    p = ToolCallParser(ids())
    steps = [p.push(c) for c in chunks] + [p.flush()]
    done = [v for s in steps for k, v in s if k == "done"]
    assert done == p.calls and all(a is b for a, b in zip(done, p.calls))
    return [[x for x in s if x[0] != "done"] for s in steps], p


def call(i, name, args=""):
    return ("call", {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": args}})


def test_plain_content_untouched_including_trailing_newlines():
    steps, p = run(["Hello\n", "\nworld\n"])
    assert steps == [[("content", "Hello")], [("content", "\n\nworld")], [("content", "\n")]]
    assert p.calls == []


def test_qwen3_call_streams_its_arguments_as_they_decode():
    toks = ["I'll check.", "\n", "<tool", "_call>", "\n{\"name\": \"get_weather\", ", "\"arguments\": {\"city\": ",
            "\"Paris 巴黎\"}", "}", "\n</tool_call>", "\n<tool_call>\n{\"name\": \"t\", \"arguments\": \"{}\"}\n",
            "</tool_call>", "\n"]
    steps, p = run(toks)
    assert steps == [[("content", "I'll check.")], [], [], [], [],
                     [call(0, "get_weather"), ("args", '{"city": ')],    # announced at `"arguments": {`
                     [("args", '"Paris 巴黎"}')],                           # this `}` closes the arguments
                     [],                                                  # the block's own `}`: wrapper
                     [], [], [call(1, "t"), ("args", "{}")], [], []]      # a string argument: whole at the end
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in p.calls] == \
        [("get_weather", '{"city": "Paris 巴黎"}'), ("t", "{}")]


def test_fragments_join_to_the_arguments_for_every_split():
    text = 'ok<tool_call>\n{"name": "f", "arguments": {"a": {"b": [1, "}"]}, "c": " "}}\n</tool_call>'
    for cut in range(1, len(text)):
        for cut2 in (cut, min(cut + 7, len(text))):
            steps, p = run([text[:cut], text[cut:cut2], text[cut2:]])
            pieces = [x for s in steps for x in s]
            assert "".join(v for k, v in pieces if k == "content") == "ok"
            assert "".join(v for k, v in pieces if k == "args") == '{"a": {"b": [1, "}"]}, "c": " "}'
            assert p.calls[0]["function"]["arguments"] == '{"a": {"b": [1, "}"]}, "c": " "}'


def test_announced_call_cut_off_keeps_its_partial_arguments():
    steps, p = run(['<tool_call>\n{"name": "f", "arguments": {"a": 1', ', "b"'])
    assert [x for s in steps for x in s] == [call(0, "f"), ("args", '{"a": 1'), ("args", ', "b"')]
    assert p.calls[0]["function"]["arguments"] == '{"a": 1, "b"'


def test_invalid_block_is_content():
    steps, p = run(["<tool_call>\nnot json\n</tool_call> after"])
    assert steps == [[("content", "<tool_call>\nnot json\n</tool_call> after")], []]
    steps, p = run(["<tool_call>{\"arguments\": {}}</tool_call>"])
    assert steps == [[("content", "<tool_call>{\"arguments\": {}}</tool_call>")], []]
    assert p.calls == []


def test_call_cut_before_it_was_announced_leaves_no_markup():
    """max_tokens inside `{"name": ...`: no call could be made; neither the tag nor the newline is content."""
    steps, p = run(["\n<tool_call>\n{\"name\": \"get_weather"])
    assert steps == [[], []] and p.calls == []
    steps, p = run(["I'll check.", "\n", "<tool_call>", "\n", '{"name": "get_weather", "argu'])
    assert [x for s in steps for x in s] == [("content", "I'll check.")] and p.calls == []
    steps, p = run(["x <tool_call>"])
    assert [x for s in steps for x in s] == [("content", "x ")]


def test_cut_block_that_cannot_be_a_call_stays_content():
    steps, p = run(["Use <tool_call> tags"])
    assert [x for s in steps for x in s] == [("content", "Use "), ("content", "<tool_call> tags")]


CUT_CALLS = [  # (generated text cut by max_tokens, the arguments the model produced)
    ('\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_', '{"city": "Paris"}'),
    ('\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n', '{"city": "Paris"}'),
    ('\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}', '{"city": "Paris"}'),
    ('\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}', '{"city": "Paris"}'),
    ('\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa', '{"city": "Pa'),
    ('\n<tool_call>\n{"name": "get_weather", "arguments": {"q": "}</tool_', '{"q": "}'),
    ('<tool_call>{"name":"f","arguments":{"a": [1, {"b": "]}"}]}}</tool_call', '{"a": [1, {"b": "]}"}]}'),
]


@pytest.mark.parametrize("text,args", CUT_CALLS)
def test_call_cut_off_keeps_exactly_the_arguments_the_model_produced(text, args):
    for cut in range(1, len(text)):
        steps, p = run([text[:cut], text[cut:]])
        pieces = [x for s in steps for x in s]
        assert [k for k, _ in pieces if k == "content"] == []
        assert "".join(v for k, v in pieces if k == "args") == args
        assert [c["function"] for c in p.calls] == [{"name": pieces[0][1]["function"]["name"], "arguments": args}]


def test_false_partial_tag_and_content_after_a_call():
    steps, p = run(["a<to", "p>", "<tool_call>{\"name\":\"f\"}</tool_call>", "\n\nDone."])
    assert steps == [[("content", "a")], [("content", "<top>")], [call(0, "f"), ("args", "{}")],
                     [("content", "\n\nDone.")], []]
