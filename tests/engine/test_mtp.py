"""Qwen3.5's multi-token-prediction head as the draft (`--spec mtp`, the default when the checkpoint has one):
greedy and seeded tokens identical to plain decoding on tiny dense and MoE checkpoints with a random head
(drafts made, mostly rejected), acceptance on a checkpoint whose head is right by construction (every draft of
a chain accepted only if the head is fed the right token at the right position), the prefix cache and a
follow-up turn, and the choice of drafter at load."""
import pytest

from appliance.engine.generate import FinishEvent, GenerationRequest
from appliance.engine.load import LoadOptions, ModelLoadError, decoder_of, load_model
from appliance.engine.qwen3_5_mtp import MtpDrafter
from appliance.engine.sampling import SamplingParams
from appliance.engine.speculative import NgramDrafter, SpecOptions
from tests.engine.test_speculative import GREEDY, assert_same_distribution, ids_of, run, third_token_counts
from tests.support.tiny_models import make_bigram_with_mtp

OPTS = dict(context_length=512, prefill_chunk=16)
STORY = "Tell me a story about a lighthouse."


def pair(path):
    return (load_model(path, LoadOptions(**OPTS, spec=SpecOptions("none"))),
            load_model(path, LoadOptions(**OPTS, spec=SpecOptions(draft_max=4))))


@pytest.fixture(scope="module", params=["tiny_qwen3_5_mtp", "tiny_qwen3_5_moe_mtp"])
def mtp_path(request):
    return request.getfixturevalue(request.param)


def test_the_head_drafts_and_the_tokens_are_plain_decodings(mtp_path):
    a, b = pair(mtp_path)
    assert decoder_of(b.model).mtp is not None and isinstance(b.engine.drafter(), MtpDrafter)
    assert b.engine.cache.mtp_layer == b.config.num_hidden_layers and a.engine.cache.mtp_layer is None
    for prompt, sp in ((STORY, GREEDY), ("hi", GREEDY), (STORY, SamplingParams(temperature=1.0, seed=5))):
        req = GenerationRequest(ids_of(a, prompt), sp, max_tokens=32, ignore_eos=True)
        ta, fa = run(a, req)
        tb, fb = run(b, req)
        assert fb.token_ids == fa.token_ids and [t.text for t in tb] == [t.text for t in ta]
        assert fb.timings.draft_n > 0


@pytest.mark.parametrize("fixture", ["tiny_qwen3_5_mtp", "tiny_qwen3_5_moe_mtp"])
def test_a_head_right_by_construction_is_accepted(request, fixture, tmp_path):
    path = make_bigram_with_mtp(request.getfixturevalue(fixture), str(tmp_path / "bigram"))
    a, b = pair(path)
    req = GenerationRequest(ids_of(a, STORY), GREEDY, max_tokens=40, ignore_eos=True)
    _, fa = run(a, req)
    _, fb = run(b, req)
    assert fb.token_ids == fa.token_ids
    t = fb.timings
    assert t.draft_n >= 20 and t.draft_n_accepted >= 0.9 * t.draft_n, (t.draft_n, t.draft_n_accepted)
    # a follow-up turn: the head's keys and hidden state come back with the prefix (the drafts stay right)
    second = ids_of(a, "Shorter.", [{"role": "user", "content": STORY},
                                    {"role": "assistant", "content": a.tokenizer.decode(fa.token_ids)}])
    _, sa = run(a, GenerationRequest(second, GREEDY, max_tokens=24, ignore_eos=True))
    _, sb = run(b, GenerationRequest(second, GREEDY, max_tokens=24, ignore_eos=True))
    assert sb.token_ids == sa.token_ids
    # plain decoding resumes at a prefill snapshot; here a verify step's state can be nearer the turn's end
    assert sb.timings.cache_n >= sa.timings.cache_n > 0
    assert sb.timings.draft_n_accepted >= 0.9 * sb.timings.draft_n > 0


