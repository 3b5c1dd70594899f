"""Drafts from a second model (--draft-model) through Engine.generate: whatever the draft model is, the tokens are
plain decoding's (greedy, and sampled with the same seed). The target drafting for itself accepts nearly every
draft; a different random model with the same tokenizer accepts few; both give the same tokens. The draft's KV
cache follows the accepted tokens; a draft model of another tokenizer is refused (Qwen3.5 drafts and targets: test_speculative_recurrent.py)."""
import pytest

from appliance.engine.generate import FinishEvent, GenerationRequest, TokenEvent
from appliance.engine.load import LoadOptions, MismatchedDraft, ModelLoadError, load_model
from appliance.engine.sampling import SamplingParams
from appliance.engine.speculative import SpecOptions

GREEDY = SamplingParams(temperature=0.0)
PROMPTS = ["Tell me a story about a lighthouse.", "List three colours and say why you like them."]


def options(**kw) -> LoadOptions:
    return LoadOptions(context_length=512, prefill_chunk=16, **kw)


@pytest.fixture(scope="module")
def plain(tiny_qwen3_untied):
    return load_model(tiny_qwen3_untied, options(spec=SpecOptions("none")))


@pytest.fixture(scope="module")
def self_drafted(tiny_qwen3_untied):
    """The target drafting for itself: the draft's greedy choice is the target's (acceptance by construction)."""
    return load_model(tiny_qwen3_untied, options(spec=SpecOptions(draft_max=6), draft_model=tiny_qwen3_untied))


@pytest.fixture(scope="module")
def other_drafted(tiny_qwen3_untied, tiny_qwen3_tied):
    """Another random model with the same tokenizer drafting: its guesses are mostly wrong."""
    return load_model(tiny_qwen3_untied, options(spec=SpecOptions(draft_max=6), draft_model=tiny_qwen3_tied))


def ids_of(loaded, text):
    return loaded.tokenizer.encode(loaded.chat_template.render([{"role": "user", "content": text}],
                                                               add_generation_prompt=True))


def run(loaded, req, should_cancel=lambda: False):
    events = list(loaded.engine.generate(req, should_cancel))
    fin = events[-1]
    assert isinstance(fin, FinishEvent) and all(isinstance(e, TokenEvent) for e in events[:-1])
    assert len(events) - 1 == len(fin.token_ids)          # one event per token
    return events[:-1], fin


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_tokens_equal_plain_decoding_whatever_the_draft(plain, self_drafted, other_drafted, prompt):
    req = GenerationRequest(ids_of(plain, prompt), GREEDY, max_tokens=40, ignore_eos=True)
    ta, fa = run(plain, req)
    tb, fb = run(self_drafted, req)
    tc, fc = run(other_drafted, req)
    assert fb.token_ids == fa.token_ids == fc.token_ids
    assert [t.text for t in tb] == [t.text for t in ta] == [t.text for t in tc]
    high, low = fb.timings, fc.timings
    assert high.draft_n > 0 and high.draft_n_accepted >= 0.8 * high.draft_n      # itself: nearly all accepted
    assert low.draft_n > 0 and low.draft_n_accepted <= 0.3 * low.draft_n         # another model: few
    assert self_drafted.engine.decode_steps_run < plain.engine.decode_steps_run  # fewer target forwards
    for m in (self_drafted, other_drafted):      # both caches hold the sequence plain decoding leaves
        assert m.engine.cache_tokens == req.prompt_ids + fa.token_ids[:-1]
        draft = m.engine.draft_model
        assert draft.cache.length == len(draft.cache_tokens)
        assert draft.cache_tokens[:len(req.prompt_ids)] == req.prompt_ids


