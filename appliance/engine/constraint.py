"""Constrained decoding: a per-request token mask from a grammar (llguidance), applied before sampling.

Policies:
- Grammars are llguidance's Lark with inline `%json{...}` (JSON schemas go through its JSON compiler): the
  JSON value, or Hermes tool-call blocks, optionally after a `<think>...</think>` block when thinking is on
  (or after the rest of one the prompt left open), so a thinking model thinks freely, then answers in form. A
  grammar is compiled once per request, off the event loop, before the request queues, and its first steps
  run there too (grammar_probe.py); a grammar llguidance refuses is a GrammarError whose message says why and
  whose `part` names the request field it refuses. The
  tokenizer table every grammar needs is built while the model loads (build_grammar_tokenizer): that work
  holds the GIL, so no worker thread can do it without stalling the event loop.
- Qwen3.5's XML calls (`<function=NAME>` / `<parameter=P>` blocks, protocol/xml_tool_calls.py): the declared
  parameters in their schema's order, the required ones always, the others optional; a string parameter's value is
  free text without `</parameter>` (an enum / const of strings: one of them), any other value a `%json` of its
  schema; a function whose parameters declare no properties takes none.
- Bounded work: compile and every mask step run under LLParserLimits (lexer states, grammar size, per-step
  fuel), so no schema can hang the engine or grow its memory without bound.
- JSON is compact-ish and whitespace-free outside strings (", " and ": " separators): a model cannot loop on
  whitespace, and output reads like OpenAI's.
- The mask is computed on the engine thread, after the token is accepted and before the next sampling step;
  it is one bit per token (V/32 int32 words) unpacked to a (V,) bool, and the logits are copied at most once
  (Sampler.sample applies it into its own penalized copy when there is one).
- When the grammar is complete (nothing but end-of-sequence can follow) generation stops without another
  forward step.
"""
from __future__ import annotations

import hashlib
import json
import logging
import pickle
import threading
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

log = logging.getLogger("appliance.constraint")

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A grammar (schema) the constraint library refuses; the message says why, `part` (when known) is the
    request path of the refused part (e.g. 'response_format.json_schema.schema.$defs.a')."""

    def __init__(self, message: str, part: str | None = None):
        super().__init__(message)
        self.part = part


def _limits():
    import llguidance

    return llguidance.LLParserLimits(max_items_in_row=2000, initial_lexer_fuel=2_000_000,
                                     step_lexer_fuel=200_000, step_max_items=50_000, max_lexer_states=50_000,
                                     max_grammar_size=200_000, verbose_errors=False)


_TOKENIZERS: dict[int, Any] = {}       # id(Tokenizer) -> (Tokenizer, LLTokenizer)
_BY_CONTENT: dict[tuple, Any] = {}     # (SHA-256 of token table + special ids, vocabulary, EOS ids) -> LLTokenizer
_TOKENIZERS_LOCK = threading.Lock()


WHITESPACE_SLICE = r"[\x20\x0A\x0D\x09]+"


def _slices() -> list[str]:
    """The token sets llguidance precomputes to speed up masks (the masks stay the same): its general slices,
    JSON string contents of any length, up to 10 and up to 30 characters, less the run of whitespace: our JSON
    has none outside strings (JSON_OPTIONS), and that slice alone was a fifth of the table's build (25-45 ms
    of SmolLM2's 140-195 ms of CPU)."""
    import llguidance

    return [s for s in llguidance.LLTokenizer.general_slices() if s != WHITESPACE_SLICE]


class _Vocabulary:
    """What llguidance.TokenizerWrapper reads: every id's bytes, the ids it treats as special (matched by id
    only), EOS, and the tokenizer itself for the text llguidance has to tokenize."""

    def __init__(self, tokenizer, tokens: list[bytes], special_ids: list[int], eos_ids: list[int]):
        self.tokens, self.special_token_ids = tokens, special_ids
        self.eos_token_id = eos_ids[0] if eos_ids else tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self._tokenizer = tokenizer

    def __call__(self, text) -> list[int]:
        return self._tokenizer.encode(text.decode("utf-8", "replace") if isinstance(text, bytes) else text)


