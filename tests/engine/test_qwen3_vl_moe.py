"""Qwen3-VL-MoE (Qwen3-VL-30B-A3B's architecture, `qwen3_vl_moe`) against transformers' float32
Qwen3VLMoeForConditionalGeneration on a tiny random checkpoint (8 experts, top 2, every layer sparse as in Qwen3-VL-30B-A3B; the experts
fused as transformers saves them and, in a copy, transposed as the published files hold them; H != 2I so a
wrong transpose cannot pass): prompt ids and 16 greedy tokens through the
Engine for two non-square images in one message, and a text-only prompt."""
import numpy as np
import pytest
import torch

from appliance.engine.generate import GenerationRequest, TokenEvent
from appliance.engine.image_processing import decode_image
from appliance.engine.load import load_model
from appliance.engine.qwen3_moe import SparseMoE
from appliance.engine.qwen3_vl import expand_image_pads
from appliance.engine.sampling import SamplingParams
from tests.support.tiny_vl import cached_qwen3_vl_moe, image_bytes, published_layout, reference_processor

IMAGE_PAD = 151655
TWO_IMAGES = [{"role": "user", "content": [
    {"type": "text", "text": "Compare"}, {"type": "image_url", "image_url": {"url": "a"}},
    {"type": "text", "text": "with"}, {"type": "image_url", "image_url": {"url": "b"}},
    {"type": "text", "text": "please."}]}]


@pytest.fixture(scope="module", params=["saved", "published"])
def vl_dir(request, tmp_path_factory):
    src = cached_qwen3_vl_moe(tmp_path_factory)
    if request.param == "saved":
        return src
    return published_layout(src, str(tmp_path_factory.mktemp("published") / "model"))


@pytest.fixture(scope="module")
def loaded(vl_dir):
    return load_model(vl_dir, context_length=512, prefill_chunk=16)


@pytest.fixture(scope="module")
def reference(vl_dir):
    from transformers import Qwen3VLMoeForConditionalGeneration

    model = Qwen3VLMoeForConditionalGeneration.from_pretrained(vl_dir, dtype=torch.float32).eval()
    return model, reference_processor(vl_dir)


def greedy(loaded, ids, images, n):
    req = GenerationRequest(prompt_ids=ids, sampling=SamplingParams(temperature=0), max_tokens=n, ignore_eos=True,
                            images=tuple(images))
    return [e.token_id for e in loaded.engine.generate(req, lambda: False) if isinstance(e, TokenEvent)]


def test_the_text_side_is_the_moe_block(loaded):
    mlps = [layer.mlp for layer in loaded.model.text.layers]
    assert [isinstance(m, SparseMoE) for m in mlps] == [True, True, True]
    assert loaded.config.model_type == "qwen3" and loaded.multimodal


def test_two_images_prompt_ids_and_greedy_tokens_equal_transformers(loaded, reference):
    model, proc = reference
    images = [decode_image(image_bytes(w, h, "PNG", seed=w + h)) for w, h in ((200, 120), (90, 170))]
    ids = loaded.tokenizer.encode(loaded.chat_template.render(TWO_IMAGES, add_generation_prompt=True))
    patches = [loaded.model.image_processor.preprocess(im) for im in images]
    ids = expand_image_pads(ids, IMAGE_PAD, [p.num_tokens for p in patches])
    text = proc.apply_chat_template(TWO_IMAGES, add_generation_prompt=True, tokenize=False)
    inputs = proc(text=[text], images=images, return_tensors="pt")
    assert ids == inputs["input_ids"][0].tolist()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    want = out[0, len(ids):].tolist()
    assert greedy(loaded, ids, patches, 16) == want
    assert loaded.model.text.expert_stats.distinct_experts > 2  # the routed experts ran


def test_text_only_logits_equal_transformers(loaded, reference):
    model, _ = reference
    ids = loaded.tokenizer.encode(loaded.chat_template.render([{"role": "user", "content": "Count to five."}],
                                                              add_generation_prompt=True))
    cache = loaded.model.new_cache(len(ids) + 1)
    ours = loaded.model.forward(np.array(ids), cache, logits="all")  # (T, vocab)
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(ours, ref, atol=2e-3 * np.abs(ref).max())
