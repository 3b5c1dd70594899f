"""IncrementalDetokenizer (UTF-8 holdback) and StopMatcher (stop-string holdback) edge cases."""
from __future__ import annotations

import random

import pytest

from appliance.engine.text_stream import IncrementalDetokenizer, StopMatcher
from appliance.engine.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(qwen_tokenizer_dir) -> Tokenizer:
    return Tokenizer.from_dir(qwen_tokenizer_dir)


class ByteTokens:
    """A unit-test tokenizer: token id i stands for the bytes pieces[i]."""

    def __init__(self, pieces: list[bytes], special: set[int] = frozenset()):
        self.pieces, self.special = pieces, special

    def token_bytes(self, token_id: int, skip_special_tokens: bool = True) -> bytes:
        return b"" if skip_special_tokens and token_id in self.special else self.pieces[token_id]


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.push(i) for i in ids] + [detok.flush()]


# -- IncrementalDetokenizer ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("text", ["龘", "𠀀 rare", "👨‍👩‍👧‍👦 family", "ᚠᚢᚦ", "鱻麤 靐", "a🫠b", "\U000e0067 tag"])
def test_real_tokens_that_split_characters(tok, text):
    ids = tok.encode(text)
    partial = [i for i in ids if not _decodes(tok.token_bytes(i))]
    assert partial, f"expected {text!r} to contain a token ending mid-character: {ids}"
    d = IncrementalDetokenizer(tok)
    outs = stream(d, ids)
    assert "".join(outs) == text
    assert "\ufffd" not in "".join(outs)
    # some token's bytes were held back entirely (it released nothing although it carried bytes)
    assert any(out == "" and tok.token_bytes(i) for i, out in zip(ids, outs))


def test_every_prefix_released_is_whole_text(tok):
    text = "中文😀混合👍🏽テキスト🇯🇵 and 𠀀𠀁 end龘"
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok)
    released = ""
    for n, i in enumerate(ids, 1):
        released += d.push(i)
        # released text is exactly the longest complete-character prefix of the bytes so far
        so_far = b"".join(tok.token_bytes(j) for j in ids[:n])
        assert released == so_far.decode("utf-8", errors="ignore")[: len(released)]
        assert text.startswith(released)
        assert len(so_far) - len(released.encode()) <= 3  # at most one incomplete character held back
    assert released + d.flush() == text


def test_stream_equals_decode_for_arbitrary_ids(tok):
    # random ids, biased to non-ASCII fragments: includes invalid sequences, which must become U+FFFD exactly
    # as the tokenizer's own decode() does, and ids past the vocabulary, which decode to nothing
    fragments = [i for i in range(0, 151643, 3) if not tok.token_bytes(i).isascii()]
    rng = random.Random(7)
    for _ in range(600):
        ids = [rng.choice(fragments) if rng.random() < 0.7 else rng.randrange(151936) for _ in range(rng.randint(1, 10))]
        assert "".join(stream(IncrementalDetokenizer(tok), ids)) == tok.decode(ids), ids


def test_special_tokens_skipped_or_kept(tok):
    ids = tok.encode("<|im_start|>hi<think>x</think><|im_end|>")
    assert "".join(stream(IncrementalDetokenizer(tok), ids)) == "hi<think>x</think>"
    kept = "".join(stream(IncrementalDetokenizer(tok, skip_special_tokens=False), ids))
    assert kept == "<|im_start|>hi<think>x</think><|im_end|>"


def test_hand_built_split_two_byte_character():
    d = IncrementalDetokenizer(ByteTokens([b"caf", b"\xc3", b"\xa9", b"!"]))
    assert d.push(0) == "caf"
    assert d.push(1) == "" and d.pending
    assert d.push(2) == "é" and not d.pending
    assert d.push(3) == "!"
    assert d.flush() == ""


def test_hand_built_emoji_one_byte_per_token():
    d = IncrementalDetokenizer(ByteTokens([bytes([b]) for b in "😀".encode()]))
    assert stream(d, [0, 1, 2, 3]) == ["", "", "", "😀", ""]


def test_hand_built_character_completed_inside_a_longer_token():
    # token 1 ends the first character and starts the next one
    d = IncrementalDetokenizer(ByteTokens([b"\xe4\xbd", b"\xa0\xe5", b"\xa5\xbd"]))
    assert stream(d, [0, 1, 2]) == ["", "你", "好", ""]


def test_text_at_the_very_end_is_never_lost():
    d = IncrementalDetokenizer(ByteTokens([b"ok ", b"\xe4\xbd"]))
    assert d.push(0) == "ok "
    assert d.push(1) == ""
    assert d.flush() == "\ufffd"  # an unfinished character at the end becomes one replacement character
    assert d.flush() == ""  # and only once
    d2 = IncrementalDetokenizer(ByteTokens([b"end"]))
    assert d2.push(0) == "end" and d2.flush() == ""


def test_invalid_bytes_become_replacement_characters():
    d = IncrementalDetokenizer(ByteTokens([b"\xff", b"a\xe4", b"b", b"\x80\x80"]))
    assert d.push(0) == "\ufffd"
    assert d.push(1) == "a"
    assert d.push(2) == "\ufffdb"  # lead byte followed by ASCII: the lead byte is invalid
    assert d.push(3) == "\ufffd\ufffd"
    assert d.flush() == ""


def test_detokenizer_is_reusable_after_flush():
    d = IncrementalDetokenizer(ByteTokens([b"\xe4", b"\xbd\xa0"]))
    assert d.push(0) == "" and d.flush() == "\ufffd"
    assert d.push(1) == "\ufffd\ufffd"  # a fresh stream: continuation bytes with no lead are invalid


