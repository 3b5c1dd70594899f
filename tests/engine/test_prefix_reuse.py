"""Prefix reuse across requests (float32 KV): greedy tokens with reuse equal those of an engine that prefills
every prompt from scratch, for dense, MoE and Qwen3-VL multi-turn conversations, after a cancelled prefill,
after an edited earlier message, with the thinking template, and with several conversations under a budget."""
import numpy as np
import pytest

from appliance.engine.generate import Engine, FinishEvent, GenerationRequest
from appliance.engine.image_processing import decode_image
from appliance.engine.load import load_model
from appliance.engine.prefix_cache import common_prefix
from appliance.engine.qwen3_vl import expand_image_pads
from appliance.engine.sampling import SamplingParams
from tests.support.tiny_vl import cached_qwen3_vl, image_bytes

GREEDY = SamplingParams(temperature=0.0)
IMAGE_PAD = 151655


def fresh_engine(loaded, **kw) -> Engine:
    """A second engine over the same model that never reuses: the reference."""
    e = loaded.engine
    return Engine(loaded.model, loaded.tokenizer, e.eos_ids, e.context_length, e.prefill_chunk,
                  kv_dtype=e.cache.dtype, **kw)


def greedy(engine, ids, n=10, images=(), should_cancel=lambda: False) -> FinishEvent:
    events = list(engine.generate(GenerationRequest(list(ids), GREEDY, max_tokens=n, ignore_eos=True,
                                                    images=tuple(images)), should_cancel))
    assert isinstance(events[-1], FinishEvent)
    return events[-1]


def render(loaded, messages, **kw):
    return loaded.tokenizer.encode(loaded.chat_template.render(messages, add_generation_prompt=True, **kw))


def converse(loaded, ref, turns, n=10, **template):
    """Multi-turn chat: each turn's prompt holds the earlier turns with the decoded answers. Returns the
    cached token counts per turn; asserts every turn's greedy tokens equal the reference engine's."""
    messages, cached = [{"role": "system", "content": "You are a terse assistant."}], []
    for text in turns:
        messages.append({"role": "user", "content": text})
        ids = render(loaded, messages, **template)
        got, want = greedy(loaded.engine, ids, n), greedy(ref, ids, n)
        assert got.token_ids == want.token_ids
        assert want.timings.cache_n == 0
        cached.append(got.timings.cache_n)
        messages.append({"role": "assistant", "content": loaded.tokenizer.decode(got.token_ids)})
    return cached


@pytest.fixture(scope="module")
def dense(tiny_qwen3_untied):
    return load_model(tiny_qwen3_untied, context_length=512, prefill_chunk=16, cache_ram_mb=0, kv_type="f32")


@pytest.fixture(scope="module")
def moe(tiny_qwen3_moe):
    return load_model(tiny_qwen3_moe, context_length=512, prefill_chunk=16, cache_ram_mb=0, kv_type="f32")


TURNS = ["Tell me about rivers in three words.", "Now about mountains, please.", "And lakes?", "Thanks, bye."]


@pytest.mark.parametrize("which", ["dense", "moe"])
def test_multi_turn_greedy_identical_and_history_reused(which, request):
    loaded = request.getfixturevalue(which)
    loaded.engine.drop_sequence()
    ref = fresh_engine(loaded, reuse_prefix=False)
    cached = converse(loaded, ref, TURNS, enable_thinking=False)
    assert cached[0] == 0 and all(c > 20 for c in cached[1:])


def test_reuse_is_exactly_the_common_prefix_and_always_runs_the_last_token(dense):
    eng = dense.engine
    ids = render(dense, [{"role": "user", "content": "Count to five."}], enable_thinking=False)
    first = greedy(eng, ids, 6)
    held = ids + first.token_ids[:-1]  # the last sampled token was never run
    assert eng.cache_tokens == held and eng.cache.length == len(held)
    again = greedy(eng, ids, 6)  # the same prompt: all but its last token reused
    assert again.timings.cache_n == len(ids) - 1 and again.token_ids == first.token_ids
    longer = ids + first.token_ids + [13]  # the answer and more: everything the cache holds is reused
    fin = greedy(eng, longer, 4)
    assert fin.timings.cache_n == len(held) and fin.timings.prefill_chunks == 1


