"""A request's constraint made ready before admission: compiled, then its first steps run, so a schema llguidance
can build but not run is a 400 naming the part instead of a 500 (or an error event after a 200) mid-generation.

Policies:
- What llguidance refuses only while it runs shows where a part starts: its Earley rows past max_items_in_row
  (a wide object or anyOf, on the token that opens it), a regex whose lexer runs out of fuel (on the opening
  quote), a grammar with no value at all (NoExtensionBias: a `$ref` loop with nothing behind it, at the first
  mask). So every probe point the request parser chose (OutputFormat.probes: path, part schema; deepest
  first, the whole schema last) is compiled alone and walked STEPS tokens: mask, then consume one allowed token
  (an opening `{`, `[` or `"` when allowed, else the lowest allowed id, a short token in byte-level BPE
  vocabularies), stopping early when only end-of-sequence is left. The request's own grammar (thinking
  prefix and all) is walked last (its first mask only when it starts with thinking); with no prefix, that walk
  is the whole schema's, without a compile of its own.
- Bounded: each step is under the grammar's LLParserLimits (per-step fuel); no probe point starts after
  BUDGET_S seconds (the compiles are bounded by the same limits): a part not reached by then is left to the
  generation. A part that does not compile alone (it only makes sense inside the whole schema) is
  skipped; the whole schema compiled already.
- Runs where compile_grammar runs: in a request-preparation worker thread, never on the event loop, before
  the request takes its place in the queue.
"""
from __future__ import annotations

import re
import time
from typing import Iterable

import numpy as np

from appliance.engine.constraint import (
    CompiledGrammar,
    GrammarError,
    _clean,
    _json_rule,
    _limits,
    constraint_for,
    grammar_tokenizer,
    lark_grammar,
)

STEPS = 6
BUDGET_S = 2.0
OPENERS = ("{", "[", '"')


def prepared_constraint(fmt, tokenizer, vocab_size: int, eos_ids: Iterable[int], think: str = "none",
                        budget_s: float = BUDGET_S) -> CompiledGrammar:
    """constraint_for, then the first steps of the grammar and of each of fmt.probes; GrammarError (with
    `part` set when a probe point fails) for what llguidance refuses. Blocking: call it off the event loop."""
    import llguidance

    eos = frozenset(eos_ids)
    compiled = constraint_for(fmt, tokenizer, vocab_size, eos, think)
    llt = grammar_tokenizer(tokenizer, vocab_size, eos)
    openers = [i for i in (tokenizer.id_of(t) for t in OPENERS) if i is not None]
    walker = _Walker(vocab_size, eos, openers)
    own = think == "none" and fmt.kind == "json_schema"   # the request's grammar is the whole schema's
    deadline = time.monotonic() + budget_s
    for path, schema in fmt.probes:
        if own and schema is fmt.schema:
            continue                                      # walked below, without a compile of its own
        if time.monotonic() > deadline:
            break
        try:
            grammar = lark_grammar(f"start: {_json_rule(schema)}\n")
        except ValueError:
            continue
        matcher = llguidance.LLMatcher(llt, grammar, log_level=0, limits=_limits())
        if matcher.is_error():
            continue
        error = walker.walk(matcher, STEPS)
        if error is not None:
            raise GrammarError(explain(error), part=path)
    error = walker.walk(compiled.matcher.deep_copy(), STEPS if think == "none" else 1)
    if error is not None:
        raise GrammarError(explain(error), part=fmt.probes[-1][0] if own and fmt.probes else None)
    return compiled


class _Walker:
    """Steps a matcher into its grammar (see the module's policy), one mask buffer for all its walks."""

    def __init__(self, vocab_size: int, eos: frozenset, openers: list[int]):
        self.vocab_size = vocab_size
        self.eos = eos
        self.openers = openers
        self.bits = np.zeros((vocab_size + 31) // 32, dtype=np.int32)

    def walk(self, matcher, steps: int) -> str | None:
        """llguidance's error on the first `steps` steps of a fresh matcher, or None."""
        for _ in range(steps):
            matcher.unsafe_compute_mask_ptr(self.bits.ctypes.data, self.bits.nbytes)
            if matcher.is_error():
                return matcher.get_error()
            if matcher.is_stopped():
                return None
            token = self._choose()
            if token is None:
                return None
            if not matcher.consume_token(token):
                return matcher.get_error() or None
        return None

    def _choose(self) -> int | None:
        allowed = np.unpackbits(self.bits.view(np.uint8), bitorder="little")[: self.vocab_size].view(bool)
        for t in self.openers:
            if allowed[t]:
                return t
        for t in np.flatnonzero(allowed)[: len(self.eos) + 1]:
            if int(t) not in self.eos:
                return int(t)
        return None


def explain(error: str) -> str:
    """llguidance's run-time error as what it means for a schema (its own words in parentheses)."""
    why = _clean(error)
    row = re.search(r"Current row has (\d+) items; max is (\d+)", why)
    if row:
        why = f"Current row has {row[1]} items; max is {row[2]}"
        return (f"it is too wide for the constraint parser: {row[1]} grammar items where it starts, at most "
                f"{row[2]} (fewer optional properties or anyOf alternatives at one point) ({why})")
    if "NoExtensionBias" in why:
        return f"no JSON value can match it (a $ref loop with no schema behind it, for example) ({why})"
    if "too many expressions constructed" in why or "too many states" in why:
        return f"its regular expression is too complex for the constraint lexer ({why})"
    if "Too many items" in why:
        return f"it is too expensive for the constraint parser at one step ({why})"
    return why