def _decodes(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


# -- StopMatcher ---------------------------------------------------------------------------------------------------

def run(stops, chunks):
    m = StopMatcher(stops)
    out, stopped = [], False
    for c in chunks:
        r, stopped = m.push(c)
        out.append(r)
        if stopped:
            break
    tail = m.flush()
    return out, stopped, tail, m


def test_stop_split_across_tokens():
    out, stopped, tail, m = run(["</answer>"], ["The end", "</ans", "wer> more"])
    assert out == ["The end", "", ""] and stopped and tail == "" and m.matched == "</answer>"


def test_stop_at_the_very_start():
    assert run(["STOP"], ["STOP here"])[:3] == ([""], True, "")
    assert run(["STOP"], ["ST", "OP", "more"])[:3] == (["", ""], True, "")


def test_stop_inside_one_chunk_releases_text_before_it():
    out, stopped, tail, _ = run(["\n\n"], ["one\n\ntwo"])
    assert out == ["one"] and stopped and tail == ""


def test_held_back_tail_that_is_not_a_stop_is_released():
    out, stopped, tail, m = run(["</s>"], ["a<", "/x", "y"])
    assert out == ["a", "</x", "y"] and not stopped and tail == ""
    out, stopped, tail, _ = run(["</s>"], ["a</"])
    assert out == ["a"] and not stopped and tail == "</"  # released at the end, never lost


def test_held_tail_restarts_inside_itself():
    # "aab": the held "aa" fails, but its own tail "a" + "b" completes the stop
    out, stopped, tail, _ = run(["ab"], ["xa", "a", "b"])
    assert "".join(out) == "xa" and stopped and tail == ""
    out, stopped, tail, _ = run(["aab"], ["a", "a", "a", "b", "c"])
    assert "".join(out) == "a" and stopped


def test_overlapping_stops():
    out, stopped, _, m = run(["abc", "bcd"], ["x", "ab", "cd"])
    assert "".join(out) == "x" and stopped and m.matched == "abc"
    out, stopped, _, m = run(["abc", "bcd"], ["xab", "d"])
    assert "".join(out) == "xabd" and not stopped  # "abd": neither stop


def test_stop_contained_in_a_longer_stop_completes_first():
    # "bc" completes before "abcd" could: it wins however the text is chunked
    for chunks in (["abcd"], ["a", "b", "c", "d"], ["ab", "cd"]):
        out, stopped, _, m = run(["abcd", "bc"], chunks)
        assert "".join(out) == "a" and stopped and m.matched == "bc", chunks


def test_stop_that_is_a_prefix_of_another():
    for stops in (["foo", "foobar"], ["foobar", "foo"]):
        out, stopped, _, m = run(stops, ["xx fo", "obar"])
        assert "".join(out) == "xx " and stopped and m.matched == "foo"


def test_same_end_earliest_start_wins():
    out, stopped, _, m = run(["world", "hello world"], ["say hello wor", "ld"])
    assert "".join(out) == "say " and m.matched == "hello world"


def test_multiple_stops_earliest_wins():
    out, stopped, _, m = run(["world", "hello"], ["say hello world"])
    assert out == ["say "] and m.matched == "hello"
    out, stopped, _, m = run(["world", "hello"], ["say hel", "lo world"])
    assert "".join(out) == "say " and m.matched == "hello"


def test_empty_stop_list_passes_everything_through():
    for stops in ([], [""]):
        m = StopMatcher(stops)
        assert m.push("any text</s>") == ("any text</s>", False)
        assert m.push("") == ("", False)
        assert m.flush() == ""


def test_after_a_stop_nothing_more_is_released():
    m = StopMatcher(["x"])
    assert m.push("abxcd") == ("ab", True)
    assert m.push("more") == ("", True)
    assert m.flush() == ""


def test_unicode_stops():
    out, stopped, _, m = run(["。", "👍🏽"], ["好的", "👍", "🏽 ok"])
    assert "".join(out) == "好的" and stopped and m.matched == "👍🏽"


def reference_cut(text: str, stops: list[str]) -> tuple[str, bool]:
    """The whole text at once: cut at the stop that ends first (ties: starts first)."""
    found = [(text.find(s) + len(s), text.find(s)) for s in stops if s and s in text]
    if not found:
        return text, False
    return text[: min(found)[1]], True


def test_random_chunkings_agree_with_whole_text_and_hold_back_minimally():
    rng = random.Random(3)
    for _ in range(3000):
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(0, 3))]
        text = "".join(rng.choice("abcd") for _ in range(rng.randint(0, 20)))
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 6))))
        chunks = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        m = StopMatcher(stops)
        released, stopped, seen = "", False, ""
        for c in chunks:
            r, stopped = m.push(c)
            released += r
            seen += c
            if stopped:
                break
            # held back: exactly the longest tail that is a proper prefix of a stop
            want = max((k for k in range(1, len(seen) + 1)
                        if any(len(s) > k and s.startswith(seen[-k:]) for s in stops)), default=0)
            assert m.held == (seen[-want:] if want else "") and released + m.held == seen
        released += m.flush()
        assert (released, stopped) == reference_cut(text, stops), (stops, chunks)


# -- both together, as generation uses them ------------------------------------------------------------------------

def test_detokenizer_then_stop_matcher_on_real_tokens(tok):
    text = "答案：𠀀龘👨‍👩‍👧‍👦 END of story"
    ids = tok.encode(text)
    d, m = IncrementalDetokenizer(tok), StopMatcher(["👩‍👧", " END"])
    out = []
    for i in ids:
        r, stopped = m.push(d.push(i))
        out.append(r)
        if stopped:
            break
    assert stopped and "".join(out) == "答案：𠀀龘👨\u200d" and m.matched == "👩‍👧"
