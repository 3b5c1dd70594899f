"""Qwen3.5 with images (Qwen3_5ForConditionalGeneration / Qwen3_5MoeForConditionalGeneration, the vision tower
in the same checkpoint) against transformers in float32 on tiny random checkpoints, dense and MoE: prompt ids
and image grids equal to the processor's, M-RoPE positions equal to get_rope_index, logits and log-probabilities
after a message with two non-square images (max |logprob diff| bounded and printed), 16 greedy tokens through the
Engine equal to transformers' generate, a follow-up turn that reuses the recurrent-state snapshot equal to a
fresh engine's answer, a cancel during image encoding."""
import numpy as np
import pytest
import torch

from appliance.engine.generate import FinishEvent, GenerationRequest, TokenEvent
from appliance.engine.image_processing import decode_image
from appliance.engine.load import load_model
from appliance.engine.qwen3_5_vl import Qwen35VLModel
from appliance.engine.qwen3_vl import expand_image_pads
from appliance.engine.sampling import SamplingParams
from tests.support.tiny_vl import cached_qwen3_5_vl, image_bytes, reference_processor

IMAGE_PAD = 151655
GREEDY = SamplingParams(temperature=0.0)
LOGPROB_BOUND = 2e-3  # max |log p(ours) - log p(transformers)| over the prompt's positions and the vocabulary
TWO_IMAGES = [{"role": "user", "content": [
    {"type": "text", "text": "Compare"}, {"type": "image_url", "image_url": {"url": "a"}},
    {"type": "text", "text": "with"}, {"type": "image_url", "image_url": {"url": "b"}},
    {"type": "text", "text": "please."}]}]


@pytest.fixture(scope="module", params=["dense", "moe"])
def vl_dir(request, tmp_path_factory):
    return cached_qwen3_5_vl(tmp_path_factory, moe=request.param == "moe")


@pytest.fixture(scope="module")
def loaded(vl_dir):
    return load_model(vl_dir, context_length=512, prefill_chunk=16)  # chunks split the image-pad runs


@pytest.fixture(scope="module")
def reference(vl_dir):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(vl_dir, dtype=torch.float32).eval()
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


def log_softmax(x):
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def run(loaded, req, should_cancel=lambda: False):
    events = list(loaded.engine.generate(req, should_cancel))
    assert isinstance(events[-1], FinishEvent) and all(isinstance(e, TokenEvent) for e in events[:-1])
    return events[-1]


def test_the_checkpoint_loads_its_vision_tower(loaded):
    assert loaded.multimodal and isinstance(loaded.model, Qwen35VLModel)
    assert loaded.model.vision.deepstack_mergers == [] and loaded.model.vision.config.depth == 2


def test_two_images_in_one_message_logprobs_match(loaded, reference):
    model, processor = reference
    images = pictures((300, 200), (150, 250))
    ids, patches = our_prompt(loaded, TWO_IMAGES, images)
    ref = ref_inputs(processor, TWO_IMAGES, images)
    assert ids == ref["input_ids"][0].tolist()
    assert [list(p.grid_thw) for p in patches] == ref["image_grid_thw"].tolist()
    with torch.no_grad():
        want = model(**ref).logits[0].numpy()  # (T, vocab)
        positions, delta = model.model.get_rope_index(ref["input_ids"], ref["mm_token_type_ids"],
                                                      ref["image_grid_thw"])

    m, cache = loaded.model, loaded.model.new_cache(512)
    assert m.prepare_images(cache, ids, patches) == sum(p.num_tokens for p in patches)
    np.testing.assert_array_equal(cache.images.positions, positions[:, 0].numpy())
    assert cache.images.delta == int(delta[0, 0]) < 0
    got = np.concatenate([m.forward(np.array(ids[s:s + 16]), cache, "all") for s in range(0, len(ids), 16)])
    diff = np.abs(log_softmax(got.astype(np.float64)) - log_softmax(want.astype(np.float64))).max()
    print(f"max |logprob diff| with two images: {diff:.2e}")
    assert diff <= LOGPROB_BOUND, diff
    # the images matter: without them (pads as plain tokens) the last position's logits are far off
    plain = m.text.forward(np.array(ids), m.text.new_cache(512), "last")
    assert np.abs(log_softmax(plain) - log_softmax(want[-1])).max() > 50 * LOGPROB_BOUND


def greedy_reference(model, ref, n):
    with torch.no_grad():
        out = model.generate(**ref, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, ref["input_ids"].shape[1]:].tolist()


def test_greedy_tokens_with_two_images_equal_transformers(loaded, reference):
    model, processor = reference
    images = pictures((300, 200), (150, 250))
    ids, patches = our_prompt(loaded, TWO_IMAGES, images)
    want = greedy_reference(model, ref_inputs(processor, TWO_IMAGES, images), 16)
    loaded.engine.drop_sequence()
    fin = run(loaded, GenerationRequest(ids, GREEDY, max_tokens=16, ignore_eos=True, images=tuple(patches)))
    assert not set(want) & loaded.eos_ids  # so ignore_eos and min_new_tokens mean the same thing
    assert fin.token_ids == want
    assert fin.timings.image_tokens == sum(p.num_tokens for p in patches) and fin.timings.image_encode_ms > 0


def test_follow_up_turn_reuses_the_image_prefix(loaded, vl_dir):
    """A second turn after an answer about two images: its prefix (images included) comes from the snapshot and
    the tokens equal those of an engine that never reuses."""
    images = pictures((300, 200), (150, 250))
    first_ids, patches = our_prompt(loaded, TWO_IMAGES, images)
    loaded.engine.drop_sequence()
    loaded.engine.store.clear()
    first = run(loaded, GenerationRequest(first_ids, GREEDY, max_tokens=6, images=tuple(patches)))
    messages = TWO_IMAGES + [{"role": "assistant", "content": loaded.tokenizer.decode(first.token_ids)},
                             {"role": "user", "content": "And the second one alone?"}]
    ids, patches2 = our_prompt(loaded, messages, images)
    second = run(loaded, GenerationRequest(ids, GREEDY, max_tokens=12, ignore_eos=True, images=tuple(patches2)))
    assert second.timings.cache_n > 0  # the snapshot before the first turn's generation prompt at least
    fresh = load_model(vl_dir, context_length=512, prefill_chunk=16, prefix_reuse=False)
    again = run(fresh, GenerationRequest(ids, GREEDY, max_tokens=12, ignore_eos=True, images=tuple(patches2)))
    assert second.token_ids == again.token_ids


def test_cancel_during_image_encoding(loaded):
    ids, patches = our_prompt(loaded, TWO_IMAGES, pictures((300, 200), (150, 250)))
    loaded.engine.drop_sequence()  # nothing reusable: the first image's encoding sees the cancel
    loaded.engine.store.clear()
    fin = run(loaded, GenerationRequest(ids, images=tuple(patches)), lambda: True)
    assert fin.reason == "cancelled" and loaded.engine.cache.images is None
    done = run(loaded, GenerationRequest(ids, GREEDY, max_tokens=2, images=tuple(patches)))
    assert done.completion_tokens >= 1  # usable afterwards