def grammar_tokenizer(tokenizer, vocab_size: int, eos_ids: Iterable[int]):
    """llguidance's tokenizer for our Tokenizer: the bytes of every id up to the model's vocabulary (our byte
    table: the bytes and special ids llguidance reads out of a tokenizer.json, which it no longer has to
    parse), every end-of-generation id as EOS. Built once per tokenizer content in a process (1-3 s
    for Qwen3's 151,936 tokens, about half of building it from the tokenizer.json; holding the GIL: see
    build_grammar_tokenizer)."""
    import llguidance

    key = id(tokenizer)
    with _TOKENIZERS_LOCK:
        entry = _TOKENIZERS.get(key)
        if entry is None or entry[0] is not tokenizer:
            raw = tokenizer.all_token_bytes(vocab_size)
            # as llguidance takes them from a tokenizer.json: every added token (<think>, <tool_call> too) is
            # special, and so is each id the vocabulary lacks (a padded embedding), named <[id]>
            special = sorted({i for i in tokenizer.added_ids if i < vocab_size}
                             | {i for i, b in enumerate(raw) if not b})
            tokens = [b or b"<[%d]>" % i for i, b in enumerate(raw)]
            eos = sorted(eos_ids)
            content = (hashlib.sha256(pickle.dumps((tokens, special))).digest(), vocab_size, tuple(eos))
            llt = _BY_CONTENT.get(content)
            if llt is None:
                wrapper = llguidance.TokenizerWrapper(_Vocabulary(tokenizer, tokens, special, eos))
                llt = _BY_CONTENT[content] = llguidance.LLTokenizer(wrapper, n_vocab=vocab_size, eos_token=eos or None,
                                                                    slices=_slices())
            entry = (tokenizer, llt)
            _TOKENIZERS[key] = entry
        return entry[1]


def build_grammar_tokenizer(tokenizer, vocab_size: int, eos_ids: Iterable[int]) -> None:
    """Build a model's grammar tokenizer now (its model's config.vocab_size and EOS ids). The server does it
    while the model loads, before its event loop starts (cli.serve): llguidance's LLTokenizer holds the GIL
    throughout (0.3-1 s for SmolLM2's 49,152 tokens, seconds for Qwen3's), so built by the first request with
    an output format it stalled the event loop (/health, every other client's stream) that long. A tokenizer
    llguidance cannot take does not stop the model from serving: the first structured request meets the
    error again."""
    try:
        grammar_tokenizer(tokenizer, vocab_size, eos_ids)
    except Exception as e:  # llguidance's own errors (ValueError, RuntimeError) about this tokenizer
        log.warning("structured output's tokenizer table could not be built: %s", e)


def lark_grammar(lark: str) -> str:
    import llguidance

    return llguidance.LLMatcher.grammar_from_lark(lark)


@dataclass(frozen=True)
class CompiledGrammar:
    """A grammar built for one tokenizer; start() hands the engine its per-request mask state."""
    grammar: str
    matcher: Any            # llguidance.LLMatcher, built and checked when the request was parsed
    vocab_size: int

    def start(self) -> "TokenConstraint":
        self.matcher.reset()
        return TokenConstraint(self.matcher, self.vocab_size)


def compile_grammar(grammar: str, llg_tokenizer, vocab_size: int) -> CompiledGrammar:
    """Build the grammar's matcher for the tokenizer under the limits (drops the GIL; run it off the event
    loop); GrammarError when llguidance refuses the grammar."""
    import llguidance

    matcher = llguidance.LLMatcher(llg_tokenizer, grammar, log_level=0, limits=_limits())
    if matcher.is_error():
        raise GrammarError(_clean(matcher.get_error()))
    return CompiledGrammar(grammar, matcher, vocab_size)


def _clean(msg: str) -> str:
    return " ".join(msg.replace("<non-verbose/>", "").split())[:500]


class TokenConstraint:
    """One request's grammar state: `allowed()` before each sampling step, `accept(token)` after it."""

    def __init__(self, matcher, vocab_size: int):
        self._m = matcher
        self.vocab_size = vocab_size
        words = (vocab_size + 31) // 32
        self._bits = np.zeros(words, dtype=np.int32)           # (V/32,) one bit per token
        if matcher.is_error():
            raise GrammarError(_clean(matcher.get_error()))

    def allowed(self) -> np.ndarray:
        """(V,) bool: the tokens the grammar allows next (at least one: EOS when nothing else fits)."""
        self._m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        if self._m.is_error():
            raise GrammarError(_clean(self._m.get_error()))
        bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little")   # (32 * words,)
        return bits[: self.vocab_size].view(bool)

    def accept(self, token: int) -> None:
        if not self._m.consume_token(int(token)):
            raise GrammarError(_clean(self._m.get_error() or f"token {token} is not allowed by the grammar"))

    @property
    def finished(self) -> bool:
        """Nothing but end-of-sequence can follow (the JSON value / tool call is complete)."""
        return self._m.is_stopped()

    @property
    def accepting(self) -> bool:
        return self._m.is_accepting()