def test_a_stop_string_inside_an_accepted_run(tiny_qwen3_5_mtp, tmp_path):
    a, b = pair(make_bigram_with_mtp(tiny_qwen3_5_mtp, str(tmp_path / "bigram")))
    ids = ids_of(a, STORY)
    _, f0 = run(a, GenerationRequest(ids, GREEDY, max_tokens=40, ignore_eos=True))
    stop = a.tokenizer.decode(f0.token_ids[20:22])
    ta, fa = run(a, GenerationRequest(ids, GREEDY, max_tokens=40, ignore_eos=True, stop=(stop,)))
    tb, fb = run(b, GenerationRequest(ids, GREEDY, max_tokens=40, ignore_eos=True, stop=(stop,)))
    assert fa.reason == fb.reason == "stop" and fb.token_ids == fa.token_ids
    assert "".join(t.text for t in tb) + fb.text == "".join(t.text for t in ta) + fa.text
    assert b.engine.cache_tokens == ids + fb.token_ids[:-1] and b.engine.cache.length == len(b.engine.cache_tokens)


def test_sampled_distribution_with_mtp_drafts_matches_plain(tiny_qwen3_5_mtp, tmp_path):
    """Speculative sampling's accept/resample rule on a recurrent model with its MTP head drafting: the third
    answer token at temperature 0.1 (peaked enough that the head's greedy drafts are often, not always, the
    sampled token), 300 draws per arm with different seeds, compared by a chi-square test at the 0.001 level."""
    a, b = pair(make_bigram_with_mtp(tiny_qwen3_5_mtp, str(tmp_path / "bigram")))
    assert isinstance(b.engine.drafter(), MtpDrafter)
    ids = ids_of(a, "Say: Sunny in Paris today.")
    counts, accepted, rejected = third_token_counts((a, b), ids, 0.1, 300)
    assert accepted > 100 and rejected > 50  # drafts were verified, and the resample branch was taken
    assert_same_distribution(counts, 300)


def test_which_drafter_at_load(tiny_qwen3_5_mtp, tiny_qwen3_5):
    ngram = load_model(tiny_qwen3_5_mtp, LoadOptions(**OPTS, spec=SpecOptions("ngram")))
    assert isinstance(ngram.engine.drafter(), NgramDrafter) and ngram.engine.cache.mtp_layer is None
    explicit = load_model(tiny_qwen3_5_mtp, LoadOptions(**OPTS, spec=SpecOptions("mtp")))
    assert isinstance(explicit.engine.drafter(), MtpDrafter)
    without = load_model(tiny_qwen3_5, LoadOptions(**OPTS))  # auto on a checkpoint without the head: n-grams
    assert getattr(decoder_of(without.model), "mtp", None) is None and isinstance(without.engine.drafter(), NgramDrafter)
    with pytest.raises(ModelLoadError, match="no multi-token-prediction head") as e:
        load_model(tiny_qwen3_5, LoadOptions(**OPTS, spec=SpecOptions("mtp")))
    assert "\n" not in str(e.value)


def test_cancelled_mid_run_and_under_a_json_schema(tiny_qwen3_5_mtp, tmp_path):
    """The head right by construction drafts runs of draft_max: a cancel seen after the 10th token (inside a run)
    stops there with plain decoding's tokens and the cache they leave; under a JSON schema the verified positions
    are masked as plain steps are (the tokens are plain decoding's, drafts made)."""
    from appliance.engine.generate import TokenEvent
    from tests.engine.test_speculative import json_constraint

    a, b = pair(make_bigram_with_mtp(tiny_qwen3_5_mtp, str(tmp_path / "bigram")))
    ids = ids_of(a, STORY)
    req = GenerationRequest(ids, GREEDY, max_tokens=40, ignore_eos=True)
    _, truth = run(a, req)
    seen: list[TokenEvent] = []
    fin = None
    for ev in b.engine.generate(req, lambda: len(seen) >= 10):  # polled after each token: True after the 10th
        if isinstance(ev, TokenEvent):
            seen.append(ev)
        else:
            fin = ev
    assert isinstance(fin, FinishEvent) and fin.reason == "cancelled" and fin.token_ids == truth.token_ids[:10]
    t = fin.timings
    assert t.draft_n_accepted >= 6 and t.draft_n > t.draft_n_accepted  # drafted past the cancel: inside a run
    assert b.engine.cache_tokens == ids + fin.token_ids[:-1] and b.engine.cache.length == len(b.engine.cache_tokens)
    (_, fa), (_, fb) = (run(m, GenerationRequest(ids, GREEDY, max_tokens=32, constraint=json_constraint(m)))
                        for m in (a, b))
    assert fb.token_ids == fa.token_ids and fb.reason == fa.reason and fb.timings.draft_n > 0