def test_cancelled_prefill_leaves_whole_chunks_that_the_next_request_reuses(dense):
    eng = dense.engine
    eng.drop_sequence()
    ref = fresh_engine(dense, reuse_prefix=False)
    ids = render(dense, [{"role": "user", "content": "word " * 100}], enable_thinking=False)
    polls = []

    def cancel_on_fourth_poll():
        polls.append(1)
        return len(polls) >= 4

    fin = greedy(eng, ids, 5, should_cancel=cancel_on_fourth_poll)
    assert fin.reason == "cancelled" and fin.timings.prefill_chunks == 3
    assert eng.cache.length == 3 * 16 and eng.cache_tokens == ids[:48]
    again = greedy(eng, ids, 8)
    assert again.timings.cache_n == 48 and again.timings.prefill_chunks == -(-(len(ids) - 48) // 16)
    assert again.token_ids == greedy(ref, ids, 8).token_ids


def test_edited_earlier_message_reuses_up_to_the_edit(dense):
    eng = dense.engine
    ref = fresh_engine(dense, reuse_prefix=False)
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."},
               {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Name a fruit."},
               {"role": "assistant", "content": "Apple."}, {"role": "user", "content": "Name a tree."}]
    ids = render(dense, history, enable_thinking=False)
    greedy(eng, ids, 6)
    edited = [dict(m) for m in history]
    edited[3]["content"] = "Name a vegetable."
    ids2 = render(dense, edited, enable_thinking=False)
    split = common_prefix(ids, (), ids2, ())
    assert 10 < split < len(ids) - 10
    fin = greedy(eng, ids2, 8)
    assert fin.timings.cache_n == split
    assert fin.token_ids == greedy(ref, ids2, 8).token_ids
    # the original conversation was kept aside (LRU copy) only if a budget allows: here none is set
    assert len(eng.store) == 0


def test_thinking_template_drops_earlier_think_blocks_so_reuse_stops_there(dense):
    """Qwen3's template renders an earlier assistant turn without its <think> block, while the turn itself
    was generated after '<think>\\n\\n</think>\\n\\n' (thinking off) or with its reasoning (thinking on).
    Reuse covers the history up to the start of that answer; the rest of the turn is prefilled again."""
    eng = dense.engine
    eng.drop_sequence()
    ref = fresh_engine(dense, reuse_prefix=False)
    tok = dense.tokenizer
    messages = [{"role": "user", "content": "What is two plus two?"}]
    ids1 = render(dense, messages)  # thinking on: the model writes <think> ... </think> itself
    answer = "<think>\nTwo plus two is four.\n</think>\n\nFour."
    turn1 = ids1 + tok.encode(answer)
    greedy(eng, turn1[:-1] + [turn1[-1]], 1)  # the cache now holds turn 1 (prompt + its answer, as generated)
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And three plus three?"}]
    ids2 = render(dense, messages)
    fin = greedy(eng, ids2, 8)
    # everything before the assistant's answer is reused; the <think> block is gone from the history
    head = tok.encode("<|im_start|>assistant\n")
    assert ids2[:len(ids1)] == ids1 and "<think>" not in tok.decode(ids2[len(ids1):])
    assert fin.timings.cache_n == common_prefix(turn1, (), ids2, ()) == len(ids1)
    assert ids1[-len(head):] == head
    assert fin.token_ids == greedy(ref, ids2, 8).token_ids
    # with thinking off, the '<think>\n\n</think>\n\n' the generation prompt added is dropped the same way
    eng.drop_sequence()
    off = [{"role": "user", "content": "What is two plus two?"}]
    ids1 = render(dense, off, enable_thinking=False)
    first = greedy(eng, ids1, 6)
    off += [{"role": "assistant", "content": tok.decode(first.token_ids)}, {"role": "user", "content": "Why?"}]
    ids2 = render(dense, off, enable_thinking=False)
    fin = greedy(eng, ids2, 6)
    empty_think = len(tok.encode("<think>\n\n</think>\n\n"))
    assert fin.timings.cache_n == len(ids1) - empty_think
    assert fin.token_ids == greedy(ref, ids2, 6).token_ids


def test_two_alternating_conversations_stay_warm_under_a_budget(dense):
    eng = fresh_engine(dense, cache_bytes=64 << 20)
    ref = fresh_engine(dense, reuse_prefix=False)
    a = render(dense, [{"role": "system", "content": "Kiosk A. " * 20}, {"role": "user", "content": "Hi"}],
               enable_thinking=False)
    b = render(dense, [{"role": "system", "content": "Kiosk B, other words. " * 20},
                       {"role": "user", "content": "Hello"}], enable_thinking=False)
    fa, fb = greedy(eng, a, 4), greedy(eng, b, 4)
    assert fb.timings.cache_n < 10 and len(eng.store) == 1  # a was copied aside before b overwrote it
    a2 = a + fa.token_ids + render(dense, [{"role": "user", "content": "More"}])[-8:]
    b2 = b + fb.token_ids + render(dense, [{"role": "user", "content": "More"}])[-8:]
    ga = greedy(eng, a2, 6)
    assert ga.timings.cache_n == len(a) + 3 and ga.token_ids == greedy(ref, a2, 6).token_ids
    gb = greedy(eng, b2, 6)
    assert gb.timings.cache_n == len(b) + 3 and gb.token_ids == greedy(ref, b2, 6).token_ids
    # only used positions are copied: each copy is its sequence's length times the bytes per token
    for e in eng.store:
        assert e.nbytes == len(e.tokens) * eng.cache.bytes_per_token
    # a budget too small for any copy keeps none, and reuse of the active sequence still works
    tight = fresh_engine(dense, cache_bytes=eng.cache.bytes_per_token * 4)
    greedy(tight, a, 2)
    greedy(tight, b, 2)
    assert len(tight.store) == 0 and greedy(tight, b, 2).timings.cache_n == len(b) - 1


def test_engine_error_drops_the_sequence(dense, monkeypatch):
    eng = dense.engine
    ids = render(dense, [{"role": "user", "content": "Hi there"}], enable_thinking=False)
    greedy(eng, ids, 3)
    assert eng.cache.length > 0

    def broken(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(eng.model, "forward", broken)
    with pytest.raises(RuntimeError):
        greedy(eng, ids + [13, 14], 3)
    assert eng.cache.length == 0 and eng.cache_tokens == []
    monkeypatch.undo()
    assert greedy(eng, ids, 3).timings.cache_n == 0


# ---- Qwen3-VL: the prefix includes the images -------------------------------------------------------------

@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    return load_model(cached_qwen3_vl(tmp_path_factory), context_length=1024, prefill_chunk=16, cache_ram_mb=0, kv_type="f32")


def vl_prompt(loaded, messages, images):
    ids = render(loaded, messages)
    patches = [loaded.model.image_processor.preprocess(im) for im in images]
    return expand_image_pads(ids, IMAGE_PAD, [p.num_tokens for p in patches]), patches


def picture(w, h, seed):
    return decode_image(image_bytes(w, h, "PNG", seed=seed))


def test_vl_multi_turn_reuses_images_and_matches(vl, monkeypatch):
    eng = vl.engine
    encoded = []
    encode = vl.model.vision.encode
    monkeypatch.setattr(vl.model.vision, "encode", lambda *a: encoded.append(1) or encode(*a))
    eng.drop_sequence()
    ref = fresh_engine(vl, reuse_prefix=False)
    img_a, img_b = picture(200, 160, 1), picture(160, 200, 2)
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "a"}},
                                         {"type": "text", "text": "What is it?"}]}]
    ids, patches = vl_prompt(vl, msgs, [img_a])
    first = greedy(eng, ids, 6, patches)
    assert first.token_ids == greedy(ref, ids, 6, patches).token_ids
    msgs += [{"role": "assistant", "content": vl.tokenizer.decode(first.token_ids)},
             {"role": "user", "content": [{"type": "text", "text": "And this?"},
                                          {"type": "image_url", "image_url": {"url": "b"}}]}]
    ids2, patches2 = vl_prompt(vl, msgs, [img_a, img_b])
    encoded.clear()
    fin = greedy(eng, ids2, 8, patches2)
    assert len(encoded) == 1  # the first image is part of the reused prefix: only the new one is encoded
    assert fin.timings.cache_n > patches[0].num_tokens
    assert fin.token_ids == greedy(ref, ids2, 8, patches2).token_ids