def _lark_literal(text: str, tokenizer, llg_tokenizer) -> str:
    """A literal in Lark: a vocabulary entry that llguidance treats as a special token is matched by its id
    (`<[151657]>`: its text would never match it), anything else as a string."""
    i = tokenizer.id_of(text) if tokenizer is not None else None
    if i is not None and llg_tokenizer is not None and llg_tokenizer.is_special_token(i):
        return f"<[{i}]>"
    return json.dumps(text)


def _json_rule(schema: Any) -> str:
    """A Lark `%json` body for a schema, with our JSON options."""
    schema = {} if schema is True else schema
    if not isinstance(schema, dict):
        raise ValueError("a JSON schema is an object or true")
    return f"%json {json.dumps({'x-guidance': JSON_OPTIONS, **schema})}"


def _call_json_rules(tools: Iterable[tuple[str, Any]]) -> str:
    """Lark rule `call_json`: one call's JSON, {"name": N, "arguments": ...}, "name" first so a stream can announce
    the call before its arguments. Each function's arguments are a `%json` of their own, so the `$ref`s in its
    parameters resolve against that schema's root (Pydantic's `$defs` for nested models)."""
    rules = []
    for i, (name, params) in enumerate(tools):
        head = json.dumps('{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": ', ensure_ascii=False)
        rules.append(f'call_{i}: {head} args_{i} "}}"\nargs_{i}: {_json_rule(params)}\n')
    alternatives = " | ".join(f"call_{i}" for i in range(len(rules)))
    return f"call_json: {alternatives}\n" + "".join(rules)


def generic_tool_rules(tools: Iterable[tuple[str, Any]], parallel: bool, response: Any) -> str:
    """Lark for the generic format of templates without a tool section (protocol/generic_tool_calls.py):
    {"tool_call": CALL}, or {"tool_calls": [CALL, ...]} when parallel, or (response not None) {"response": V}
    with V following the response schema."""
    one, many, reply = (json.dumps('{"' + key + '": ') for key in ("tool_call", "tool_calls", "response"))
    close, sep = json.dumps("}"), json.dumps(", ")
    calls = (f'{many} "[" call_json ({sep} call_json)* "]" {close}' if parallel else f"{one} call_json {close}")
    rules = f"calls: {calls}\n" + _call_json_rules(tools)
    if response is None:
        return rules + "body: calls\n"
    return rules + f"reply: {reply} reply_json {close}\nreply_json: {_json_rule(response)}\nbody: calls | reply\n"


def tool_calls_rules(tools: Iterable[tuple[str, Any]], parallel: bool, tokenizer=None, llg_tokenizer=None) -> str:
    """Lark for Hermes-style calls (`<tool_call>\n{"name": N, "arguments": {...}}\n</tool_call>`, the Qwen
    templates' format): one call, or several separated by a newline; each call as _call_json_rules."""
    calls = 'call ("\\n" call)*' if parallel else "call"
    open_tag, close_tag = (_lark_literal(t, tokenizer, llg_tokenizer) for t in ("<tool_call>", "</tool_call>"))
    return f'body: {calls}\ncall: {open_tag} "\\n" call_json "\\n" {close_tag}\n' + _call_json_rules(tools)


def is_string_schema(schema: Any) -> bool:
    """An XML parameter's value is text: type "string", or an enum / const of strings only (the same test as
    protocol/xml_tool_calls.is_string_schema, which parses what this grammar lets through)."""
    if not isinstance(schema, dict):
        return False
    if schema.get("type") == "string":
        return True
    values = schema.get("enum", [schema["const"]] if "const" in schema else None)
    return isinstance(values, list) and bool(values) and all(isinstance(v, str) for v in values)


_XML_TEXT = "XML_TEXT: /(?s:.*)\\n<\\/parameter>\\n/ & ~/(?s:.*)<\\/parameter>(?s:..+)/\n"


def _xml_param_rule(rule: str, name: str, schema: Any) -> str:
    """Lark for one XML parameter, `<parameter=P>\\nVALUE\\n</parameter>\\n`. Free text and its closing tag are one
    lexeme (text up to the first `\\n</parameter>\\n`): as two, llguidance's greedy text lexeme would swallow
    the tag."""
    head = json.dumps(f"<parameter={name}>\n", ensure_ascii=False)
    close = json.dumps("\n</parameter>\n")
    if not is_string_schema(schema):
        return f"{rule}: {head} {_json_rule(schema if isinstance(schema, dict) else {})} {close}\n"
    values = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if isinstance(values, list):
        return f"{rule}: {head} (" + " | ".join(json.dumps(v, ensure_ascii=False) for v in values) + f") {close}\n"
    return f"{rule}: {head} XML_TEXT\n"


