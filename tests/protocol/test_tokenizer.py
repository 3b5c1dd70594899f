"""appliance.engine.tokenizer against tiktoken (the reference for Qwen's rank file) on a varied corpus."""
from __future__ import annotations

import random
import unicodedata

import pytest
import tiktoken
import tokenizers
from tokenizers import decoders, models

from appliance.engine.tokenizer import Tokenizer
from appliance.tools.qwen_tokenizer import (
    FIRST_SPECIAL_ID,
    QWEN3_ADDED_TOKENS,
    QWEN_PATTERN,
    default_tiktoken_path,
    load_ranks,
)

SPECIALS = [c for c, _ in QWEN3_ADDED_TOKENS]

PIECES = {
    "english": ["Hello, world!", "The quick brown fox jumps over the lazy dog.", "I'm sure you've seen it; they'll say we'd",
                "DON'T SHOUT, IT'S RUDE", "e-mail: someone@example.com", "https://example.org/a?b=c&d=e#f",
                "Mr. O'Neil's co-op (est. 1999)", "a", "A.B.C.", "well...  ok?!", "\"quoted\" and 'single'"],
    "chinese": ["你好，世界！", "我们今天去公园散步吧。", "机器学习是人工智能的一个分支", "《红楼梦》是中国古典小说", "中文，標點；符號：「引號」",
                "一二三四五六七八九十", "繁體中文與简体中文"],
    "code": ["def f(x):\n    return x ** 2\n", "for (int i = 0; i < n; ++i) { sum += a[i]; }", "    if x:\n\t\treturn None",
             "SELECT * FROM users WHERE id = 42;", "const re = /^[a-z]+$/gi;", "{\"key\": [1, 2.5, null, true]}",
             "#include <stdio.h>\nint main(void){printf(\"%d\\n\", 1);}", "x=>x*2 // arrow", "$ ls -la | grep '.py'"],
    "emoji": ["😀", "👍🏽", "👨‍👩‍👧‍👦", "🏳️‍🌈", "🇯🇵🇫🇷🇺🇸", "1️⃣2️⃣#️⃣", "❤️‍🔥", "🧑🏿‍💻", "👩🏻‍🤝‍👩🏼", "🐍🦀🐹", "☺︎ ☺️",
              "🏴󠁧󠁢󠁳󠁣󠁴󠁿"],
    "whitespace": ["   ", "\t\t", "\n\n\n", "\r\n", " \n ", "\u00a0\u00a0", "\u3000", "  \t \n\t  ", "\n \n  \n   ",
                   "\u2003\u2009"],
    "numbers": ["0", "42", "3.14159", "1,000,000", "-273.15", "12345678901234567890", "1e-9", "0x1F", "٣٤٥", "①②③",
                "Ⅻ", "½ ¾"],
    "scripts": ["Привет, мир!", "こんにちは世界、カタカナ", "안녕하세요 세계", "مرحبا بالعالم", "שלום עולם", "नमस्ते दुनिया",
                "สวัสดีชาวโลก", "Γειά σου Κόσμε", "Ελληνικά ΚΕΦΑΛΑΙΑ", "Tiếng Việt có dấu", "Straße Größe Ölfaß",
                "ሰላም ለዓለም", "ᚠᚢᚦᚨᚱᚲ"],
    "special": SPECIALS,
    "symbols": ["→←↑↓", "∑∫√∞≠≤", "©®™", "€£¥₹", "~!@#$%^&*()_+", "<<<>>>", "----", "====", "|||", "‽⁂"],
}
SEPARATORS = ["", " ", "  ", "\n", "\t", ", ", "\n\n", " \n", "。"]