def test_sampled_tokens_with_a_seed_equal_plain_sampling(plain, self_drafted, other_drafted):
    ids = ids_of(plain, PROMPTS[0])
    accepted = 0
    for seed in range(4):
        sp = SamplingParams(temperature=0.7, top_k=40, top_p=0.9, repetition_penalty=1.05, seed=seed)
        req = GenerationRequest(ids, sp, max_tokens=24, ignore_eos=True)
        _, fa = run(plain, req)
        _, fb = run(self_drafted, req)
        _, fc = run(other_drafted, req)
        assert fb.token_ids == fa.token_ids == fc.token_ids, seed
        accepted += fb.timings.draft_n_accepted
    assert accepted > 0


def test_the_draft_cache_follows_the_target_across_requests(plain, self_drafted):
    """A follow-up prompt extending the last sequence runs only its new tokens through the draft model too;
    a cancelled generation leaves both caches on the same tokens as plain decoding."""
    first = ids_of(plain, PROMPTS[0])
    _, fa = run(self_drafted, GenerationRequest(first, GREEDY, max_tokens=12, ignore_eos=True))
    draft = self_drafted.engine.draft_model
    second = first + fa.token_ids + plain.tokenizer.encode("<|im_end|>\n<|im_start|>user\nMore.<|im_end|>\n"
                                                          "<|im_start|>assistant\n")
    starts = []
    forward = draft._forward

    def spy(tokens, logits):
        starts.append(draft.cache.length)
        return forward(tokens, logits)
    draft._forward = spy
    try:
        _, fb = run(self_drafted, GenerationRequest(second, GREEDY, max_tokens=12, ignore_eos=True))
    finally:
        del draft._forward
    _, fp = run(plain, GenerationRequest(second, GREEDY, max_tokens=12, ignore_eos=True))
    assert fb.token_ids == fp.token_ids and fb.timings.cache_n == len(first) + len(fa.token_ids) - 1
    assert starts and min(starts) >= len(first)  # the shared prefix is not run through the draft model again

    polls = []

    def cancel_soon():
        polls.append(1)
        return len(polls) > 9
    _, fc = run(self_drafted, GenerationRequest(first, GREEDY, max_tokens=40, ignore_eos=True), cancel_soon)
    assert fc.reason == "cancelled" and 0 < len(fc.token_ids) < 12 and fc.token_ids == fa.token_ids[:len(fc.token_ids)]
    assert self_drafted.engine.cache_tokens == first + fc.token_ids[:-1]


