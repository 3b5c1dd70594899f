"""Qwen3-VL against transformers' float32 Qwen3VLForConditionalGeneration on a tiny random checkpoint with
DeepStack layers: prompt ids, logits after the prompt (two non-square images in one message), 24 greedy
tokens through the Engine (three images over two user messages), a text-only prompt, M-RoPE positions."""
import numpy as np
import pytest
import torch

from appliance.engine.generate import FinishEvent, GenerationRequest, TokenEvent
from appliance.engine.image_processing import ImageError, decode_image
from appliance.engine.load import load_model
from appliance.engine.qwen3_vl import expand_image_pads
from appliance.engine.sampling import SamplingParams
from tests.support.tiny_vl import cached_qwen3_vl, image_bytes, reference_processor

IMAGE_PAD = 151655
TWO_IMAGES = [{"role": "user", "content": [
    {"type": "text", "text": "Compare"}, {"type": "image_url", "image_url": {"url": "a"}},
    {"type": "text", "text": "with"}, {"type": "image_url", "image_url": {"url": "b"}},
    {"type": "text", "text": "please."}]}]
CONVERSATION = [
    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "a"}},
                                 {"type": "text", "text": "What is it?"}]},
    {"role": "assistant", "content": "A gradient."},
    {"role": "user", "content": [{"type": "text", "text": "And these two?"},
                                 {"type": "image_url", "image_url": {"url": "b"}},
                                 {"type": "image_url", "image_url": {"url": "c"}}]}]


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return cached_qwen3_vl(tmp_path_factory)


@pytest.fixture(scope="module")
def loaded(vl_dir):
    return load_model(vl_dir, context_length=512, prefill_chunk=16)  # chunks split the image-pad runs


@pytest.fixture(scope="module")
def reference(vl_dir):
    from transformers import Qwen3VLForConditionalGeneration

    model = Qwen3VLForConditionalGeneration.from_pretrained(vl_dir, dtype=torch.float32).eval()
    return model, reference_processor(vl_dir)


def pictures(*sizes):
    return [decode_image(image_bytes(w, h, "PNG", seed=w * h)) for w, h in sizes]


def our_prompt(loaded, messages, images):
    ids = loaded.tokenizer.encode(loaded.chat_template.render(messages, add_generation_prompt=True))
    patches = [loaded.model.image_processor.preprocess(im) for im in images]
    return expand_image_pads(ids, IMAGE_PAD, [p.num_tokens for p in patches]), patches


def ref_inputs(processor, messages, images):
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return processor(text=[text], images=images, return_tensors="pt")


def test_two_images_in_one_message_logits_match(loaded, reference):
    model, processor = reference
    images = pictures((300, 200), (150, 250))
    ids, patches = our_prompt(loaded, TWO_IMAGES, images)
    ref = ref_inputs(processor, TWO_IMAGES, images)
    assert ids == ref["input_ids"][0].tolist()
    assert [list(p.grid_thw) for p in patches] == ref["image_grid_thw"].tolist()
    assert ref["mm_token_type_ids"][0].tolist() == [int(t == IMAGE_PAD) for t in ids]
    with torch.no_grad():
        want = model(**ref).logits[0].numpy()  # (T, vocab)

    m, cache = loaded.model, loaded.model.new_cache(512)
    assert m.prepare_images(cache, ids, patches) == sum(p.num_tokens for p in patches)
    got = np.concatenate([m.forward(np.array(ids[s:s + 16]), cache, "all") for s in range(0, len(ids), 16)])
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err <= 1e-4, err
    # the images matter: without them (pads as plain tokens) the logits are far off
    cache.reset()
    plain = m.forward(np.array(ids), cache, "last")
    assert np.abs(plain - want[-1]).max() / np.abs(want[-1]).max() > 1e-2


def test_mrope_positions_equal_get_rope_index(loaded, reference):
    model, processor = reference
    images = pictures((300, 200), (150, 250), (64, 200))
    ids, patches = our_prompt(loaded, CONVERSATION, images)
    ref = ref_inputs(processor, CONVERSATION, images)
    want, delta = model.model.get_rope_index(ref["input_ids"], ref["mm_token_type_ids"], ref["image_grid_thw"])
    cache = loaded.model.new_cache(512)
    loaded.model.prepare_images(cache, ids, patches)
    np.testing.assert_array_equal(cache.images.positions, want[:, 0].numpy())
    assert cache.images.delta == int(delta[0, 0]) < 0