HANDWRITTEN = [
    "", " ", "\n", "Hello world", "hello\nworld\n", "  leading and trailing  ", "tab\tseparated\tvalues",
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<think>\nLet me think about 这个问题 🤔\n</think>\n\nAnswer: 42",
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"北京\"}}\n</tool_call>",
    "<tool_response>\n{\"temp\": 21.5}\n</tool_response>", "<|endoftext|><|endoftext|>", "<|im_end|>trailing",
    "not a special: <|im_start |> <think > </ think>", "<|fim_prefix|>def a():<|fim_suffix|>\n<|fim_middle|>",
    "<|vision_start|><|image_pad|><|vision_end|>describe", "word<|box_start|>(1,2),(3,4)<|box_end|>word",
    "😀😀😀😀😀", "👨‍👩‍👧‍👦👨‍👩‍👧‍👦", "emoji at end 🇺🇳", "🇦🇧🇨🇩", "a👍🏽b👍🏿c", "中😀文", "中文English混合テキスト",
    "Ünïcödé àçcéntś", "12345", "1234567", "0.000001", "100%", "$1,234.56", "v1.2.3-rc.4+build.5",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", "!!!!!!!!!!!!!!!!!!!!", "          x", "x          ",
    "line1\r\nline2\r\n\r\nline3", "\n\n\n\nfour newlines then text", "'s 't 're 've 'm 'll 'd", "'S 'T 'RE 'VE 'M 'LL 'D",
    "don't won't can't shouldn't", "It's 5 o'clock", "\u200b zero width \u200d joiner \ufeff bom",
    "mixed\u00a0nbsp and\u202fnarrow", "Ω≈ç√∫˜µ≤≥÷", "ﬁ ﬂ ligatures", "ｆｕｌｌｗｉｄｔｈ　ｔｅｘｔ", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕄𝕒𝕥𝕙",
    "𠀀𠀁𠀂 rare CJK ext B", "ʕ•ᴥ•ʔ", "¯\\_(ツ)_/¯", "<html><body class=\"x\">Hi &amp; bye</body></html>",
    "    def method(self):\n        '''Doc.'''\n        pass\n\n\n", "print('hello')  # comment\n",
]


def generated_texts(n: int = 260, seed: int = 1234) -> list[str]:
    rng = random.Random(seed)
    kinds = list(PIECES)
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(1, 7)):
            parts.append(rng.choice(PIECES[rng.choice(kinds)]))
            parts.append(rng.choice(SEPARATORS))
        if rng.random() < 0.3:  # whitespace runs of random length and mix
            parts.insert(rng.randrange(len(parts) + 1), "".join(rng.choice(" \t\n") for _ in range(rng.randint(1, 9))))
        if rng.random() < 0.2:  # long digit runs
            parts.append("".join(rng.choice("0123456789") for _ in range(rng.randint(1, 25))))
        out.append("".join(parts))
    return out


CORPUS = HANDWRITTEN + generated_texts()


@pytest.fixture(scope="module")
def tok(qwen_tokenizer_dir) -> Tokenizer:
    return Tokenizer.from_dir(qwen_tokenizer_dir)


@pytest.fixture(scope="module")
def ref() -> tiktoken.Encoding:
    special = {c: FIRST_SPECIAL_ID + i for i, c in enumerate(SPECIALS)}
    return tiktoken.Encoding("qwen", pat_str=QWEN_PATTERN, mergeable_ranks=load_ranks(default_tiktoken_path()),
                             special_tokens=special)


def test_corpus_is_large_and_varied():
    assert len(set(CORPUS)) >= 300
    joined = "".join(CORPUS)
    for kind, pieces in PIECES.items():
        assert sum(p in joined for p in pieces) >= len(pieces) // 2, kind
    assert all(s in joined for s in SPECIALS)


def test_encode_matches_tiktoken(tok, ref):
    mismatches = [t for t in CORPUS if tok.encode(t) != ref.encode(t, allowed_special="all")]
    assert not mismatches, f"{len(mismatches)} texts differ, first: {mismatches[0]!r}"


def test_nfc_normalization_like_the_real_qwen_tokenizer(tok, ref):
    # Qwen's tokenizer.json normalizes to NFC; tiktoken does not. Decomposed input encodes like its NFC form.
    for text in ["e\u0301cole", "A\u030angstro\u0308m", "\u1100\u1161\u11a8 jamo", "n\u0303 and Å"]:
        nfc = unicodedata.normalize("NFC", text)
        assert nfc != text
        assert tok.encode(text) == ref.encode(nfc, allowed_special="all")


