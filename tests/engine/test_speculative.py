"""Speculative decoding through Engine.generate: the drafted runs are verified exactly, so the tokens equal plain
decoding's (greedy, and sampled with the same seed), on real weights (SmolLM2) and on the tiny dense, MoE and VL
models; stop strings, grammars, cancellation and the prefix cache see the same sequence as without drafts."""
import dataclasses

import numpy as np
import pytest

from appliance.engine.constraint import constraint_for
from appliance.engine.generate import FinishEvent, GenerationRequest, TokenEvent
from appliance.engine.load import LoadOptions, load_model
from appliance.engine.sampling import SamplingParams
from appliance.engine.speculative import DraftLength, NgramDrafter, SpecOptions
from appliance.protocol.structured import OutputFormat
from tests.support.gguf_files import fetch_smollm2

GREEDY = SamplingParams(temperature=0.0)
PASSAGE = ("The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, polished the "
           "great lens, and wound the clockwork that turned the light. Ships far out at sea watched for its beam, and "
           "the fishermen of the village said that as long as the old man kept the lamp burning, no boat would be "
           "lost on the rocks.")
REWRITE = f"Repeat the following passage exactly, word for word:\n\n{PASSAGE}"
CHAT = "Write a short poem about autumn leaves."


# ---- the pieces ---------------------------------------------------------------------------------------------

def test_ngram_drafter_proposes_what_followed_the_last_earlier_occurrence():
    d = NgramDrafter()
    d.extend([1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 6, 2, 3])
    assert d.propose(3) == [7, 8, 6]       # "6 2 3" is new; "2 3" was last seen at index 6, then 7, 8, 6
    d.extend([7])
    assert d.propose(4) == [8, 6, 2, 3]    # "2 3 7" (three tokens) beats the shorter "3 7"
    assert d.propose(1) == [8]
    d.extend([1, 2, 3])
    assert d.propose(2) == [4, 5]          # the longest match wins: "1 2 3" at the start, over "2 3" later



def test_ngram_drafter_never_matches_the_suffix_itself():
    d = NgramDrafter()
    d.extend([5, 6])
    assert d.propose(4) == []              # the only "5 6" is the suffix
    d.extend([5, 6])
    assert d.propose(4) == [5, 6]          # the first "5 6" was followed by "5 6"
    e = NgramDrafter()
    e.extend([1, 2, 3, 4])
    assert e.propose(2) == []


def test_draft_length_grows_shrinks_and_pauses_when_it_does_not_pay():
    n = DraftLength(SpecOptions(draft_max=8, draft_min=1))
    n.plain_step(10.0)
    assert n.next_k() == 4
    n.verified(4, 4, 12.0)
    assert n.next_k() == 6
    n.verified(6, 1, 12.0)
    assert n.next_k() == 2
    for _ in range(3):                     # nothing accepted and each verify costs 3 steps: it does not pay
        n.verified(2, 0, 30.0)
    assert [n.next_k() for _ in range(8)] == [0] * 8 and n.next_k() > 0


def test_options_refuse_nonsense():
    with pytest.raises(ValueError):
        SpecOptions(mode="eagle")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        SpecOptions(draft_min=4, draft_max=2)


# ---- real weights: drafts from the prompt -------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2() -> str:
    return fetch_smollm2()


@pytest.fixture(scope="module")
def plain(smollm2):
    return load_model(smollm2, LoadOptions(context_length=1024, spec=SpecOptions("none")))


@pytest.fixture(scope="module")
def spec(smollm2):
    return load_model(smollm2, LoadOptions(context_length=1024))


def ids_of(loaded, text, history=()):
    return loaded.tokenizer.encode(loaded.chat_template.render(list(history) + [{"role": "user", "content": text}],
                                                               add_generation_prompt=True))


def run(loaded, req, should_cancel=lambda: False):
    events = list(loaded.engine.generate(req, should_cancel))
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    fin = events[-1]
    assert isinstance(fin, FinishEvent) and len(tokens) == len(events) - 1
    return tokens, fin


def text_of(tokens, fin):
    return "".join(t.text for t in tokens) + fin.text


