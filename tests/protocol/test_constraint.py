"""engine/constraint.py and Sampler.sample's mask: grammars over the real Qwen tokenizer (llguidance), and a mask
giving exactly the distribution of the masked logits."""
from __future__ import annotations

import llguidance
import numpy as np
import pytest

from appliance.engine import constraint
from appliance.engine.constraint import (
    GrammarError,
    compile_grammar,
    constraint_for,
    grammar_for,
    grammar_tokenizer,
    think_mode,
)
from appliance.engine.sampling import Sampler, SamplingParams
from appliance.engine.tokenizer import Tokenizer
from appliance.protocol.structured import OutputFormat

V = 151936
EOS = (151645, 151643)
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "y"]}},
          "required": ["a", "b"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tok(qwen_tokenizer_dir):
    return Tokenizer.from_dir(qwen_tokenizer_dir)


def accepts(tok, fmt, text: str, think: str = "none") -> bool:
    llt = grammar_tokenizer(tok, V, EOS)
    m = llguidance.LLMatcher(llt, grammar_for(fmt, tok, llt, think), log_level=0)
    ids = tok.encode(text)
    return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()


@pytest.mark.parametrize("think, text, ok", [
    ("none", '{"a": 1, "b": "x"}', True),
    ("none", '{"a": 1,"b": "x"}', False),                      # fixed separators: no whitespace loops
    ("none", '{"b": "x", "a": 1}', False),                     # properties in schema order
    ("none", '<think>hm</think>{"a": 1, "b": "x"}', False),
    ("optional", '<think>\nhm {"a": 2}\n</think>\n\n{"a": -3, "b": "y"}', True),
    ("optional", '{"a": 1, "b": "x"}', True),
    ("open", 'still thinking</think>\n\n{"a": 1, "b": "x"}', True),
    ("open", '{"a": 1, "b": "x"}', False),
])
def test_json_schema_grammar_with_and_without_thinking(tok, think, text, ok):
    assert accepts(tok, OutputFormat("json_schema", SCHEMA), text, think) is ok


def test_tool_call_grammar_is_the_templates_hermes_format(tok):
    fmt = OutputFormat("tool_calls", tools=(("f", SCHEMA), ("g", {"type": "object", "properties": {}})), parallel=True)
    one = '<tool_call>\n{"name": "f", "arguments": {"a": 1, "b": "y"}}\n</tool_call>'
    assert accepts(tok, fmt, one)
    assert accepts(tok, fmt, one + '\n<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>')
    assert not accepts(tok, fmt, '<tool_call>\n{"name": "h", "arguments": {}}\n</tool_call>')
    assert not accepts(tok, fmt, '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>')
    single = OutputFormat("tool_calls", tools=(("f", SCHEMA),), parallel=False)
    assert not accepts(tok, single, one + "\n" + one)
    assert think_mode(tok, False, True) == "optional" and think_mode(tok, True, False) == "open"
    assert think_mode(tok, False, False) == "none"


def test_constraint_steps_and_finishes(tok):
    c = constraint_for(OutputFormat("json_schema", SCHEMA), tok, V, EOS).start()
    for t in tok.encode('{"a": 7, "b": "x"}'):
        allowed = c.allowed()
        assert allowed.shape == (V,) and allowed[t]
        c.accept(t)
    assert c.finished and c.accepting
    assert set(np.flatnonzero(c.allowed())) <= set(EOS)
    c2 = constraint_for(OutputFormat("json"), tok, V, EOS).start()
    first = [tok.decode([int(t)]) for t in np.flatnonzero(c2.allowed())]
    assert "{" in first and all(t.startswith("{") for t in first)          # no leading whitespace
    with pytest.raises(GrammarError):
        c2.accept(tok.encode("x")[0])


def test_grammar_tokenizer_is_the_one_llguidance_reads_from_tokenizer_json(tok):
    """Built from our byte table (no tokenizer.json round trip), llguidance sees the same vocabulary: every id's
    bytes, which ids are special (all added tokens, the padding ids past the tokenizer), EOS, tokenization."""
    ours = grammar_tokenizer(tok, V, EOS)
    ref = llguidance.LLTokenizer(tok._tk.to_str(), n_vocab=V, eos_token=list(EOS))
    assert ours.vocab_size == ref.vocab_size == V and sorted(ours.eos_tokens) == sorted(ref.eos_tokens)
    assert [ours.decode_bytes([i]) for i in range(V)] == [ref.decode_bytes([i]) for i in range(V)]
    assert [ours.is_special_token(i) for i in range(V)] == [ref.is_special_token(i) for i in range(V)]
    assert ours.is_special_token(tok.id_of("<think>")) and ours.is_special_token(V - 1)
    text = 'Hi {"a": 12, "b": [1, 2]} ünï  \n\n 日本語 <tool_call>'
    assert ours.tokenize_str(text) == ref.tokenize_str(text) == tok.encode(text)


def test_masks_are_those_of_llguidances_default_slices(tok):
    """Our table leaves out the whitespace slice (a fifth of its build): an optimization only, every mask along
    a schema's output (strings, numbers, enums; after a think block's whitespace) and a tool call's (its newlines)
    is the same bit for bit."""
    ours = grammar_tokenizer(tok, V, EOS)
    assert constraint.WHITESPACE_SLICE in llguidance.LLTokenizer.general_slices()   # the slice we leave out exists
    default = ours.with_slices(llguidance.LLTokenizer.general_slices())
    tool_fmt = OutputFormat("tool_calls", tools=(("f", SCHEMA),), parallel=True)
    strings = OutputFormat("json_schema", {"type": "object", "properties": {"s": {"type": "string"}}})
    call = '<tool_call>\n{"name": "f", "arguments": {"a": %d, "b": "x"}}\n</tool_call>'
    for fmt, text, think in ((OutputFormat("json_schema", SCHEMA), '{"a": -12, "b": "y"}', "none"),
                             (OutputFormat("json_schema", SCHEMA), '<think>\nhm\n</think>\n\n{"a": 3, "b": "x"}',
                              "optional"),
                             (strings, '{"s": "spaces, \\"quotes\\" and ünïcode 日本 ' + "x" * 60 + '"}', "none"),
                             (tool_fmt, call % 1 + "\n" + call % 2, "none")):
        grammar = grammar_for(fmt, tok, ours, think)
        a, b = (compile_grammar(grammar, t, V).start() for t in (ours, default))
        ids = tok.encode(text)
        for t in ids:
            assert np.array_equal(a.allowed(), b.allowed()), (fmt.kind, think, tok.decode(ids[:ids.index(t)]))
            a.accept(t)
            b.accept(t)
        assert a.accepting and b.accepting


def test_unsupported_schema_is_a_grammar_error_naming_it(tok):
    with pytest.raises(GrammarError, match="no-such"):
        constraint_for(OutputFormat("json_schema", {"type": "string", "format": "no-such"}), tok, V, EOS)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=3),
                                    SamplingParams(temperature=1.0, top_k=5, seed=4),
                                    SamplingParams(temperature=0.7, top_p=0.9, min_p=0.05, seed=5),
                                    SamplingParams(temperature=1.0, repetition_penalty=1.3, presence_penalty=0.5,
                                                   seed=6, logprobs=True, top_logprobs=2)])
def test_mask_samples_as_the_masked_logits(params):
    """Sampling with a mask draws exactly what sampling the logits with the masked tokens at -inf draws (same
    seed, same token every step), and logprobs stay those of the raw logits."""
    rng = np.random.default_rng(0)
    vocab = 5000
    a, b = Sampler(params, vocab), Sampler(params, vocab)
    generated: list[int] = []
    for step in range(40):
        logits = rng.normal(0, 3, vocab).astype(np.float32)
        allowed = rng.random(vocab) < (0.002 if step % 2 else 0.6)
        allowed[rng.integers(vocab)] = True
        masked = np.where(allowed, logits, np.float32(-np.inf))
        ta, lpa = a.sample(logits, [1, 2, 3], generated, allowed)
        tb, _ = b.sample(masked, [1, 2, 3], generated)
        assert ta == tb and allowed[ta]
        if params.logprobs:
            assert lpa.logprob == pytest.approx(b.logprob(logits, ta).logprob)
        generated.append(ta)
