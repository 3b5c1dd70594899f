"""The Qwen3 tokenizer.json we build from qwen.tiktoken encodes exactly like tiktoken."""
import tiktoken
import tokenizers

from appliance.tools.qwen_tokenizer import (
    FIRST_SPECIAL_ID,
    QWEN3_ADDED_TOKENS,
    QWEN_PATTERN,
    default_tiktoken_path,
    load_ranks,
)


def test_special_token_ids(qwen_tokenizer_dir):
    tk = tokenizers.Tokenizer.from_file(f"{qwen_tokenizer_dir}/tokenizer.json")
    assert len(QWEN3_ADDED_TOKENS) == 26
    for i, (content, _) in enumerate(QWEN3_ADDED_TOKENS):
        assert tk.token_to_id(content) == FIRST_SPECIAL_ID + i
    assert tk.token_to_id("</think>") == 151668


def test_smoke_matches_tiktoken(qwen_tokenizer_dir):
    tk = tokenizers.Tokenizer.from_file(f"{qwen_tokenizer_dir}/tokenizer.json")
    ranks = load_ranks(default_tiktoken_path())
    special = {c: FIRST_SPECIAL_ID + i for i, (c, _) in enumerate(QWEN3_ADDED_TOKENS)}
    ref = tiktoken.Encoding("qwen", pat_str=QWEN_PATTERN, mergeable_ranks=ranks, special_tokens=special)
    for text in ["Hello world!", "你好，世界！", "emoji 😀👍🏽", "<|im_start|>user\nhi<|im_end|>"]:
        assert tk.encode(text).ids == ref.encode(text, allowed_special="all")
