"""Tokenizer and chat template from a GGUF file's `tokenizer.*` metadata (llama.cpp's key names).

Policies:
- Only byte-level BPE vocabularies (`tokenizer.ggml.model == "gpt2"`) are built: SmolLM2, Qwen2/2.5/3 and
  Llama 3 all use it. SentencePiece (`llama`) and other models are refused with a clear error, never guessed.
- Text is split before BPE the way the vocabulary was trained, chosen by `tokenizer.ggml.pre` (the same
  names llama.cpp uses): `qwen2` (its regex, NFC first as Qwen's own tokenizer.json does), `qwen35` (Qwen3.5's
  regex: letters keep their combining marks; no NFC, as llama.cpp's own tokenizer test for it expects), `llama-bpe`
  (Llama 3's regex, digits in runs of up to three), `smollm` (every digit alone, then GPT-2's regex),
  `gpt2`/`default` (GPT-2's regex). An unknown name is refused: a wrong split silently changes token ids.
- Token types follow llama.cpp: CONTROL tokens (<|im_start|>, <|endoftext|>) are added special tokens,
  skipped when decoding; USER_DEFINED ones (<think>, <tool_call>) are added tokens that decode as text.
  Both are matched whole in input text, like transformers' added tokens.
- End-of-generation ids: eos, eot and eom ids from the metadata, plus the CONTROL tokens llama.cpp itself
  treats as end of generation by name (<|im_end|>, <|endoftext|>, <|eot_id|>, <|eom_id|>, ...): a chat
  model whose GGUF names <|endoftext|> as eos still stops at <|im_end|>.
"""
from __future__ import annotations

from typing import Any, Callable, cast

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from .tokenizer import Tokenizer

QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen3.5's 248K vocabulary: letters take their combining marks (\p{M}) along
QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")

# token types (gguf.TokenType)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
EOG_NAMES = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>",
             "<|end_of_text|>", "</s>")


class GGUFTokenizerError(ValueError):
    """The GGUF's tokenizer metadata describes a tokenizer we do not build."""


def _split_then_bytes(regex: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(regex), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _gpt2() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _smollm() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])


# tokenizer.ggml.pre -> (pre-tokenizer builder, NFC normalization)
PRE_TOKENIZERS: dict[str, tuple[Callable[[], pre_tokenizers.PreTokenizer], bool]] = {
    "qwen2": (lambda: _split_then_bytes(QWEN2_SPLIT), True),
    "deepseek-r1-qwen": (lambda: _split_then_bytes(QWEN2_SPLIT), True),
    "qwen35": (lambda: _split_then_bytes(QWEN35_SPLIT), False),
    "llama-bpe": (lambda: _split_then_bytes(LLAMA3_SPLIT), False),
    "llama3": (lambda: _split_then_bytes(LLAMA3_SPLIT), False),
    "smollm": (_smollm, False),
    "gpt2": (_gpt2, False),
    "gpt-2": (_gpt2, False),
    "default": (_gpt2, False),
}


def build_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """meta: the GGUF key/value pairs (decoded). Returns our Tokenizer over a `tokenizers` BPE model."""
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise GGUFTokenizerError(f"tokenizer model {model!r} is not supported (only byte-level BPE 'gpt2')")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if not isinstance(pre, str) or pre not in PRE_TOKENIZERS:
        raise GGUFTokenizerError(f"pre-tokenizer {pre!r} is not supported (supported: {', '.join(sorted(PRE_TOKENIZERS))})")
    tokens, types, merges = checked_vocab(meta)
    # padding entries may repeat; the first id wins (dict() keeps the last value given: feed ids high to low)
    vocab: dict[str, int] = dict(zip(reversed(tokens), range(len(tokens) - 1, -1, -1)))
    try:  # a merge of tokens not in the vocabulary is refused by the library (with a bare Exception)
        tk = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merge_pairs(merges), fuse_unk=False,
                                             byte_fallback=False))
    except Exception as e:
        raise GGUFTokenizerError(f"tokenizer.ggml.merges: {e}") from None
    build_pre, nfc = PRE_TOKENIZERS[pre]
    tk.pre_tokenizer = build_pre()
    if nfc:
        tk.normalizer = normalizers.NFC()
    tk.decoder = decoders.ByteLevel()
    added = [(i, AddedToken(tokens[i], special=(ty == CONTROL), normalized=False))
             for i, ty in enumerate(types) if ty in (CONTROL, USER_DEFINED) and vocab.get(tokens[i]) == i]
    tk.add_special_tokens([a for _, a in added if a.special])
    tk.add_tokens([a for _, a in added if not a.special])
    named = {}
    for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"), ("pad_token", "padding")):
        i = token_id(meta, key, len(tokens))
        if i is not None:
            named[name] = tokens[i]
    return Tokenizer(tk, special_tokens=named, byte_level=True, vocab=vocab)


