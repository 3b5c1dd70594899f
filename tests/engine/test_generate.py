"""Engine.generate on a real tiny checkpoint with the real tokenizer: stops, eos, limits, cancel, timings."""
import dataclasses

import numpy as np
import pytest

from appliance.engine.generate import FinishEvent, GenerationRequest, TokenEvent
from appliance.engine.kv_cache import ContextLengthError
from appliance.engine.load import ModelLoadError, load_model
from appliance.engine.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def loaded(tiny_qwen3_tied):
    return load_model(tiny_qwen3_tied, context_length=256, prefill_chunk=8)


def prompt(loaded, text="Tell me a story."):
    rendered = loaded.chat_template.render([{"role": "user", "content": text}], add_generation_prompt=True,
                                           enable_thinking=False)
    return loaded.tokenizer.encode(rendered)


def run(loaded, req, should_cancel=lambda: False):
    events = list(loaded.engine.generate(req, should_cancel))
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    assert isinstance(events[-1], FinishEvent) and all(isinstance(e, TokenEvent) for e in events[:-1])
    return tokens, events[-1]


def text_of(tokens, fin):
    return "".join(t.text for t in tokens) + fin.text


def test_max_tokens_and_text_equals_decode(loaded):
    tokens, fin = run(loaded, GenerationRequest(prompt(loaded), GREEDY, max_tokens=24, ignore_eos=True))
    assert len(tokens) == 24 and fin.reason == "length" and fin.completion_tokens == 24
    assert fin.token_ids == [t.token_id for t in tokens]
    # the streamed pieces, UTF-8 holdback included, add up to exactly the decoded text
    assert text_of(tokens, fin) == loaded.tokenizer.decode(fin.token_ids)
    assert fin.timings.prefill_chunks == -(-fin.prompt_tokens // 8)
    assert len(fin.timings.decode_ms) == 23 and fin.timings.ttft_ms >= fin.timings.prefill_ms > 0


def test_stop_string_cuts_before_it(loaded):
    ids = prompt(loaded)
    tokens, fin = run(loaded, GenerationRequest(ids, GREEDY, max_tokens=40, ignore_eos=True))
    full = text_of(tokens, fin)
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert len(stop) == 3
    tokens2, fin2 = run(loaded, GenerationRequest(ids, GREEDY, max_tokens=40, ignore_eos=True, stop=(stop,)))
    assert fin2.reason == "stop"
    assert text_of(tokens2, fin2) == full[:full.index(stop)]
    assert stop not in text_of(tokens2, fin2)


def test_eos_ends_with_stop_and_never_shows_eos_text(loaded):
    ids = prompt(loaded)
    tokens, fin = run(loaded, GenerationRequest(ids, GREEDY, max_tokens=6, ignore_eos=True))
    # make the 4th greedy token an end-of-sequence id: generation must stop there
    eos = tokens[3].token_id
    engine = loaded.engine
    saved = engine.eos_ids
    engine.eos_ids = {eos}
    try:
        tokens2, fin2 = run(loaded, GenerationRequest(ids, GREEDY, max_tokens=6))
    finally:
        engine.eos_ids = saved
    assert fin2.reason == "stop" and len(tokens2) == 4 and tokens2[-1].text == ""
    assert text_of(tokens2, fin2) == loaded.tokenizer.decode([t.token_id for t in tokens[:3]])


def test_cancel_between_prefill_chunks(loaded):
    ids = prompt(loaded, "word " * 60)
    before = loaded.engine.prefill_chunks_run
    polls = []

    def cancel_on_third_poll():
        polls.append(1)
        return len(polls) >= 3

    tokens, fin = run(loaded, GenerationRequest(ids, GREEDY, max_tokens=5), cancel_on_third_poll)
    assert fin.reason == "cancelled" and tokens == []
    assert loaded.engine.prefill_chunks_run - before == 2


def test_cancel_between_decode_steps(loaded):
    ids = prompt(loaded)
    steps = []
    gen = loaded.engine.generate(GenerationRequest(ids, GREEDY, max_tokens=50, ignore_eos=True),
                                 lambda: len(steps) >= 5)
    before = loaded.engine.decode_steps_run
    events = []
    for ev in gen:
        events.append(ev)
        if isinstance(ev, TokenEvent):
            steps.append(ev)
    assert events[-1].reason == "cancelled" and len(steps) == 5
    assert loaded.engine.decode_steps_run - before == 4  # no forward pass after the cancel was seen
    # the slot is free: the next request runs from an empty cache and matches a fresh run
    tokens, fin = run(loaded, GenerationRequest(ids, GREEDY, max_tokens=5, ignore_eos=True))
    again, _ = run(loaded, GenerationRequest(ids, GREEDY, max_tokens=5, ignore_eos=True))
    assert [t.token_id for t in tokens] == [t.token_id for t in again]


def test_context_limit_is_a_clear_error(loaded):
    with pytest.raises(ContextLengthError, match="context length"):
        next(loaded.engine.generate(GenerationRequest(list(range(300)), GREEDY)))
    # max_tokens is capped by what is left of the context
    ids = prompt(loaded)
    tokens, fin = run(loaded, GenerationRequest(ids, GREEDY, max_tokens=10_000, ignore_eos=True))
    assert fin.reason == "length" and fin.prompt_tokens + fin.completion_tokens == 256


def test_seeded_sampling_is_reproducible(loaded):
    ids = prompt(loaded)
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=1234)
    a, _ = run(loaded, GenerationRequest(ids, p, max_tokens=12, ignore_eos=True))
    b, _ = run(loaded, GenerationRequest(ids, p, max_tokens=12, ignore_eos=True))
    c, _ = run(loaded, GenerationRequest(ids, dataclasses.replace(p, seed=99), max_tokens=12, ignore_eos=True))
    assert [t.token_id for t in a] == [t.token_id for t in b]
    assert [t.token_id for t in a] != [t.token_id for t in c]


def test_load_errors_are_one_line(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(str(tmp_path / "nope"))
    (tmp_path / "config.json").write_text('{"model_type": "mamba"}')
    with pytest.raises(ModelLoadError, match="unsupported model type 'mamba'"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="cannot read"):
        load_model(str(tmp_path))


def test_warm_up_leaves_the_active_sequence_and_output_unchanged(loaded):
    """The warm-up token goes after the active sequence (at start: a prefix adopted from --prompt-cache-dir)
    and is taken back, so the next request still reuses that sequence and decodes the same tokens."""
    eng = loaded.engine
    eng.drop_sequence()
    ids = prompt(loaded)
    before, _ = run(loaded, GenerationRequest(ids, GREEDY, max_tokens=6, ignore_eos=True))
    held, k_before = list(eng.cache_tokens), eng.cache.copy_prefix(len(eng.cache_tokens))[0][0]
    eng.warm_up()
    assert eng.cache.length == len(held) > 0 and eng.cache_tokens == held
    assert np.array_equal(eng.cache.copy_prefix(len(held))[0][0], k_before)
    after, fin = run(loaded, GenerationRequest(ids, GREEDY, max_tokens=6, ignore_eos=True))
    assert fin.timings.cache_n == len(ids) - 1
    assert [t.token_id for t in after] == [t.token_id for t in before]
    eng.drop_sequence()
    eng.warm_up()
    assert eng.cache.length == 0 and eng.cache_tokens == []