def xml_tool_calls_rules(tools: Iterable[tuple[str, Any]], parallel: bool, tokenizer=None, llg_tokenizer=None) -> str:
    """Lark for Qwen3.5's XML calls, as its template writes them: `<tool_call>\\n<function=N>\\n` then each
    parameter as `<parameter=P>\\nVALUE\\n</parameter>\\n`, then `</function>\\n</tool_call>`; several calls
    separated by a newline when parallel."""
    calls = 'call ("\\n" call)*' if parallel else "call"
    open_tag, close_tag = (_lark_literal(t, tokenizer, llg_tokenizer) for t in ("<tool_call>", "</tool_call>"))
    rules = [f'body: {calls}\ncall: {open_tag} "\\n" function "\\n" {close_tag}\n', _XML_TEXT]
    functions = []
    for i, (name, params) in enumerate(tools):
        props = params.get("properties") if isinstance(params, dict) else None
        props = props if isinstance(props, dict) else {}
        required = set(params.get("required") or ()) if isinstance(params, dict) else set()
        parts = []
        for j, (pname, pschema) in enumerate(props.items()):
            rules.append(_xml_param_rule(f"param_{i}_{j}", pname, pschema))
            parts.append(f"param_{i}_{j}" + ("" if pname in required else "?"))
        head = json.dumps(f"<function={name}>\n", ensure_ascii=False)
        rules.append(f'function_{i}: {head} {" ".join(parts)} "</function>"\n')
        functions.append(f"function_{i}")
    rules.append(f"function: {' | '.join(functions)}\n")
    return "".join(rules)


def grammar_for(fmt, tokenizer=None, llg_tokenizer=None, think: str = "none") -> str:
    """The llguidance grammar (Lark) of a protocol.structured.OutputFormat.

    think: "none" (the output starts with the constrained part), "optional" (a `<think>...</think>` block may come
    first: thinking is on), "open" (the prompt left a think block open: free text up to `</think>` first)."""
    if fmt.kind == "json":
        rules = f"body: {_json_rule({'type': 'object'})}\n"
    elif fmt.kind == "json_schema":
        rules = f"body: {_json_rule(fmt.schema)}\n"
    elif fmt.kind == "tool_calls":
        rules = tool_calls_rules(fmt.tools, fmt.parallel, tokenizer, llg_tokenizer)
    elif fmt.kind == "xml_tool_calls":
        rules = xml_tool_calls_rules(fmt.tools, fmt.parallel, tokenizer, llg_tokenizer)
    elif fmt.kind == "generic_tool_calls":
        rules = generic_tool_rules(fmt.tools, fmt.parallel, fmt.schema)
    else:
        raise ValueError(f"unknown output format {fmt.kind!r}")
    if think != "none":
        open_tag, close_tag = (_lark_literal(t, tokenizer, llg_tokenizer) for t in ("<think>", "</think>"))
        rules += f"THINKING: /(?s:.*)/\nthought: THINKING {close_tag} /[ \\n]*/\n"
        rules += "start: thought body\n" if think == "open" else f"start: ({open_tag} thought)? body\n"
    else:
        rules += "start: body\n"
    return lark_grammar(rules)


def think_mode(tokenizer, prompt_in_reasoning: bool, thinking: bool) -> str:
    """How a constrained output may think: "open" when the prompt left a think block open, "optional" when
    thinking is on and the vocabulary has the think tags, else "none"."""
    if tokenizer.id_of("<think>") is None or tokenizer.id_of("</think>") is None:
        return "none"
    return "open" if prompt_in_reasoning else "optional" if thinking else "none"


def constraint_for(fmt, tokenizer, vocab_size: int, eos_ids: Iterable[int], think: str = "none") -> CompiledGrammar:
    """The compiled constraint of an OutputFormat for one model's tokenizer (GrammarError when refused); `think`
    as grammar_for's. Blocking (tokenizer table on first use, grammar build): call it off the event loop."""
    llg_tokenizer = grammar_tokenizer(tokenizer, vocab_size, eos_ids)
    try:
        grammar = grammar_for(fmt, tokenizer, llg_tokenizer, think)
    except ValueError as e:                                   # llguidance: a schema that is not JSON-able
        raise GrammarError(_clean(str(e))) from None
    return compile_grammar(grammar, llg_tokenizer, vocab_size)
