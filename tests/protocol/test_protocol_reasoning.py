"""ReasoningSplitter: <think> blocks to reasoning_content, tags split across tokens, Qwen3's whitespace rules."""
from __future__ import annotations

import itertools
import random

import pytest

from appliance.protocol.reasoning import ReasoningSplitter, prompt_ends_in_reasoning, split_reasoning


def run(chunks, in_reasoning=False):
    s = ReasoningSplitter(in_reasoning)
    out = []
    for c in chunks:
        out.append(s.push(c))
    out.append(s.flush())
    return out


def joined(chunks, in_reasoning=False):
    pieces = [p for step in run(chunks, in_reasoning) for p in step]
    r = "".join(t for k, t in pieces if k == "reasoning")
    c = "".join(t for k, t in pieces if k == "content")
    return r, c


def test_plain_content_passes_straight_through():
    assert run(["Hello", " world"]) == [[("content", "Hello")], [("content", " world")], []]


def test_qwen3_thinking_output_per_token():
    toks = ["<think>", "\n", "Let", " me", " think", ".\n", "</think>", "\n\n", "The", " answer"]
    steps = run(toks)
    assert steps == [[], [], [("reasoning", "Let")], [("reasoning", " me")], [("reasoning", " think")],
                     [("reasoning", ".")], [], [], [("content", "The")], [("content", " answer")], []]


def test_tags_split_across_pushes_are_held_back():
    steps = run(["<th", "ink>ab", "c</", "thi", "nk>x"])
    assert steps == [[], [("reasoning", "ab")], [("reasoning", "c")], [], [("content", "x")], []]


def test_a_false_partial_tag_is_released():
    # "<t" could start <think>; "<tag>" proves it does not
    assert run(["a <t", "ag>"]) == [[("content", "a ")], [("content", "<tag>")], []]
    # held back at the very end: flushed as text of the current kind
    assert run(["x<thi"]) == [[("content", "x")], [("content", "<thi")]]
    assert run(["r</thi"], in_reasoning=True) == [[("reasoning", "r")], [("reasoning", "</thi")]]


def test_prompt_that_opened_the_think_block():
    assert run(["\nplan", "</think>", "\n\nok"], in_reasoning=True) == \
        [[("reasoning", "plan")], [], [("content", "ok")], []]
    assert prompt_ends_in_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_ends_in_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_ends_in_reasoning("<|im_start|>assistant\n")


def test_newlines_inside_reasoning_survive_only_trailing_ones_dropped():
    assert joined(["<think>\n\na\n\nb\n", "\n</think>\n\nc\n"]) == ("a\n\nb", "c\n")
    # reasoning that ends without </think> (length cut) drops its trailing newlines at flush
    assert joined(["<think>\nhalf way\n"]) == ("half way", "")


def test_one_push_with_everything():
    assert run(["pre<think>r</think>post"]) == [[("content", "pre"), ("reasoning", "r"), ("content", "post")], []]


def test_split_reasoning_whole_text():
    assert split_reasoning("<think>\nr\n</think>\n\nc") == ("r", "c")
    assert split_reasoning("just content") == (None, "just content")
    assert split_reasoning("<think>\n\n</think>\n\nc") == ("", "c")
    assert split_reasoning("r2\n</think>\n\nc", in_reasoning=True) == ("r2", "c")


def _template_split(text: str) -> tuple[str, str]:
    """What Qwen3's chat template stores back for an assistant turn (its own split, see the fixture)."""
    reasoning = text.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
    content = text.split("</think>")[-1].lstrip("\n")
    return reasoning, content


@pytest.mark.parametrize("seed", range(20))
def test_any_tokenisation_gives_the_same_split_as_the_chat_template(seed):
    rng = random.Random(seed)
    words = ["a", "b", "\n", " ", "<", ">", "/", "think", "é", "你"]
    while True:     # random text with tag-like debris, but no complete tag
        reasoning = "".join(rng.choice(words) for _ in range(rng.randint(0, 12))).strip("\n")
        content = "".join(rng.choice(words) for _ in range(rng.randint(0, 12))).lstrip("\n")
        if "think>" not in reasoning and "think>" not in content:
            break
    text = "<think>\n" + reasoning + "\n</think>\n\n" + content
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(0, 12))))
    chunks = [text[i:j] for i, j in itertools.pairwise([0, *cuts, len(text)])]
    assert joined(chunks) == _template_split(text) == (reasoning.strip("\n"), content)
