"""Tokenizer: the model's own `tokenizer.json`, run by the `tokenizers` library.

Policies:
- encode() never adds BOS/EOS or post-processor tokens unless asked: prompts come from the chat template,
  which writes its own control tokens (transformers tokenizes chat-template output the same way). Added
  tokens written in the text (<|im_start|>, <think>, ...) are recognised as single tokens.
- token_bytes() is the streaming primitive: the exact bytes one token stands for, from a table built once
  at load. Byte-level BPE tokens map back through GPT-2's byte<->unicode table; SentencePiece-style vocabularies
  (byte fallback `<0xNN>`, `▁` for space) are handled too, so a GGUF loader can reuse this class.
  Added tokens marked special (special=True) yield b"" when skipping special tokens, like decode(); the others
  (<think>, <tool_call>, ...) are text and always yield their content.
- Encoding releases the GIL (the library's batch calls; its plain `encode` holds it for the whole run, stalling
  every other thread: token_bounds.py). encode_within() refuses a text proven to have too many tokens after
  tokenizing about a context's worth of it (token_bounds.py: the proofs).
- Ids the vocabulary does not know (a model's embedding matrix is often padded past the tokenizer) decode
  to nothing rather than failing, as the `tokenizers` decoder does.
"""
from __future__ import annotations

import functools
import json
import os
import re
from typing import Iterable, Mapping

import tokenizers
from tokenizers import decoders

from .token_bounds import BoundedEncoder

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _token_content(value) -> str | None:
    """A special-token entry of tokenizer_config.json: a string, an AddedToken dict, or null."""
    if value is None:
        return None
    if isinstance(value, dict):
        return value.get("content")
    if isinstance(value, str):
        return value
    raise ValueError(f"unexpected special token entry in tokenizer_config.json: {value!r}")


def _is_byte_level(tk: tokenizers.Tokenizer) -> bool:
    if isinstance(tk.decoder, decoders.ByteLevel):
        return True
    # A Sequence decoder cannot be inspected from Python: fall back to the serialized form (small part only).
    if isinstance(tk.decoder, decoders.Sequence):
        return '"ByteLevel"' in json.dumps(json.loads(tk.to_str()).get("decoder"))
    return False


