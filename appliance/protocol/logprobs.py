"""Token logprobs in OpenAI's two shapes: chat (`{"content": [{token, logprob, bytes, top_logprobs}]}`) and the
legacy completions one (`{tokens, token_logprobs, top_logprobs, text_offset}`).

Policies:
- The input is bytes, not text: a token may hold part of a UTF-8 character. Its `token` string is the text when
  the bytes decode, else OpenAI's `bytes:\\xNN...` spelling; `bytes` always lists the raw byte values.
- A logprob of -inf (a token the sampler could never draw) is reported as -9999.0, the floor OpenAI uses.
"""
from __future__ import annotations

import codecs
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

LOGPROB_FLOOR = -9999.0


@dataclass(frozen=True)
class LogprobEntry:
    token: bytes                                  # the chosen token's bytes
    logprob: float
    top: tuple[tuple[bytes, float], ...] = ()     # alternatives, best first


def entry_from_engine(tl: Any, token_bytes: Callable[[int], bytes]) -> LogprobEntry:
    """From an engine TokenLogprob (token_id, logprob, top=[(id, logprob)]) and the tokenizer's id -> bytes."""
    return LogprobEntry(token=token_bytes(tl.token_id), logprob=tl.logprob,
                        top=tuple((token_bytes(i), lp) for i, lp in tl.top))


def token_text(b: bytes) -> str:
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{c:02x}" for c in b)


def clamp_logprob(lp: float) -> float:
    lp = float(lp)
    if math.isnan(lp):
        return LOGPROB_FLOOR
    return max(lp, LOGPROB_FLOOR)


def chat_logprob_item(e: LogprobEntry) -> dict[str, Any]:
    return {
        "token": token_text(e.token),
        "logprob": clamp_logprob(e.logprob),
        "bytes": list(e.token),
        "top_logprobs": [{"token": token_text(b), "logprob": clamp_logprob(lp), "bytes": list(b)}
                         for b, lp in e.top],
    }


def chat_logprobs(entries: Iterable[LogprobEntry]) -> dict[str, Any]:
    """The choice-level `logprobs` object of chat responses and chunks."""
    return {"content": [chat_logprob_item(e) for e in entries]}


def completion_logprobs(entries: Sequence[LogprobEntry], text_offset: int = 0) -> dict[str, Any]:
    """Legacy /v1/completions `logprobs`; `text_offset` is where the first token starts in the choice text
    (character offsets, as OpenAI counts them)."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    chars = 0       # characters of the bytes so far; a character split across tokens is counted once it is complete
    decoder = codecs.getincrementaldecoder("utf-8")(errors="ignore")   # holds a split character's first bytes
    for e in entries:
        t = token_text(e.token)
        tokens.append(t)
        token_logprobs.append(clamp_logprob(e.logprob))
        top: dict[str, float] = {}
        for b, lp in e.top:
            top.setdefault(token_text(b), clamp_logprob(lp))
        tops.append(top)
        offsets.append(text_offset + chars)
        chars += len(decoder.decode(e.token))
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}