def test_decode_round_trips(tok):
    for text in CORPUS:
        ids = tok.encode(text)
        assert tok.decode(ids, skip_special_tokens=False) == text


def test_token_bytes_concatenate_to_the_text(tok):
    for text in CORPUS:
        ids = tok.encode(text)
        assert b"".join(tok.token_bytes(i, skip_special_tokens=False) for i in ids) == text.encode("utf-8")
        skipped = b"".join(tok.token_bytes(i) for i in ids)
        assert skipped == tok.decode(ids, skip_special_tokens=True).encode("utf-8")


def test_token_bytes_of_every_vocab_entry_match_tiktoken(tok, ref):
    for i in range(0, FIRST_SPECIAL_ID, 7):
        assert tok.token_bytes(i) == ref.decode_single_token_bytes(i), i


def test_special_tokens(tok):
    assert tok.vocab_size == 151669 == len(tok)
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 151645
    assert tok.bos_token is None and tok.bos_token_id is None
    assert tok.special_tokens["pad_token"] == "<|endoftext|>"
    for i, (content, special) in enumerate(QWEN3_ADDED_TOKENS):
        tid = FIRST_SPECIAL_ID + i
        assert tok.id_of(content) == tid
        assert (tid in tok.special_ids) == special
        assert tok.token_bytes(tid) == (b"" if special else content.encode())
        assert tok.token_bytes(tid, skip_special_tokens=False) == content.encode()
    assert len(tok.special_ids) == 14
    assert tok.id_of("no such token") is None
    assert tok.id_of("Ġthe") == tok.encode(" the")[0]


def test_no_bos_added_and_specials_in_text_recognised(tok):
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 151644 and ids[-1] == 151645
    assert tok.encode("hi") == tok.encode("hi", add_special_tokens=True)  # Qwen has no post-processor
    assert tok.encode("<think>x</think>") == [151667, 87, 151668]
    assert tok.decode(tok.encode("<|im_start|>a<think>b</think>")) == "a<think>b</think>"


def test_unknown_ids_decode_to_nothing(tok):
    # Qwen3 checkpoints pad the embedding matrix to 151936 rows; a random model can emit those ids.
    assert tok.token_bytes(151700) == b"" and tok.token_bytes(151935) == b"" and tok.token_bytes(10**9) == b""
    assert tok.decode([151700, 9707]) == "Hello"


def test_encode_rejects_non_strings(tok):
    with pytest.raises(TypeError):
        tok.encode(b"bytes")


def test_from_tokenizers_object_with_explicit_special_info(qwen_tokenizer_dir):
    raw = tokenizers.Tokenizer.from_file(f"{qwen_tokenizer_dir}/tokenizer.json")
    t = Tokenizer(raw, eos_token="<|endoftext|>", special_ids=[151643, 151645])
    assert t.eos_token_id == 151643 and t.special_ids == {151643, 151645}
    assert t.token_bytes(151644) == b"<|im_start|>" and t.token_bytes(151645) == b""
    assert t.token_bytes(t.encode("你")[0]) == "你".encode()
    with pytest.raises(ValueError):
        Tokenizer(raw, eos_token="<|not-there|>")


def test_sentencepiece_style_vocabulary():
    # byte-fallback BPE with the ▁ space marker (Llama/Gemma style, as a GGUF may carry)
    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    vocab.update({"▁": 256, "h": 257, "i": 258, "▁h": 259, "▁hi": 260})
    bpe = models.BPE(vocab=vocab, merges=[("▁", "h"), ("▁h", "i")], byte_fallback=True)
    raw = tokenizers.Tokenizer(bpe)
    raw.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    t = Tokenizer(raw)
    ids = raw.encode("▁hi▁你").ids
    assert ids[0] == 260 and len(ids) == 5  # ▁hi, ▁, then the three UTF-8 bytes of 你 as byte tokens
    assert b"".join(t.token_bytes(i) for i in ids) == " hi 你".encode()
    assert t.token_bytes(0xE4) == b"\xe4"
