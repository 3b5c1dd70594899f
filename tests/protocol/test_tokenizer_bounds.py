"""engine/token_bounds.py: the lower bounds on a text's token count are proofs (never above the real count, on
the real Qwen3 tokenizer and on texts made to break them: added tokens, whitespace runs, combining marks,
Hangul jamo), they stop early on long texts, a text that fits is encoded exactly as the library encodes it,
and the library's encode that holds the GIL is not what runs."""
from __future__ import annotations

import random
import sys
import threading
import time
import unicodedata

import pytest
import tokenizers
from tokenizers import Regex, models, pre_tokenizers

from appliance.engine import token_bounds as tb
from appliance.engine.tokenizer import Tokenizer

PIECES = ["a", "b", "ab", " ", "  ", "\n", "\n\n", "  \n ", "\t", "'s", "'ll", "1", "234", ".", "==", "-" * 40,
          "x" * 50, " " * 30, "é", "e\u0301", "\u1100\u1161\u11a8", "한", "ΐ", "\u212a", "🙂", "<|im_start|>",
          "<|im_end|>", "<think>", "</think>", "<|", "|>", "user", " world"]


@pytest.fixture(scope="module")
def qwen(qwen_tokenizer_dir) -> Tokenizer:
    return Tokenizer.from_dir(qwen_tokenizer_dir)


def random_text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(PIECES) for _ in range(n))


def test_bounds_never_exceed_the_real_count(qwen):
    b = qwen._bounded
    assert b.prefix_bound and b.shrink == tb.NFC_SHRINK       # Qwen: NFC, its split regex is local
    rng = random.Random(22)
    tight = 0
    for _ in range(300):
        text = random_text(rng, rng.choice([20, 100, 400, 2000]))
        real = len(qwen._tk.encode(text, add_special_tokens=False).ids)
        for limit in (3, 10, 40, 200):                           # small limits: several prefixes per text
            lb = b.at_least(text, limit)
            assert lb <= real, (lb, real, limit, text[:300])
            tight += lb >= limit
    assert tight > 100  # the prefixes did prove something, not just 0


def test_a_long_text_is_refused_from_a_prefix(qwen):
    text = "a " * 500_000                      # 500k tokens; its bytes alone prove only 1,953
    assert tb.bytes_bound(text, qwen.max_token_bytes, qwen._bounded.shrink) < 4096
    with pytest.raises(tb.TooManyTokens) as e:
        qwen.encode_within(text, 4096)
    assert 4096 <= e.value.at_least <= 500_000
    assert e.value.at_least < 4096 * tb.PREFIX_CHARS_PER_TOKEN     # from the first prefix, not the whole text


def test_a_text_that_fits_is_encoded_exactly(qwen):
    rng = random.Random(5)
    for n in (1, 50, 3000):
        text = random_text(rng, n)
        ids = qwen._tk.encode(text, add_special_tokens=False).ids
        assert qwen.encode_within(text, len(ids) + 1) == ids == qwen.encode(text)


def test_encoding_releases_the_gil(qwen):
    """tokenizers' `encode` holds the GIL for its whole run (a 5 ms ticker thread woke 3 times in 2.3 s over a
    1 MB text); ours lets other threads run: the ticker wakes many times during one encode."""
    text = "a b " * 150_000
    ticks, stop = [], threading.Event()

    def tick():
        while not stop.is_set():
            time.sleep(0.002)
            ticks.append(time.perf_counter())
    t = threading.Thread(target=tick)
    t.start()
    time.sleep(0.05)
    t0 = time.perf_counter()
    qwen.encode(text)
    t1 = time.perf_counter()
    stop.set()
    t.join()
    during = [x for x in ticks if t0 <= x <= t1]
    assert t1 - t0 > 0.05 and len(during) >= 10, (t1 - t0, len(during))


def test_safe_cut_avoids_added_tokens_and_prefers_a_word_end():
    added = ["<|im_start|>", "<think>"]
    text = "x" * 3000 + "<|im_start|>user" + "y" * 3000
    for at in range(3001, 3012):                  # inside <|im_start|>, no space nearby: cut before it
        assert tb.safe_cut(text, at, added) == 3000
    assert tb.safe_cut(text, 3012, added) == 3012  # right after it
    text = "hello <|im_start|>user world"
    assert tb.safe_cut(text, 9, added) == 5        # after the word "hello", before its space
    text = "one two" + "x" * 2000
    assert tb.safe_cut(text, 5, []) == 3           # after "one", before the space
    assert tb.safe_cut(text, 1500, []) == 1500     # no space nearby: where asked


def test_complete_word_tokens_drops_the_last_words():
    assert tb.complete_word_tokens([0, 0, 1, 2, 2, 3, 4, 5, 6], margin=4) == 5   # words 0-2
    assert tb.complete_word_tokens([0, 0, 0], margin=4) == 0
    assert tb.complete_word_tokens([None, 0, 1, 2, 3, 4, 5], margin=4) == 2


def test_splitting_with_lookahead_gives_no_prefix_bound():
    vocab = {c: i for i, c in enumerate("abc ")}
    tk = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex(r"a(?=.*c)|\s+"), behavior="isolated")
    assert not tb.BoundedEncoder(tk, 1, byte_level=False).prefix_bound
    assert tb.BoundedEncoder(tk, 1, byte_level=False).shrink is None     # not byte-level: no bytes bound
    tk.pre_tokenizer = pre_tokenizers.Split(Regex(r"\s+(?!\S)|\s+|\w+"), behavior="isolated")
    assert tb.BoundedEncoder(tk, 1, byte_level=False).prefix_bound
    assert tb.normalizer_shrink({"type": "Lowercase"}) is None
    assert tb.normalizer_shrink({"type": "Sequence", "normalizers": [{"type": "NFC"}]}) == tb.NFC_SHRINK


def test_nfc_shrinks_utf8_by_less_than_nfc_shrink():
    """The most bytes any string canonically equivalent to one character can have, over that character's bytes:
    its decomposition split into runs, each run written as the longest character decomposing to it (Unicode of
    this Python; the margin to NFC_SHRINK covers other versions). The worst is 3.5 (U+1FBE U+0308 U+0301 ->
    U+0390); Hangul syllables from jamo and the Kelvin sign give 3."""
    size = lambda s: len(s.encode("utf-8", "surrogatepass"))
    longest: dict[str, int] = {}                                 # a decomposition -> its longest character
    composed = []
    for i in range(sys.maxunicode + 1):
        if 0xD800 <= i <= 0xDFFF:
            continue
        c = chr(i)
        d = unicodedata.normalize("NFD", c)
        if d != c:
            longest[d] = max(longest.get(d, size(d)), size(c))
            composed.append(c)
    worst = 0.0
    for y in composed + [p for p in longest if len(p) == 1]:
        if unicodedata.normalize("NFC", y) != y:
            continue
        p = unicodedata.normalize("NFD", y)
        best = [0] + [-1] * len(p)
        for j in range(1, len(p) + 1):
            for i in range(j):
                run = p[i:j]
                if best[i] >= 0 and (run in longest or len(run) == 1):
                    best[j] = max(best[j], best[i] + longest.get(run, size(run)))
        worst = max(worst, best[-1] / size(y))
    assert 3.0 <= worst < tb.NFC_SHRINK, worst
