"""Speculative decoding on Qwen3.5's hybrid cache: a verified run keeps the linear layers' state after each
drafted position (HybridCache.keep_steps), so a rejected tail rolls back like a KV cache's. Greedy and seeded
tokens equal plain decoding's on the tiny dense and MoE models, with drafts accepted and rejected (an oracle
drafter), with drafts from the prompt and from a draft model; a stop string inside an accepted run and a
follow-up turn see the sequence plain decoding leaves."""
import numpy as np
import pytest

from appliance.engine.generate import GenerationRequest
from appliance.engine.load import LoadOptions, load_model
from appliance.engine.sampling import SamplingParams
from appliance.engine.speculative import NgramDrafter, SpecOptions
from tests.engine.test_speculative import GREEDY, OracleDrafter, check_oracle, ids_of, run, text_of, tiny_pair

FIXTURES = ["tiny_qwen3_5", "tiny_qwen3_5_moe"]


@pytest.fixture(scope="module", params=FIXTURES)
def pair(request):
    return tiny_pair(request.getfixturevalue(request.param))


def test_rollback_restores_the_state_after_an_accepted_position(tiny_qwen3_5):
    """The cache after a 5-token verify cut back to 3 holds what 3 one-token steps leave."""
    m = load_model(tiny_qwen3_5, LoadOptions(context_length=64, spec=SpecOptions("none"))).model
    toks = [9707, 11, 1879, 0, 13, 576, 6722, 315]
    a, b = m.new_cache(64), m.new_cache(64)
    m.forward(np.asarray(toks[:3]), a, "none")
    m.forward(np.asarray(toks[:3]), b, "none")
    b.keep_steps = True
    m.forward(np.asarray(toks[3:8]), b, "all")
    b.keep_steps = False
    assert sorted(b.steps) == [4, 5, 6, 7, 8]
    b.rollback(6)
    for t in toks[3:6]:
        m.forward(np.asarray([t]), a, "last")
    assert b.length == a.length == 6 and not b.steps
    for i in a.state:
        np.testing.assert_allclose(b.state[i].conv, a.state[i].conv, rtol=0, atol=1e-5)  # matmul tiles of 5 rows vs 1
        np.testing.assert_allclose(b.state[i].ssm, a.state[i].ssm, rtol=0, atol=1e-6)
    la = m.forward(np.asarray([toks[6]]), a, "last")
    lb = m.forward(np.asarray([toks[6]]), b, "last")
    np.testing.assert_allclose(lb, la, rtol=0, atol=1e-4)
    with pytest.raises(ValueError):
        b.rollback(5)  # no state kept there any more


def test_a_verify_forward_gives_decodes_logits_bit_for_bit(tiny_qwen3_5):
    """Each verified position's logits are exactly those plain decoding computes there (the full-attention
    layers run each position as decode does): a seeded sample cannot land on the other side of a boundary. The
    batched attention differed by ~2e-6, which flipped a seeded token of the oracle test below (index 10) once
    the conv1d ran in C. (The MoE model's routed and shared experts still batch the verified rows: ~3e-6.)"""
    m = load_model(tiny_qwen3_5, LoadOptions(context_length=128, spec=SpecOptions("none"))).model
    prompt, drafts = np.arange(1000, 1040), [9707, 11, 1879, 0, 13]
    a, b = m.new_cache(128), m.new_cache(128)
    m.forward(prompt, a, "none")
    m.forward(prompt, b, "none")
    want = np.stack([m.forward(np.asarray([t]), a, "last") for t in drafts])  # (5, vocab)
    b.keep_steps = True
    got = m.forward(np.asarray(drafts), b, "all")
    b.keep_steps = False
    assert np.array_equal(got, want), float(np.max(np.abs(got - want)))


def test_verify_exactly_with_an_oracle_drafter(pair):
    a, b = pair
    ids = ids_of(a, "Tell me a story about a lighthouse.")
    check_oracle(a, b, GenerationRequest(ids, GREEDY, max_tokens=32, ignore_eos=True))
    check_oracle(a, b, GenerationRequest(ids, SamplingParams(temperature=1.0, seed=3), max_tokens=32,
                                         ignore_eos=True))


def test_prompt_drafts_greedy_identical(tiny_qwen3_5):
    """(The dense model: its answer's first tokens repeat the earlier turn's, so the prompt drafts; the MoE's
    random weights do not happen to.)"""
    a, b = tiny_pair(tiny_qwen3_5)
    b.engine.drafter = NgramDrafter
    # the generation prompt's n-grams occurred before, in the earlier turn: drafts of that answer (random
    # weights: mostly rejected, each rejection a rollback of the recurrent states)
    q = "Tell me a story about a lighthouse."
    _, f0 = run(a, GenerationRequest(ids_of(a, q), GREEDY, max_tokens=24, ignore_eos=True))
    ids = ids_of(a, q, [{"role": "user", "content": q}, {"role": "assistant", "content": a.tokenizer.decode(f0.token_ids)}])
    req = GenerationRequest(ids, GREEDY, max_tokens=40, ignore_eos=True)
    ta, fa = run(a, req)
    tb, fb = run(b, req)
    assert fb.token_ids == fa.token_ids and [t.text for t in tb] == [t.text for t in ta]
    assert fb.timings.draft_n > fb.timings.draft_n_accepted


