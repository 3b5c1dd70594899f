"""Sampler and SamplingParams: greedy, seeds, top-k/top-p/min-p sets against transformers' warpers, penalties
against their formulas and transformers' RepetitionPenaltyLogitsProcessor, logprobs against torch.log_softmax,
validation and generation_config.json defaults."""
from __future__ import annotations

import json
import math
import os
from collections import Counter

import numpy as np
import pytest
import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from appliance.engine.sampling import Sampler, SamplingParamError, SamplingParams, generation_defaults
from tests.support import tiny_models

QWEN_VOCAB = 151936


def logits_of(probs, order=None) -> np.ndarray:
    """Logits whose softmax is `probs`, optionally placed at the ids in `order`."""
    lg = np.log(np.asarray(probs, dtype=np.float64)).astype(np.float32)
    if order is None:
        return lg
    out = np.empty_like(lg)
    out[np.asarray(order)] = lg
    return out


def draw_counts(params: SamplingParams, logits: np.ndarray, n: int) -> Counter:
    s = Sampler(params, logits.shape[0])
    return Counter(s.sample(logits, [], [])[0] for _ in range(n))


def assert_frequencies(counts: Counter, expected: dict[int, float], n: int) -> None:
    """Draws stay inside the expected set and each frequency is within 5 sigma of its probability."""
    assert set(counts) <= set(expected), f"drew tokens outside the set: {set(counts) - set(expected)}"
    for tok, p in expected.items():
        sigma = math.sqrt(p * (1 - p) / n)
        assert abs(counts[tok] / n - p) <= 5 * sigma + 1e-12, (tok, counts[tok] / n, p)


# -- greedy and seeds ------------------------------------------------------------------------------------------
def test_greedy_is_argmax_and_ties_take_lowest_id():
    rng = np.random.default_rng(0)
    s = Sampler(SamplingParams(temperature=0.0), QWEN_VOCAB)
    for _ in range(5):
        lg = rng.standard_normal(QWEN_VOCAB).astype(np.float32)
        tok, lp = s.sample(lg, [1, 2], [])
        assert tok == int(torch.argmax(torch.from_numpy(lg))) and lp is None
    tied = np.zeros(10, dtype=np.float32)
    tied[[7, 3, 9]] = 4.0
    assert Sampler(SamplingParams(temperature=0.0), 10).sample(tied, [], [])[0] == 3


def test_same_seed_same_tokens_different_seeds_differ():
    lg = np.zeros(1000, dtype=np.float32)                      # uniform: 50 draws collide with prob ~1e-150

    def run(seed):
        s = Sampler(SamplingParams(temperature=1.0, seed=seed), 1000)
        gen: list[int] = []
        for _ in range(50):
            gen.append(s.sample(lg, [5], gen)[0])
        return gen

    assert run(1234) == run(1234)
    assert run(1234) != run(1235)
    assert run(-1) == run(-1)                                   # negative seeds are valid and deterministic
    assert run(None) != run(None)                               # unseeded: fresh entropy per request


def test_top_k_1_equals_greedy():
    rng = np.random.default_rng(1)
    for seed in range(20):
        lg = (rng.standard_normal(5000) * 2).astype(np.float32)
        tok, _ = Sampler(SamplingParams(temperature=1.7, top_k=1, seed=seed), 5000).sample(lg, [], [])
        assert tok == int(np.argmax(lg))