def test_a_cancel_during_the_draft_prompt_prefill(plain, self_drafted):
    """The draft model's prompt prefill polls should_cancel between its chunks: the generation stops after its
    first token, the draft keeps the whole chunks it ran, and the next request is plain decoding's again."""
    ids = ids_of(plain, " ".join(PROMPTS * 3))
    engine, draft = self_drafted.engine, self_drafted.engine.draft_model
    engine.drop_sequence()
    engine.store.clear()                       # nothing of the prompt reused: the target prefills every chunk
    draft.drop_sequence()
    target_polls = -(-len(ids) // engine.prefill_chunk)
    polls = []

    def cancel_in_draft_prefill():
        polls.append(1)
        return len(polls) > target_polls + 1   # the target's chunks, the draft's first chunk, then stop
    _, fin = run(self_drafted, GenerationRequest(ids, GREEDY, max_tokens=20, ignore_eos=True), cancel_in_draft_prefill)
    assert fin.reason == "cancelled" and len(fin.token_ids) == 1
    assert draft.cache_tokens == ids[:draft.prefill_chunk] and draft.cache.length == draft.prefill_chunk
    req = GenerationRequest(ids, GREEDY, max_tokens=20, ignore_eos=True)
    assert run(self_drafted, req)[1].token_ids == run(plain, req)[1].token_ids


def test_the_draft_counts_in_the_memory_budget(tiny_qwen3_untied, tiny_qwen3_tied, self_drafted):
    e = self_drafted.engine
    assert e.active_bytes_per_token == e.cache.bytes_per_token + e.draft_model.cache.bytes_per_token
    assert e.draft_model.cache.max_len == e.context_length


def test_another_tokenizer_is_refused_in_one_line(tiny_qwen3_untied, tmp_path):
    from tests.support.tiny_files import write_hf_dir
    other = write_hf_dir(str(tmp_path / "other-vocab"))
    with pytest.raises(MismatchedDraft, match="not the model's tokenizer") as e:
        load_model(tiny_qwen3_untied, options(draft_model=other))
    assert "\n" not in str(e.value) and "other-vocab" in str(e.value)
    with pytest.raises(ModelLoadError, match="--draft-model path does not exist"):
        load_model(tiny_qwen3_untied, options(draft_model=str(tmp_path / "missing")))


def test_a_gguf_model_takes_a_directory_draft_of_its_tokenizer(plain, tiny_qwen3_untied, tiny_qwen3_tied, tmp_path):
    """The GGUF converter pads the vocabulary to the embedding's rows with [PAD<id>] tokens: still the same
    tokenizer, so a GGUF target drafts from a Hugging Face directory (and the tokens stay plain decoding's)."""
    from appliance.convert import convert
    target = convert(tiny_qwen3_untied, str(tmp_path / "target.gguf"), "f32")
    gguf_plain = load_model(target, options(spec=SpecOptions("none")))
    drafted = load_model(target, options(spec=SpecOptions(draft_max=4), draft_model=tiny_qwen3_untied))
    assert len(drafted.tokenizer) > len(plain.tokenizer)                  # padded, and not
    req = GenerationRequest(ids_of(plain, PROMPTS[1]), GREEDY, max_tokens=24, ignore_eos=True)
    _, fa = run(gguf_plain, req)
    _, fb = run(drafted, req)
    assert fb.token_ids == fa.token_ids and fb.timings.draft_n_accepted > 0


def test_qwen3_vl_with_a_draft_model(tiny_qwen3_untied, tmp_path_factory):
    """A Qwen3-VL model with an image in the prompt drafts from a text model (which reads the image pads as
    tokens: its drafts are only guesses, and the tokens stay plain decoding's); a Qwen3-VL checkpoint drafts
    with its text side."""
    from appliance.engine.image_processing import decode_image
    from appliance.engine.qwen3_vl import expand_image_pads
    from tests.support.tiny_vl import cached_qwen3_vl, image_bytes

    vl = cached_qwen3_vl(tmp_path_factory)
    a = load_model(vl, options(spec=SpecOptions("none")))
    b = load_model(vl, options(spec=SpecOptions(draft_max=4), draft_model=tiny_qwen3_untied))
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "a"}},
                                             {"type": "text", "text": "What is it?"}]}]
    ids = a.tokenizer.encode(a.chat_template.render(messages, add_generation_prompt=True))
    patches = [a.model.image_processor.preprocess(decode_image(image_bytes(48, 32, "PNG", seed=1)))]
    ids = expand_image_pads(ids, 151655, [p.num_tokens for p in patches])
    req = GenerationRequest(ids, GREEDY, max_tokens=16, ignore_eos=True, images=tuple(patches))
    assert run(b, req)[1].token_ids == run(a, req)[1].token_ids
    text_plain = load_model(tiny_qwen3_untied, options(spec=SpecOptions("none")))
    text_drafted = load_model(tiny_qwen3_untied, options(spec=SpecOptions(draft_max=4), draft_model=vl))
    req = GenerationRequest(ids_of(text_plain, PROMPTS[0]), GREEDY, max_tokens=16, ignore_eos=True)
    _, fb = run(text_drafted, req)
    assert fb.token_ids == run(text_plain, req)[1].token_ids and fb.timings.draft_n > 0