class RecordingOracle(OracleDrafter):
    """The oracle, keeping each proposal: (position of its first draft in the answer, the drafts)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.proposals: list[tuple[int, list[int]]] = []

    def propose(self, k):
        out = super().propose(k)
        self.proposals.append((self.n - self.prompt_len, out))
        return out

    def runs(self) -> list[tuple[int, int, int]]:
        """Each verified run: (first position, positions accepted, positions drafted)."""
        return [(at, next((i for i, t in enumerate(out) if t != self.truth[at + i]), len(out)), len(out))
                for at, out in self.proposals]


def test_a_stop_string_inside_an_accepted_run(pair):
    """The stop string is the text of two answer tokens that the oracle drafts right in the middle of one run
    (the run goes on past them), so the stop is found while emitting a verified run's accepted tokens."""
    a, b = pair
    ids = ids_of(a, "Tell me a story about a lighthouse.")
    _, fa = run(a, GenerationRequest(ids, GREEDY, max_tokens=32, ignore_eos=True))
    truth = fa.token_ids
    # the runs (first position, drafted; the oracle is wrong at 4, 9, 14, ...; draft_max 6, no pause: see below):
    # 1-4 (4 wrong), 5-8 (9 from the run's last logits), 10-15 (14 wrong), 15-19, 20-24: the stop spans positions
    # m, m + 1 of one run that drafts m + 2 too
    text = a.tokenizer.decode

    def first_at(m):  # the stop is first found when token m + 1 is emitted
        stop = text(truth[m:m + 2])
        return stop.strip() and stop in text(truth[:m + 2]) and stop not in text(truth[:m + 1]) \
            and text(truth[:m + 2]).index(stop) >= len(text(truth[:m]))
    m = next(m for m in (11, 16, 12, 6, 10, 15, 5, 2) if first_at(m))
    stop = text(truth[m:m + 2])
    ta, fa = run(a, GenerationRequest(ids, GREEDY, max_tokens=32, ignore_eos=True, stop=(stop,)))
    drafters: list[RecordingOracle] = []
    b.engine.drafter = lambda: drafters.append(RecordingOracle(len(ids), truth, b.config.vocab_size)) or drafters[-1]
    b.engine.step_ms = None  # no measured step: the draft length follows acceptance only, never pauses (timing)
    tb, fb = run(b, GenerationRequest(ids, GREEDY, max_tokens=32, ignore_eos=True, stop=(stop,)))
    assert fa.reason == fb.reason == "stop" and text_of(tb, fb) == text_of(ta, fa) and len(fa.token_ids) == m + 2
    assert fb.token_ids == fa.token_ids and fb.timings.draft_n_accepted > 3
    assert any(at <= m and at + accepted > m + 1 and at + drafted > m + 2 for at, accepted, drafted
               in drafters[0].runs()), (m, drafters[0].runs())
    assert b.engine.cache_tokens == ids + fb.token_ids[:-1] == a.engine.cache_tokens
    assert b.engine.cache.length == len(b.engine.cache_tokens)


def test_a_follow_up_turn_reuses_exactly_the_accepted_tokens(pair):
    a, b = pair
    first = ids_of(a, "Tell me a story about a lighthouse.")
    _, fa = run(a, GenerationRequest(first, GREEDY, max_tokens=24))
    b.engine.drafter = lambda: OracleDrafter(len(first), fa.token_ids, b.config.vocab_size)
    _, fb = run(b, GenerationRequest(first, GREEDY, max_tokens=24))
    assert fa.token_ids == fb.token_ids and fb.timings.draft_n_accepted > 0
    answer = a.tokenizer.decode(fa.token_ids)
    second = ids_of(a, "Now say it shorter.", [{"role": "user", "content": "Tell me a story about a lighthouse."},
                                               {"role": "assistant", "content": answer}])
    _, sa = run(a, GenerationRequest(second, GREEDY, max_tokens=16))
    _, sb = run(b, GenerationRequest(second, GREEDY, max_tokens=16))
    assert sb.timings.cache_n == sa.timings.cache_n > len(first)
    assert sb.token_ids == sa.token_ids


def test_draft_models_with_and_for_recurrent_layers(tiny_qwen3_5, tiny_qwen3_5_moe, tiny_qwen3_untied):
    """Qwen3.5 drafting for itself (every draft accepted: the draft's own cut lands on kept states), Qwen3.5 for
    another Qwen3.5 and for a Qwen3, a Qwen3 for a Qwen3.5: the tokens stay plain decoding's, twice in a row
    (the second request keeps the draft's prefix or falls back to a kept state)."""
    opts = dict(context_length=512, prefill_chunk=16)
    plain = {p: load_model(p, LoadOptions(**opts, spec=SpecOptions("none")))
             for p in (tiny_qwen3_5, tiny_qwen3_5_moe, tiny_qwen3_untied)}
    cases = [(tiny_qwen3_5, tiny_qwen3_5), (tiny_qwen3_5, tiny_qwen3_5_moe), (tiny_qwen3_untied, tiny_qwen3_5),
             (tiny_qwen3_5_moe, tiny_qwen3_untied)]
    for target, draft in cases:
        b = load_model(target, LoadOptions(**opts, spec=SpecOptions(draft_max=4), draft_model=draft))
        for prompt in ("Tell me a story about a lighthouse.", "Tell me a story about a lighthouse keeper."):
            req = GenerationRequest(ids_of(plain[target], prompt), GREEDY, max_tokens=20, ignore_eos=True)
            _, fa = run(plain[target], req)
            _, fb = run(b, req)
            assert fb.token_ids == fa.token_ids, (target, draft)
            assert fb.timings.draft_n > 0
            if target == draft:
                assert fb.timings.draft_n_accepted == fb.timings.draft_n