def test_vl_a_different_image_stops_reuse_at_its_start(vl):
    eng = vl.engine
    ref = fresh_engine(vl, reuse_prefix=False)
    msgs = [{"role": "user", "content": [{"type": "text", "text": "Describe"},
                                         {"type": "image_url", "image_url": {"url": "a"}}]}]
    ids, p1 = vl_prompt(vl, msgs, [picture(200, 160, 7)])
    greedy(eng, ids, 4, p1)
    ids2, p2 = vl_prompt(vl, msgs, [picture(200, 160, 8)])  # same size, so the same ids: other pixels
    assert ids2 == ids
    start = ids.index(IMAGE_PAD)
    fin = greedy(eng, ids2, 6, p2)
    assert fin.timings.cache_n == start
    assert fin.token_ids == greedy(ref, ids2, 6, p2).token_ids
    # text only after an image conversation: reuse stops at the image as well
    text = render(vl, [{"role": "user", "content": "Describe nothing"}])
    fin = greedy(eng, text, 4)
    assert fin.timings.cache_n <= start and fin.token_ids == greedy(ref, text, 4).token_ids
    assert np.all(np.asarray(eng.cache_tokens) != IMAGE_PAD)


def test_four_conversations_keep_one_copy_each(dense):
    """Turn 1 then turn 2 of four conversations: each turn 2 reuses its whole history, and the store keeps one
    copy per conversation (a turn-1 copy is superseded by its turn 2, which drops only the answer's tail)."""
    eng = fresh_engine(dense, cache_bytes=64 << 20)
    convs = [render(dense, [{"role": "system", "content": f"Kiosk {i}. " * 15}, {"role": "user", "content": "Hi"}],
                    enable_thinking=False) for i in range(4)]
    for ids in convs:
        greedy(eng, ids, 5)
    more = render(dense, [{"role": "user", "content": "More"}])[-6:]
    for ids in convs:
        assert greedy(eng, ids + more, 2).timings.cache_n == len(ids)
    greedy(eng, convs[0][:5] + [42] * 20, 2)  # a fifth sequence: the last turn 2 is copied aside too
    assert len(eng.store) == 4
    assert sorted(len(e.tokens) for e in eng.store) == sorted(len(ids) + len(more) + 1 for ids in convs)