@pytest.mark.parametrize("task", [REWRITE, CHAT])
def test_greedy_tokens_are_plain_decodings(plain, spec, task):
    req = GenerationRequest(ids_of(plain, task), GREEDY, max_tokens=80)
    ta, fa = run(plain, req)
    tb, fb = run(spec, req)
    assert fb.token_ids == fa.token_ids and text_of(tb, fb) == text_of(ta, fa) and fb.reason == fa.reason
    assert [t.text for t in tb] == [t.text for t in ta]          # one event per token, the same pieces
    assert fa.timings.draft_n == 0 and fb.timings.draft_n > 0
    assert len(fb.timings.decode_ms) == len(fb.token_ids) - 1
    if task is REWRITE:                    # the copy is drafted from the prompt and mostly accepted
        assert fb.timings.draft_n_accepted >= 0.6 * len(fb.token_ids)
    else:                                  # free text: some drafts accepted, some not
        assert 0 < fb.timings.draft_n_accepted < fb.timings.draft_n


def test_sampled_tokens_with_a_seed_are_plain_samplings(plain, spec):
    ids = ids_of(plain, REWRITE)
    accepted = 0
    for seed in range(6):
        sp = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02, repetition_penalty=1.05, seed=seed)
        _, fa = run(plain, GenerationRequest(ids, sp, max_tokens=40))
        _, fb = run(spec, GenerationRequest(ids, sp, max_tokens=40))
        assert fb.token_ids == fa.token_ids, seed
        accepted += fb.timings.draft_n_accepted
    assert accepted > 40


def test_a_stop_string_inside_an_accepted_run(plain, spec):
    ids = ids_of(plain, REWRITE)
    stop = ("polished",)
    ta, fa = run(plain, GenerationRequest(ids, GREEDY, max_tokens=80, stop=stop))
    tb, fb = run(spec, GenerationRequest(ids, GREEDY, max_tokens=80, stop=stop))
    assert fa.reason == fb.reason == "stop" and text_of(tb, fb) == text_of(ta, fa)
    assert "polished" not in text_of(tb, fb) and fb.token_ids == fa.token_ids
    assert fb.timings.draft_n_accepted > 5
    # the cache holds what plain decoding leaves: the prompt and every emitted token but the last
    assert spec.engine.cache_tokens == ids + fb.token_ids[:-1] == plain.engine.cache_tokens
    assert spec.engine.cache.length == len(spec.engine.cache_tokens)


def test_a_follow_up_turn_reuses_exactly_the_accepted_tokens(plain, spec):
    first = ids_of(plain, REWRITE)
    _, fa = run(plain, GenerationRequest(first, GREEDY, max_tokens=48))
    _, fb = run(spec, GenerationRequest(first, GREEDY, max_tokens=48))
    assert fa.token_ids == fb.token_ids and fb.timings.draft_n_accepted > 0
    answer = plain.tokenizer.decode(fa.token_ids)
    second = ids_of(plain, "Now say it shorter.", [{"role": "user", "content": REWRITE},
                                                   {"role": "assistant", "content": answer}])
    ta, sa = run(plain, GenerationRequest(second, GREEDY, max_tokens=24))
    tb, sb = run(spec, GenerationRequest(second, GREEDY, max_tokens=24))
    assert sb.timings.cache_n == sa.timings.cache_n > len(first)
    assert sb.token_ids == sa.token_ids