def test_a_llama_cpp_gguf_and_its_directory_draft_for_each_other(plain, tiny_qwen3_untied, tmp_path):
    """llama.cpp's converter makes the added tokens spelled <|...|> control tokens where tokenizer.json does not
    mark them special (<|fim_prefix|>, ...): still the same tokenizer, so its GGUF drafts for the Hugging Face
    directory and the directory for the GGUF, and the tokens stay plain decoding's (the same weights: drafts
    accepted)."""
    from tests.support.llama_convert import convert_hf
    gguf = convert_hf(tiny_qwen3_untied, str(tmp_path / "llama-f32.gguf"), "f32")
    gguf_plain = load_model(gguf, options(spec=SpecOptions("none")))
    flipped = gguf_plain.tokenizer.special_ids ^ plain.tokenizer.special_ids
    pieces = plain.tokenizer.all_token_bytes(len(plain.tokenizer))
    assert flipped and all(pieces[i].startswith(b"<|") and pieces[i].endswith(b"|>") for i in flipped), flipped
    for target, draft, reference in ((gguf, tiny_qwen3_untied, gguf_plain), (tiny_qwen3_untied, gguf, plain)):
        drafted = load_model(target, options(spec=SpecOptions(draft_max=4), draft_model=draft))
        req = GenerationRequest(ids_of(plain, PROMPTS[1]), GREEDY, max_tokens=24, ignore_eos=True)
        _, fa = run(reference, req)
        _, fb = run(drafted, req)
        assert fb.token_ids == fa.token_ids and fb.timings.draft_n_accepted >= 0.8 * fb.timings.draft_n > 0, target


def test_the_draft_counts_in_the_prefix_store(tiny_qwen3_untied, tiny_qwen3_tied):
    """Under --cache-ram the active sequence holds the target's keys and values and the draft's, and the copies
    of earlier sequences only the target's: with a 1 MiB budget, a first prompt's copy that fits beside a second
    prompt on the target alone is not kept when a draft model runs beside it (the second prompt comes back from
    scratch), and a shorter one is kept (and reused exactly)."""
    opts = dict(context_length=1024, prefill_chunk=64, cache_ram_mb=1)
    drafted = load_model(tiny_qwen3_untied, LoadOptions(**opts, spec=SpecOptions(draft_max=4),
                                                        draft_model=tiny_qwen3_tied))
    alone = load_model(tiny_qwen3_untied, LoadOptions(**opts, spec=SpecOptions("none")))
    budget, t = 2**20, alone.engine.cache.bytes_per_token
    d = drafted.engine.draft_model.cache.bytes_per_token
    assert drafted.engine.store.budget == alone.engine.store.budget == budget
    assert drafted.engine.active_bytes_per_token == t + d and alone.engine.active_bytes_per_token == t
    new = 3  # of the 4 tokens answered, the last is never fed: a sequence holds the prompt and 3 more

    def cache_n_of_a_again(loaded, n: int) -> tuple[int, list[int]]:
        """Prompts A, B (sharing no prefix: A is copied to the store when B overwrites it), A again."""
        loaded.engine.drop_sequence()
        loaded.engine.store.clear()
        a, b = [1000 + i % 97 for i in range(n)], [2000 + i % 89 for i in range(n)]
        for ids in (a, b):
            run(loaded, GenerationRequest(ids, GREEDY, max_tokens=4, ignore_eos=True))
        store = loaded.engine.store
        held = [e.nbytes for e in store]
        assert store.nbytes + len(loaded.engine.cache_tokens) * loaded.engine.active_bytes_per_token <= budget
        return run(loaded, GenerationRequest(a, GREEDY, max_tokens=4, ignore_eos=True))[1].timings.cache_n, held

    # the longest prompt whose copy fits beside the next on the target alone: with the draft it does not
    n = max(n for n in range(1, 1024) if (n + new) * t + (n + new) * t <= budget)
    assert (n + new) * t + n * (t + d) > budget
    assert cache_n_of_a_again(alone, n) == (n - 1, [(n + new) * t])    # kept: A's copy, its target's bytes
    assert cache_n_of_a_again(drafted, n) == (0, [])                    # not kept: A runs from scratch
    # the longest that fits with the draft's bytes counted: kept with the draft too
    n = max(n for n in range(1, 1024) if (n + new) * t + (n + new) * (t + d) <= budget)
    assert cache_n_of_a_again(drafted, n) == (n - 1, [(n + new) * t])