class Tokenizer:
    """Encode/decode text for one model. Build with from_dir(), or directly from a `tokenizers.Tokenizer`."""

    def __init__(self, tk: tokenizers.Tokenizer, *, eos_token: str | None = None, bos_token: str | None = None,
                 special_tokens: Mapping[str, str | None] | None = None, special_ids: Iterable[int] | None = None,
                 byte_level: bool | None = None, vocab: dict[str, int] | None = None):
        """special_tokens: the named tokens (bos_token, eos_token, pad_token, ...) a chat template sees.
        special_ids: the ids skipped by decode/token_bytes; default: the added tokens marked special=True.
        byte_level: whether the vocabulary is byte-level BPE; default: read from the tokenizer's decoder.
        vocab: {piece: id} as `tk` was built from, when the caller has it (a GGUF's token list), which spares
        reading it back out of `tk`; the added tokens need not be in it."""
        self._tk = tk
        named = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        if eos_token is not None:
            named["eos_token"] = eos_token
        if bos_token is not None:
            named["bos_token"] = bos_token
        self.special_tokens: dict[str, str] = named
        added = tk.get_added_tokens_decoder()  # {id: AddedToken}
        if special_ids is None:
            special_ids = [i for i, t in added.items() if t.special]
        self.special_ids: frozenset[int] = frozenset(special_ids)
        self.added_ids: frozenset[int] = frozenset(added) | self.special_ids
        self.vocab_size: int = tk.get_vocab_size(with_added_tokens=True)
        for name, content in named.items():
            if tk.token_to_id(content) is None:
                raise ValueError(f"{name} {content!r} is not in the vocabulary")
        self.byte_level = _is_byte_level(tk) if byte_level is None else byte_level
        self._table = self._build_byte_table(tk, added, self.byte_level, vocab)

    @classmethod
    def from_dir(cls, model_dir: str) -> "Tokenizer":
        """Load tokenizer.json (+ tokenizer_config.json when present) from a Hugging Face model directory."""
        path = os.path.join(model_dir, "tokenizer.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{model_dir}: no tokenizer.json")
        tk = tokenizers.Tokenizer.from_file(path)
        cfg = {}
        cfg_path = os.path.join(model_dir, "tokenizer_config.json")
        if os.path.isfile(cfg_path):
            with open(cfg_path, encoding="utf-8") as f:
                cfg = json.load(f)
        named = {k: _token_content(cfg.get(k)) for k in NAMED_SPECIAL_TOKENS}
        return cls(tk, special_tokens=named)

    @staticmethod
    def _build_byte_table(tk: tokenizers.Tokenizer, added: dict, byte_level: bool,
                          vocab: dict[str, int] | None = None) -> list[bytes]:
        if vocab is None:
            vocab = tk.get_vocab(with_added_tokens=True)  # {token string: id}
        table = [b""] * (max(max(vocab.values(), default=-1), max(added, default=-1)) + 1)
        to_latin1 = {ord(c): b for b, c in bytes_to_unicode().items()}  # byte-level char -> its byte as U+00XX
        for piece, i in vocab.items():
            if i in added:
                table[i] = added[i].content.encode("utf-8")
            elif byte_level:
                try:
                    table[i] = piece.translate(to_latin1).encode("latin-1")
                except UnicodeEncodeError:  # not a byte-level piece (should not happen): keep its text
                    table[i] = piece.encode("utf-8")
            else:
                m = _BYTE_FALLBACK.match(piece)
                table[i] = bytes([int(m.group(1), 16)]) if m else piece.replace("\u2581", " ").encode("utf-8")
        for i, t in added.items():  # an added token need not be in a caller's vocab
            table[i] = t.content.encode("utf-8")
        return table

    # -- names and ids -------------------------------------------------------------------------------------------
    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return None if self.eos_token is None else self.id_of(self.eos_token)

    @property
    def bos_token_id(self) -> int | None:
        return None if self.bos_token is None else self.id_of(self.bos_token)

    def id_of(self, token: str) -> int | None:
        """The id of one vocabulary entry (e.g. "<|im_end|>"), or None when it has none."""
        return self._tk.token_to_id(token)

    def token_text(self, token_id: int) -> str | None:
        """The vocabulary entry of an id as stored (byte-level pieces look like 'Ġthe'), None when unknown."""
        return self._tk.id_to_token(token_id)

    # -- text <-> ids --------------------------------------------------------------------------------------------
    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of text. add_special_tokens=True runs the tokenizer's post-processor (e.g. adds a BOS)."""
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, not {type(text).__name__}")
        return self._bounded.encode(text, add_special_tokens=add_special_tokens)

    def encode_within(self, text: str, limit: int) -> list[int]:
        """Token ids of text; token_bounds.TooManyTokens (a ValueError, with a proven `at_least`) as soon as the text
        is proven to have `limit` tokens or more, before most of a long text is tokenized."""
        if not isinstance(text, str):
            raise TypeError(f"encode_within() takes a str, not {type(text).__name__}")
        return self._bounded.encode_within(text, limit)

    @functools.cached_property
    def _bounded(self) -> BoundedEncoder:
        return BoundedEncoder(self._tk, self.max_token_bytes, self.byte_level)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int, skip_special_tokens: bool = True) -> bytes:
        """The raw bytes token_id stands for (may be part of a UTF-8 character); b"" for unknown ids."""
        if skip_special_tokens and token_id in self.special_ids:
            return b""
        if 0 <= token_id < len(self._table):
            return self._table[token_id]
        return b""

    def all_token_bytes(self, n: int) -> list[bytes]:
        """token_bytes(i, skip_special_tokens=False) for every id below n at once (b"" past the vocabulary)."""
        return self._table[:n] + [b""] * (n - len(self._table))

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most bytes one token stands for (a text of n bytes has at least n / this many tokens)."""
        return max((len(b) for b in self._table), default=1) or 1

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, eos_token={self.eos_token!r})"