# -- candidate sets --------------------------------------------------------------------------------------------
def hf_candidates(lg: np.ndarray, p: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """transformers' warper chain in its own order: temperature, top-k, top-p, min-p."""
    scores = torch.from_numpy(lg.copy())[None]
    ids = torch.zeros((1, 1), dtype=torch.long)
    warpers = [TemperatureLogitsWarper(p.temperature)]
    if p.top_k:
        warpers.append(TopKLogitsWarper(p.top_k))
    if p.top_p < 1.0:
        warpers.append(TopPLogitsWarper(p.top_p))
    if p.min_p > 0.0:
        warpers.append(MinPLogitsWarper(p.min_p))
    for w in warpers:
        scores = w(ids, scores)
    probs = torch.softmax(scores, dim=-1)[0].numpy()
    kept = np.flatnonzero(np.isfinite(scores[0].numpy()))
    return kept, probs[kept]


def test_candidate_sets_equal_transformers_warpers():
    rng = np.random.default_rng(2)
    n_filtered = 0
    for trial in range(300):
        V = int(rng.choice([50, 1000, 5000]))
        lg = (rng.standard_normal(V) * rng.choice([0.5, 2.0, 6.0])).astype(np.float32)
        p = SamplingParams(temperature=float(rng.choice([0.3, 0.7, 1.0, 1.6])),
                           top_k=int(rng.choice([0, 0, 1, 5, 40, 3 * V])),
                           top_p=float(rng.choice([1.0, 0.95, 0.8, 0.3, 0.05])),
                           min_p=float(rng.choice([0.0, 0.0, 0.02, 0.1, 0.5])))
        ids, probs = Sampler(p, V).candidates(lg)
        ref_ids, ref_probs = hf_candidates(lg, p)
        np.testing.assert_array_equal(ids, ref_ids, err_msg=f"trial {trial}: {p}")
        np.testing.assert_allclose(probs, ref_probs, rtol=1e-4, atol=1e-7)
        n_filtered += ids.shape[0] < V
    assert n_filtered > 200                                     # the filters actually cut most of the time


def test_top_k_keeps_the_k_largest_and_ties_with_the_kth():
    lg = logits_of([0.1, 0.4, 0.2, 0.3], order=[3, 0, 2, 1])     # id -> prob: 0:.4 1:.3 2:.2 3:.1
    assert Sampler(SamplingParams(top_k=2), 4).candidates(lg)[0].tolist() == [0, 1]
    assert Sampler(SamplingParams(top_k=3), 4).candidates(lg)[0].tolist() == [0, 1, 2]
    tied = np.array([1.0, 3.0, 3.0, 2.0], dtype=np.float32)
    assert Sampler(SamplingParams(top_k=1), 4).candidates(tied)[0].tolist() == [1, 2]
    n = 20000
    assert_frequencies(draw_counts(SamplingParams(top_k=2, seed=3), lg, n), {0: 4 / 7, 1: 3 / 7}, n)


@pytest.mark.parametrize("top_p,kept", [(0.45, [5]), (0.55, [5, 1]), (0.75, [5, 1]), (0.85, [5, 1, 3]),
                                        (0.96, [5, 1, 3, 0]), (1.0, [0, 1, 2, 3, 4, 5])])
def test_top_p_keeps_the_smallest_prefix_reaching_p(top_p, kept):
    # id 5: .5, id 1: .3, id 3: .15, id 0: .04, ids 2 and 4: .005 each
    lg = logits_of([0.04, 0.3, 0.005, 0.15, 0.005, 0.5])
    ids, probs = Sampler(SamplingParams(top_p=top_p), 6).candidates(lg)
    assert sorted(ids.tolist()) == sorted(kept)
    full = np.exp(lg.astype(np.float64))
    np.testing.assert_allclose(probs, full[ids] / full[ids].sum(), rtol=1e-6)


def test_top_p_draws_follow_the_renormalized_set():
    lg = logits_of([0.04, 0.3, 0.005, 0.15, 0.005, 0.5])
    n = 20000
    expected = {5: 0.5 / 0.95, 1: 0.3 / 0.95, 3: 0.15 / 0.95}
    assert_frequencies(draw_counts(SamplingParams(top_p=0.85, seed=11), lg, n), expected, n)


def test_top_p_boundary_ties_keep_the_lowest_ids():
    lg = np.zeros(8, dtype=np.float32)                          # uniform: top_p 0.3 keeps 3 of 8 (0, .125, .25 < .3)
    assert Sampler(SamplingParams(top_p=0.3), 8).candidates(lg)[0].tolist() == [0, 1, 2]
    # exactly at the boundary (masses are exact in binary): a token with .5 before it is dropped at top_p .5,
    # as transformers drops tokens whose mass at-or-below is <= 1 - top_p.
    lg4 = np.zeros(4, dtype=np.float32)
    ours = Sampler(SamplingParams(top_p=0.5), 4).candidates(lg4)[0]
    assert ours.tolist() == [0, 1] and len(hf_candidates(lg4, SamplingParams(top_p=0.5))[0]) == 2


def test_min_p_keeps_tokens_above_the_scaled_threshold():
    lg = logits_of([0.2, 0.1, 0.4, 0.3])                       # p_max .4
    assert Sampler(SamplingParams(min_p=0.4), 4).candidates(lg)[0].tolist() == [0, 2, 3]   # p >= .16
    assert Sampler(SamplingParams(min_p=0.6), 4).candidates(lg)[0].tolist() == [2, 3]      # p >= .24
    assert Sampler(SamplingParams(min_p=1.0), 4).candidates(lg)[0].tolist() == [2]
    n = 20000
    assert_frequencies(draw_counts(SamplingParams(min_p=0.6, seed=5), lg, n), {2: 4 / 7, 3: 3 / 7}, n)


def test_filters_apply_after_temperature_and_top_p_after_top_k():
    lg = logits_of([0.4, 0.3, 0.2, 0.1])
    # top_p alone at .75: masses before each token 0, .4, .7 -> three kept; after top_k=3 renormalizes to
    # 4/9, 3/9, 2/9 the third has .78 before it -> two kept.
    assert Sampler(SamplingParams(top_p=0.75), 4).candidates(lg)[0].tolist() == [0, 1, 2]
    assert Sampler(SamplingParams(top_p=0.75, top_k=3), 4).candidates(lg)[0].tolist() == [0, 1]
    # temperature .5 squares the probabilities: .533, .3, .133, .033 -> top_p .8 keeps two (three at T=1).
    assert Sampler(SamplingParams(top_p=0.8), 4).candidates(lg)[0].tolist() == [0, 1, 2]
    assert Sampler(SamplingParams(top_p=0.8, temperature=0.5), 4).candidates(lg)[0].tolist() == [0, 1]
    # min_p .4 keeps p >= .16 at T=1 (three) but at T=.5 p/p_max is .5625, .25, .0625 -> two.
    assert Sampler(SamplingParams(min_p=0.4), 4).candidates(lg)[0].tolist() == [0, 1, 2]
    assert Sampler(SamplingParams(min_p=0.4, temperature=0.5), 4).candidates(lg)[0].tolist() == [0, 1]
    n = 20000
    sq = np.array([0.16, 0.09, 0.04, 0.01]) / 0.30
    expected = {i: float(sq[i]) for i in range(4)}
    assert_frequencies(draw_counts(SamplingParams(temperature=0.5, seed=9), lg, n), expected, n)


def test_full_vocabulary_draw_distribution():
    """Plain temperature sampling over Qwen's vocabulary: half the mass on the last id, the rest uniform."""
    lg = np.zeros(QWEN_VOCAB, dtype=np.float32)
    lg[-1] = math.log(QWEN_VOCAB - 1)
    lg[1000:3000] = -np.inf                                     # a masked span must never be drawn
    p_last = (QWEN_VOCAB - 1) / (2 * (QWEN_VOCAB - 1) - 2000)
    n = 3000
    counts = draw_counts(SamplingParams(seed=21), lg, n)
    assert not any(1000 <= t < 3000 for t in counts)
    assert abs(counts[QWEN_VOCAB - 1] / n - p_last) <= 5 * math.sqrt(p_last * (1 - p_last) / n)
    low = sum(c for t, c in counts.items() if t < QWEN_VOCAB // 2) / n   # uniform part splits evenly
    p_low = (QWEN_VOCAB // 2 - 2000) / (2 * (QWEN_VOCAB - 1) - 2000)
    assert abs(low - p_low) <= 5 * math.sqrt(p_low * (1 - p_low) / n)
    assert len(counts) > 0.9 * n * (1 - p_last)                 # the uniform draws rarely repeat


# -- penalties -------------------------------------------------------------------------------------------------
def test_repetition_penalty_equals_transformers():
    rng = np.random.default_rng(4)
    V = 3000
    lg = (rng.standard_normal(V) * 3).astype(np.float32)
    lg[[10, 11]] = 0.0
    prompt = [10, 11, 5, 5, 2999, 7]
    gen = [int(t) for t in rng.integers(0, V, 40)] + [7, 7]
    for penalty in (1.3, 0.7):
        s = Sampler(SamplingParams(repetition_penalty=penalty), V)
        ours = s.apply_penalties(lg, prompt, gen)
        ids = torch.tensor([prompt + gen])
        ref = RepetitionPenaltyLogitsProcessor(penalty)(ids, torch.from_numpy(lg.copy())[None])[0].numpy()
        np.testing.assert_array_equal(ours, ref)
        assert not np.array_equal(ours, lg)


def test_presence_and_frequency_penalties_follow_the_openai_formula():
    rng = np.random.default_rng(5)
    V = 500
    lg = (rng.standard_normal(V) * 3).astype(np.float32)
    prompt = [1, 2, 3, 3, 3]                                    # the prompt never counts for these two
    pres, freq = 0.8, -0.45
    s = Sampler(SamplingParams(presence_penalty=pres, frequency_penalty=freq), V)
    gen: list[int] = []
    for _step in range(60):                                      # incremental state checked at every step
        out = s.apply_penalties(lg, prompt, gen)
        counts = Counter(gen)
        expected = lg.astype(np.float64).copy()
        for t, c in counts.items():
            expected[t] -= pres + freq * c
        np.testing.assert_allclose(out, expected, rtol=0, atol=1e-5)
        gen.append(int(rng.choice([3, 4, 9, int(rng.integers(0, V))])))
    assert Counter(gen)[4] > 3 and np.all(out[[1, 2]] == lg[[1, 2]])


def test_penalties_compose_in_order_and_steer_greedy():
    lg = np.array([5.0, 4.9, -1.0, 0.5], dtype=np.float32)
    p = SamplingParams(temperature=0.0, repetition_penalty=1.25, presence_penalty=0.5, frequency_penalty=0.25)
    s = Sampler(p, 4)
    out = s.apply_penalties(lg, [2], [0, 0])
    # id 0: 5/1.25 - .5 - .25*2 = 3.0; id 2 (prompt only): -1*1.25; others untouched.
    np.testing.assert_allclose(out, [3.0, 4.9, -1.25, 0.5], rtol=1e-6)
    assert s.sample(lg, [2], [0, 0])[0] == 1                    # the penalized argmax, not the raw one
    np.testing.assert_array_equal(lg, np.array([5.0, 4.9, -1.0, 0.5], dtype=np.float32))   # caller's, untouched


def test_penalty_state_restarts_for_a_different_history():
    V = 50
    lg = np.linspace(-2, 2, V).astype(np.float32)
    s = Sampler(SamplingParams(frequency_penalty=1.0, repetition_penalty=2.0), V)
    s.apply_penalties(lg, [1, 2], [3, 3, 4])
    fresh = Sampler(SamplingParams(frequency_penalty=1.0, repetition_penalty=2.0), V)
    np.testing.assert_array_equal(s.apply_penalties(lg, [7], [8]), fresh.apply_penalties(lg, [7], [8]))


# -- logprobs --------------------------------------------------------------------------------------------------
def test_logprobs_are_log_softmax_of_raw_logits():
    rng = np.random.default_rng(6)
    V = QWEN_VOCAB
    lg = (rng.standard_normal(V) * 4).astype(np.float32)
    # float64 reference on the same float32 logits (torch's float32 log_softmax is itself off by ~1e-5 at 152k)
    ref = torch.log_softmax(torch.from_numpy(lg).double(), dim=-1).numpy()
    ref32 = torch.log_softmax(torch.from_numpy(lg), dim=-1).numpy()
    p = SamplingParams(temperature=0.4, top_p=0.9, repetition_penalty=1.5, presence_penalty=1.0, seed=1,
                       logprobs=True, top_logprobs=20)
    s = Sampler(p, V)
    gen: list[int] = []
    for _ in range(4):
        tok, lp = s.sample(lg, [int(np.argmax(lg))], gen)
        gen.append(tok)
        assert lp.token_id == tok
        assert lp.logprob == pytest.approx(float(ref[tok]), abs=1e-9)
        assert lp.logprob == pytest.approx(float(ref32[tok]), abs=5e-5)
        ref_top = torch.topk(torch.from_numpy(ref), 20)
        assert [t for t, _ in lp.top] == ref_top.indices.tolist()
        np.testing.assert_allclose([v for _, v in lp.top], ref_top.values.numpy(), rtol=0, atol=1e-9)


def test_logprobs_ties_count_and_absence():
    lg = np.array([1.0, 5.0, 5.0, 3.0, 5.0], dtype=np.float32)
    tok, lp = Sampler(SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2), 5).sample(lg, [], [])
    assert tok == 1 and [t for t, _ in lp.top] == [1, 2]
    _, lp0 = Sampler(SamplingParams(temperature=0.0, logprobs=True), 5).sample(lg, [], [])
    assert lp0.top == [] and lp0.logprob == pytest.approx(float(torch.log_softmax(torch.from_numpy(lg), 0)[1]))
    assert Sampler(SamplingParams(), 5).sample(lg, [], [])[1] is None


# -- validation and defaults -----------------------------------------------------------------------------------
@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("temperature", 2.01), ("temperature", float("nan")), ("temperature", "1"),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", -1), ("top_k", -1), ("top_k", 2.5), ("top_k", True),
    ("min_p", -0.01), ("min_p", 1.5), ("presence_penalty", 2.5), ("presence_penalty", -2.01),
    ("frequency_penalty", -3), ("frequency_penalty", float("inf")), ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0), ("top_logprobs", 21), ("top_logprobs", -1), ("seed", 1.5), ("logprobs", 1),
])
def test_out_of_range_values_name_the_field(field, value):
    kwargs = {field: value}
    if field == "top_logprobs":
        kwargs["logprobs"] = True
    with pytest.raises(SamplingParamError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == field and isinstance(e.value, ValueError) and field in str(e.value)


def test_boundary_values_are_accepted():
    SamplingParams(temperature=0.0, top_p=1.0, min_p=1.0, presence_penalty=-2.0, frequency_penalty=2.0,
                   repetition_penalty=0.01, logprobs=True, top_logprobs=20, seed=-5)
    SamplingParams(temperature=2, top_k=0, min_p=0, top_p=1e-9)
    with pytest.raises(SamplingParamError) as e:
        SamplingParams(top_logprobs=3)                          # needs logprobs, as in the OpenAI API
    assert e.value.param == "top_logprobs"


def test_generation_config_defaults(tmp_path):
    tiny_models.write_generation_config(str(tmp_path), min_p=0.05, repetition_penalty=1.1)
    with open(os.path.join(tmp_path, "generation_config.json")) as f:
        gc = json.load(f)
    hf = GenerationConfig.from_pretrained(str(tmp_path))
    p = SamplingParams.from_generation_config(gc)
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty) == \
        (hf.temperature, hf.top_k, hf.top_p, hf.min_p, hf.repetition_penalty) == (0.6, 20, 0.95, 0.05, 1.1)
    q = SamplingParams.from_generation_config(gc, temperature=0.0, top_p=None, seed=3, presence_penalty=1.0)
    assert (q.temperature, q.top_p, q.top_k, q.seed, q.presence_penalty) == (0.0, 0.95, 20, 3, 1.0)
    assert SamplingParams.from_generation_config(None) == SamplingParams()


def test_generation_config_do_sample_false_means_greedy_and_bad_values_are_skipped():
    gc = {"do_sample": False, "temperature": 0.7, "top_k": 50, "top_p": None, "min_p": 3.0}
    assert generation_defaults(gc) == {"temperature": 0.0, "top_k": 50}
    assert SamplingParams.from_generation_config(gc).greedy
    assert SamplingParams.from_generation_config(gc, temperature=0.8).temperature == 0.8
    assert SamplingParams.from_generation_config({"temperature": 0.7}).temperature == 0.7
    with pytest.raises(SamplingParamError) as e:
        SamplingParams.from_generation_config(gc, top_p=0.0)    # request values are validated
    assert e.value.param == "top_p"
    with pytest.raises(TypeError):
        SamplingParams.from_generation_config(gc, temprature=0.5)