def test_cancel_mid_run_stops_at_the_same_token(plain, spec):
    ids = ids_of(plain, REWRITE)

    def after(n):
        seen = []

        def should_cancel():
            seen.append(1)
            return len(seen) > n
        return should_cancel
    prefill_polls = -(-len(ids) // plain.engine.prefill_chunk)
    ta, fa = run(plain, GenerationRequest(ids, GREEDY, max_tokens=80), after(prefill_polls + 12))
    tb, fb = run(spec, GenerationRequest(ids, GREEDY, max_tokens=80), after(prefill_polls + 12))
    assert fa.reason == fb.reason == "cancelled" and fb.token_ids == fa.token_ids
    assert len(fb.token_ids) == 13  # polled once per prefill chunk, then after each token: True at the 13th
    assert fb.timings.draft_n_accepted > 0
    assert spec.engine.cache_tokens == ids + fb.token_ids[:-1]


def json_constraint(loaded):
    """A compiled JSON-schema constraint for one model, fresh for each run."""
    return constraint_for(OutputFormat("json_schema", SCHEMA), loaded.tokenizer, loaded.config.vocab_size,
                          loaded.engine.eos_ids)


SCHEMA = {"type": "object", "properties": {"keeper": {"type": "string"}, "stairs": {"type": "string"}},
          "required": ["keeper", "stairs"], "additionalProperties": False}
JSON_TASK = f"{PASSAGE}\n\nAnswer in JSON with keys keeper and stairs, quoting the passage."


def test_a_json_schema_constrains_every_verified_position(plain, spec):
    ids = ids_of(plain, JSON_TASK)
    (ta, fa), (tb, fb) = (run(m, GenerationRequest(ids, GREEDY, max_tokens=60, constraint=json_constraint(m)))
                          for m in (plain, spec))
    assert fb.token_ids == fa.token_ids and fb.reason == fa.reason
    assert fb.timings.draft_n > 0


def test_sampled_tokens_under_a_json_schema_are_plain_samplings(plain, spec):
    """The grammar masks each verified position as plain decoding masks each step, and the seeded generator is
    drawn once per emitted token: the same seed gives the same tokens."""
    ids = ids_of(plain, JSON_TASK)
    drafted = 0
    for seed in range(4):
        sp = SamplingParams(temperature=0.8, seed=seed)
        _, fa = run(plain, GenerationRequest(ids, sp, max_tokens=60, constraint=json_constraint(plain)))
        _, fb = run(spec, GenerationRequest(ids, sp, max_tokens=60, constraint=json_constraint(spec)))
        assert fb.token_ids == fa.token_ids and fb.reason == fa.reason, seed
        drafted += fb.timings.draft_n
    assert drafted > 0


# ---- the tiny models: an oracle drafter that is right most of the time --------------------------------------

class OracleDrafter:
    """Drafts the known plain continuation, with every fifth token wrong: long accepted runs and rejections."""

    def __init__(self, prompt_len: int, truth: list[int], vocab: int):
        self.n = 0
        self.prompt_len, self.truth, self.vocab = prompt_len, truth, vocab

    def extend(self, tokens):
        self.n += len(tokens)

    def propose(self, k):
        at = self.n - self.prompt_len
        out = list(self.truth[at:at + k])
        return [(t + 1) % self.vocab if (at + i) % 5 == 4 else t for i, t in enumerate(out)]


def tiny_pair(path, **kw):
    return (load_model(path, LoadOptions(context_length=512, prefill_chunk=16, spec=SpecOptions("none")), **kw),
            load_model(path, LoadOptions(context_length=512, prefill_chunk=16, spec=SpecOptions(draft_max=6)), **kw))


def check_oracle(plain_m, spec_m, req, constraint=None):
    """`constraint(loaded)`: a fresh constraint for each run (the request's is replaced)."""
    def req_for(m):
        return req if constraint is None else dataclasses.replace(req, constraint=constraint(m))
    _, fa = run(plain_m, req_for(plain_m))
    truth = fa.token_ids
    spec_m.engine.drafter = lambda: OracleDrafter(len(req.prompt_ids), truth, spec_m.config.vocab_size)
    _, fb = run(spec_m, req_for(spec_m))
    assert fb.token_ids == truth
    t = fb.timings
    assert t.draft_n_accepted > len(truth) // 2 and t.draft_n > t.draft_n_accepted
    assert spec_m.engine.cache_tokens == req.prompt_ids + truth[:-1]
    return fb


@pytest.mark.parametrize("fixture", ["tiny_qwen3_untied", "tiny_qwen3_moe"])
def test_tiny_models_verify_exactly(request, fixture):
    path = request.getfixturevalue(fixture)
    a, b = tiny_pair(path)
    ids = ids_of(a, "Tell me a story about a lighthouse.")
    check_oracle(a, b, GenerationRequest(ids, GREEDY, max_tokens=32, ignore_eos=True))
    check_oracle(a, b, GenerationRequest(ids, SamplingParams(temperature=1.0, seed=3), max_tokens=32,
                                         ignore_eos=True))
    # a JSON schema masks every verified position as plain decoding masks each step, and the seeded generator is
    # drawn once per emitted token: greedy and seeded tokens are plain decoding's
    for sp in (GREEDY, *(SamplingParams(temperature=0.8, seed=s) for s in (1, 2, 3))):
        check_oracle(a, b, GenerationRequest(ids, sp, max_tokens=32), json_constraint)


def test_tiny_vl_with_images_verifies_exactly(tmp_path_factory):
    from appliance.engine.image_processing import decode_image
    from appliance.engine.qwen3_vl import expand_image_pads
    from tests.support.tiny_vl import cached_qwen3_vl, image_bytes

    a, b = tiny_pair(cached_qwen3_vl(tmp_path_factory))
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "a"}},
                                             {"type": "text", "text": "What is it?"}]}]
    ids = a.tokenizer.encode(a.chat_template.render(messages, add_generation_prompt=True))
    patches = [a.model.image_processor.preprocess(decode_image(image_bytes(48, 32, "PNG", seed=1)))]
    ids = expand_image_pads(ids, 151655, [p.num_tokens for p in patches])
    check_oracle(a, b, GenerationRequest(ids, GREEDY, max_tokens=24, ignore_eos=True, images=tuple(patches)))
    check_oracle(a, b, GenerationRequest(ids, GREEDY, max_tokens=24, images=tuple(patches)), json_constraint)


