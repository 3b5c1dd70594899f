"""gguf_tokenizer: building a Tokenizer from GGUF metadata (unit tests; tokenization against llama.cpp's own is
in test_gguf_llama_cpp.py, against the Hugging Face tokenizer.json in test_convert.py)."""
from __future__ import annotations

import pytest

from appliance.engine.gguf_tokenizer import GGUFTokenizerError, build_tokenizer, chat_templates, eog_ids

NORMAL, CONTROL, USER = 1, 3, 4


def tiny_meta(**over) -> dict:
    tokens = ["a", "b", "ab", "Ġ", "Ġa", "1", "2", "12", "<|im_end|>", "<|endoftext|>", "<think>", "<|im_start|>"]
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [NORMAL] * 8 + [CONTROL, CONTROL, USER, CONTROL],
            "tokenizer.ggml.merges": ["a b", "Ġ a", "1 2"], "tokenizer.ggml.eos_token_id": 9,
            "tokenizer.ggml.bos_token_id": 9}
    meta.update(over)
    return meta


def test_bpe_merges_and_added_tokens():
    tk = build_tokenizer(tiny_meta())
    assert tk.encode("ab a") == [2, 4]
    assert tk.encode("<think>ab<|im_end|>") == [10, 2, 8]
    assert tk.decode([10, 2, 8]) == "<think>ab"  # control tokens skipped, user-defined kept
    assert tk.token_bytes(4) == b" a" and tk.token_bytes(8) == b""
    assert tk.eos_token == "<|endoftext|>"


@pytest.mark.parametrize("pre, ids", [("qwen2", [5, 6]), ("smollm", [5, 6]), ("llama-bpe", [7]), ("gpt2", [7])])
def test_digit_splitting_follows_pre(pre, ids):
    """qwen2 and smollm split every digit; llama-bpe groups up to three; gpt2 keeps runs."""
    assert build_tokenizer(tiny_meta(**{"tokenizer.ggml.pre": pre})).encode("12") == ids


def test_refusals():
    with pytest.raises(GGUFTokenizerError, match="pre-tokenizer 'falcon'"):
        build_tokenizer(tiny_meta(**{"tokenizer.ggml.pre": "falcon"}))
    with pytest.raises(GGUFTokenizerError, match="tokenizer model 'llama'"):
        build_tokenizer(tiny_meta(**{"tokenizer.ggml.model": "llama"}))
    with pytest.raises(GGUFTokenizerError, match="token types"):
        build_tokenizer(tiny_meta(**{"tokenizer.ggml.token_type": [NORMAL]}))


def test_end_of_generation_ids():
    # eos (9) plus the control token <|im_end|> by name; <|im_start|> is control but not an end
    assert eog_ids(tiny_meta()) == {8, 9}
    meta = tiny_meta(**{"tokenizer.ggml.token_type": [NORMAL] * 8 + [NORMAL, CONTROL, USER, CONTROL]})
    assert eog_ids(meta) == {9}  # a *normal* token spelled <|im_end|> does not stop generation


def test_chat_templates():
    assert chat_templates(tiny_meta()) is None
    assert chat_templates(tiny_meta(**{"tokenizer.chat_template": "T"})) == "T"
    named = chat_templates(tiny_meta(**{"tokenizer.chat_template": "T", "tokenizer.chat_template.tool_use": "U",
                                        "tokenizer.chat_templates": ["tool_use"]}))
    assert named == {"default": "T", "tool_use": "U"}


def test_merge_pairs_in_chunks_equals_rule_by_rule():
    from appliance.engine.gguf_tokenizer import MERGE_CHUNK, merge_pairs
    rules = [f"Ġa{i} b{i}" for i in range(2 * MERGE_CHUNK + 5)]
    assert merge_pairs(rules) == [tuple(r.split(" ", 1)) for r in rules]
    odd = rules[:MERGE_CHUNK + 3] + ["x y z"]        # a piece with a space: the rule-by-rule way, whole list
    assert merge_pairs(odd) == [tuple(r.split(" ", 1)) for r in odd]