MERGE_CHUNK = 8192   # rules per join/split: each is one C call holding the GIL (all of Qwen3's at once: 0.4 s)


def checked_vocab(meta: dict[str, Any]) -> tuple[list[str], list[int], list[str]]:
    """tokens, token types and merge rules, each of the type it must be (GGUFTokenizerError naming the key)."""
    tokens, types = meta.get("tokenizer.ggml.tokens"), meta.get("tokenizer.ggml.token_type")
    merges = meta.get("tokenizer.ggml.merges")
    if not isinstance(tokens, list) or not tokens or not all(type(t) is str for t in tokens):
        raise GGUFTokenizerError("tokenizer.ggml.tokens must be a non-empty array of strings")
    if types is None:
        types = [NORMAL] * len(tokens)
    if not isinstance(types, list) or not all(type(t) is int for t in types):
        raise GGUFTokenizerError("tokenizer.ggml.token_type must be an array of integers")
    if len(types) != len(tokens):
        raise GGUFTokenizerError(f"{len(tokens)} tokens but {len(types)} token types")
    if merges is None:
        merges = []
    if not isinstance(merges, list) or not all(type(m) is str and " " in m for m in merges):
        raise GGUFTokenizerError("tokenizer.ggml.merges must be an array of 'a b' strings")
    return tokens, types, merges


def token_id(meta: dict[str, Any], key: str, n_tokens: int) -> int | None:
    """tokenizer.ggml.{key}_token_id: an integer (else GGUFTokenizerError); None when absent or outside the
    vocabulary (llama.cpp ignores such ids too)."""
    i = meta.get(f"tokenizer.ggml.{key}_token_id")
    if i is None:
        return None
    if type(i) is not int:
        raise GGUFTokenizerError(f"tokenizer.ggml.{key}_token_id must be an integer, got {type(i).__name__}")
    return i if 0 <= i < n_tokens else None


def merge_pairs(merges: list[str]) -> list[tuple[str, str]]:
    """"a b" merge rules as (a, b) pairs, split at the first space. Byte-level pieces hold no space (it is
    "Ġ"), so one split of the joined rules gives the pairs; anything else takes the rule-by-rule way. Done in
    chunks so that the server's event loop gets the GIL between them while a model loads."""
    out: list[tuple[str, str]] = []
    for start in range(0, len(merges), MERGE_CHUNK):
        chunk = merges[start:start + MERGE_CHUNK]
        parts = " ".join(chunk).split(" ")
        if len(parts) != 2 * len(chunk):
            return [cast("tuple[str, str]", tuple(m.split(" ", 1))) for m in merges]
        it = iter(parts)
        out.extend(zip(it, it))
    return out


def eog_ids(meta: dict[str, Any]) -> set[int]:
    """Ids that end a generation (see the module policy)."""
    tokens, types, _ = checked_vocab(meta)
    ids = {i for i in (token_id(meta, k, len(tokens)) for k in ("eos", "eot", "eom")) if i is not None}
    for name in EOG_NAMES:
        try:
            i = tokens.index(name)
        except ValueError:
            continue
        if i < len(types) and types[i] == CONTROL:
            ids.add(i)
    return ids


def chat_templates(meta: dict[str, Any]) -> str | dict[str, str] | None:
    """`tokenizer.chat_template` plus named ones (`tokenizer.chat_template.tool_use`): one string, or a
    {name: template} dict when there are several (ChatTemplate picks `tool_use` / `default`)."""
    named = {k.rsplit(".", 1)[1]: v for k, v in meta.items()
             if k.startswith("tokenizer.chat_template.") and isinstance(v, str)}
    main = meta.get("tokenizer.chat_template")
    if not named:
        return main
    if main is not None:
        named["default"] = main
    return named