# ---- the distribution ---------------------------------------------------------------------------------------

CHI2_999 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515}  # chi-square quantiles at 1 - 0.001


@pytest.mark.parametrize("source", ["ngram", "draft_model"])
def test_sampled_distribution_with_independent_seeds_matches_plain(scripted_qwen3, source):
    """Seeds differ between the two arms, so this is a distribution test, not the same-seed identity: the
    scripted model's third answer token, 300 draws each, drafts from the prompt (whose "\\n\\n Sunny in Paris"
    drafts the answer from its first token on) or from the model itself as --draft-model. Temperature 2 with a
    repetition penalty of 1.25 (the script's tokens are in the prompt) makes each scripted token about 0.7
    likely, so drafts are often rejected and the resample branch runs (a mutation keeping every draft fails at
    chi2 79 > 10.8)."""
    a, b = tiny_pair(scripted_qwen3)
    if source == "draft_model":
        b = load_model(scripted_qwen3, LoadOptions(context_length=512, prefill_chunk=16, spec=SpecOptions(draft_max=6),
                                                   draft_model=scripted_qwen3))
    ids = a.tokenizer.encode(a.chat_template.render(
        [{"role": "user", "content": "Say this\n\n Sunny in Paris today."}],
        add_generation_prompt=True, enable_thinking=False))
    counts, accepted, rejected = third_token_counts((a, b), ids, 2.0, 300, repetition_penalty=1.25)
    assert accepted > 150 and rejected > 100  # measured: 239 / 181 (ngram), 238 / 519 (draft model)
    assert_same_distribution(counts, 300)


def third_token_counts(arms, ids, temperature: float, draws: int, **sampling) -> tuple[list[dict[int, int]], int, int]:
    """Each arm's counts of the third answer token over `draws` seeds (different seeds per arm), and the drafted
    tokens accepted and rejected over all the runs. `sampling`: further SamplingParams fields."""
    counts: list[dict[int, int]] = [{} for _ in arms]
    accepted = rejected = 0
    for arm, loaded in enumerate(arms):
        for seed in range(draws):
            sp = SamplingParams(temperature=temperature, seed=seed + 100_000 * arm, **sampling)
            _, fin = run(loaded, GenerationRequest(ids, sp, max_tokens=4, ignore_eos=True))
            tok = fin.token_ids[2]
            counts[arm][tok] = counts[arm].get(tok, 0) + 1
            accepted += fin.timings.draft_n_accepted
            rejected += fin.timings.draft_n - fin.timings.draft_n_accepted
    return counts, accepted, rejected


def assert_same_distribution(counts: list[dict[int, int]], draws: int) -> None:
    """Chi-square homogeneity test of two arms' token counts (draws each) at the 0.001 level, over the (up to 4)
    tokens drawn at least 20 times in the two arms together and one category for all the others."""
    top = sorted(set(counts[0]) | set(counts[1]), key=lambda t: -(counts[0].get(t, 0) + counts[1].get(t, 0)))
    cats = [t for t in top if counts[0].get(t, 0) + counts[1].get(t, 0) >= 20][:4]
    assert cats, counts
    table = np.array([[c.get(t, 0) for t in cats] + [draws - sum(c.get(t, 0) for t in cats)] for c in counts], float)
    table = table[:, table.sum(0) > 0]
    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    chi2 = float(((table - expected) ** 2 / expected).sum())
    df = table.shape[1] - 1
    assert df >= 1 and chi2 < CHI2_999[df], (chi2, df, table)