def greedy_reference(model, ref, n):
    with torch.no_grad():
        out = model.generate(**ref, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, ref["input_ids"].shape[1]:].tolist()


def run(loaded, req):
    events = list(loaded.engine.generate(req))
    assert isinstance(events[-1], FinishEvent) and all(isinstance(e, TokenEvent) for e in events[:-1])
    return events[-1]


def test_24_greedy_tokens_over_a_conversation_with_three_images(loaded, reference):
    model, processor = reference
    images = pictures((300, 200), (150, 250), (64, 200))
    ids, patches = our_prompt(loaded, CONVERSATION, images)
    want = greedy_reference(model, ref_inputs(processor, CONVERSATION, images), 24)
    fin = run(loaded, GenerationRequest(ids, SamplingParams(temperature=0.0), max_tokens=24, ignore_eos=True,
                                        images=tuple(patches)))
    assert not set(want) & loaded.eos_ids  # so ignore_eos and min_new_tokens mean the same thing
    assert fin.token_ids == want
    assert fin.timings.image_tokens == sum(p.num_tokens for p in patches) and fin.timings.image_encode_ms > 0
    assert fin.prompt_tokens == len(ids)


def test_text_only_prompt_matches(loaded, reference):
    model, processor = reference
    messages = [{"role": "user", "content": "Tell me about kestrels."}]
    ref = ref_inputs(processor, messages, None)
    ids = loaded.tokenizer.encode(loaded.chat_template.render(messages, add_generation_prompt=True))
    assert ids == ref["input_ids"][0].tolist()
    want = greedy_reference(model, ref, 24)
    fin = run(loaded, GenerationRequest(ids, SamplingParams(temperature=0.0), max_tokens=24, ignore_eos=True))
    assert fin.token_ids == want


def test_placeholders_and_images_must_agree(loaded):
    ids, patches = our_prompt(loaded, TWO_IMAGES, pictures((300, 200), (150, 250)))
    with pytest.raises(ImageError):
        list(loaded.engine.generate(GenerationRequest(ids, images=tuple(patches[:1]))))
    with pytest.raises(ImageError):
        list(loaded.engine.generate(GenerationRequest(ids, images=(patches[1], patches[0]))))  # token counts differ
    with pytest.raises(ImageError):
        expand_image_pads([1, IMAGE_PAD, 2], IMAGE_PAD, [4, 4])
    # the engine is usable afterwards
    fin = run(loaded, GenerationRequest(ids, SamplingParams(temperature=0.0), max_tokens=2, images=tuple(patches)))
    assert fin.completion_tokens >= 1


def test_cancel_during_image_encoding(loaded):
    ids, patches = our_prompt(loaded, TWO_IMAGES, pictures((300, 200), (150, 250)))
    loaded.engine.drop_sequence()  # nothing reusable: the first image's encoding sees the cancel
    loaded.engine.store.clear()
    events = list(loaded.engine.generate(GenerationRequest(ids, images=tuple(patches)), lambda: True))
    assert len(events) == 1 and events[0].reason == "cancelled" and loaded.engine.cache.images is None
    assert events[0].timings.prefill_chunks == 0 and loaded.engine.cache.length == 0


def test_erf_and_blocked_vision_attention(loaded, monkeypatch):
    import math

    from appliance.engine import vision

    x = np.linspace(-6, 6, 2001, dtype=np.float32)
    assert np.abs(vision.erf(x) - np.array([math.erf(v) for v in x.astype(np.float64)])).max() < 2e-7
    img = loaded.model.image_processor.preprocess(pictures((300, 200))[0])
    whole = loaded.model.vision.encode(img.pixel_values, img.grid_thw)
    monkeypatch.setattr(vision, "ATTN_BLOCK_ELEMS", 216 * 10)  # 10 queries per block, 22 blocks per head
    blocked = loaded.model.vision.encode(img.pixel_values, img.grid_thw)
    np.testing.assert_allclose(blocked.embeds, whole.embeds, rtol=1e-5, atol=1e-5)
    for a, b in zip(blocked.deepstack, whole.deepstack):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
