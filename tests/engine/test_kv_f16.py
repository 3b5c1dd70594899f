"""The float16 KV cache (the default): logits stay within a stated tolerance of the float32 cache's for dense
(native decoder), MoE (numpy layers) and Qwen3-VL (numpy layers with DeepStack), prefill and decode; the
engine is built with it by default; and greedy tokens equal transformers' float32 generate on the tiny models
with it. Those greedy checks are the suites' own (test_qwen3_numerics, test_qwen3_moe, test_qwen3_vl_numerics,
test_gguf_smollm2 load with the defaults); here the default is pinned, so they keep testing float16.

Tolerance: keys and values are rounded to 11 significant bits (relative error <= 2^-11 each); on the tiny
random models the logits move by at most 1% of their largest magnitude, measured 0.1-0.3%."""
import numpy as np
import pytest

from appliance.engine.image_processing import decode_image
from appliance.engine.load import load_model
from appliance.engine.qwen3_vl import expand_image_pads
from tests.support.tiny_vl import cached_qwen3_vl, image_bytes

PROMPT = [151644, 872, 198, 9707, 11, 1246, 525, 498, 30, 151645, 198, 151644, 77091, 198, 35946, 3555, 374]
TOLERANCE = 1e-2  # max |logit difference| / max |logit|


def logits_both_ways(model, ids, extra, prepare=None):
    """Prefill `ids` then decode `extra` one token at a time, with a float32 and a float16 cache."""
    out = {}
    for dtype in (np.float32, np.float16):
        cache = model.new_cache(len(ids) + len(extra) + 1, dtype)
        if prepare is not None:
            prepare(cache)
        rows = [model.forward(np.array(ids[s:s + 16]), cache, "all") for s in range(0, len(ids), 16)]
        rows += [model.forward(np.array([t]), cache, "all") for t in extra]
        assert cache.k[0].dtype == dtype
        out[dtype] = np.concatenate(rows)  # (T, vocab)
    return out[np.float32], out[np.float16]


def rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("which", ["tiny_qwen3_untied", "tiny_qwen3_moe"])
def test_logits_within_tolerance_of_float32_cache(which, request):
    loaded = load_model(request.getfixturevalue(which), context_length=256)
    assert loaded.engine.cache.k[0].dtype == np.float16  # the default
    full, half = logits_both_ways(loaded.model, PROMPT * 3, [11, 22, 33, 44])
    err = rel(half, full)
    assert 0 < err <= TOLERANCE, err  # not zero: the cache really holds halves
    assert (half.argmax(-1) == full.argmax(-1)).mean() >= 0.95


def test_vl_logits_within_tolerance_of_float32_cache(tmp_path_factory):
    loaded = load_model(cached_qwen3_vl(tmp_path_factory), context_length=512)
    img = decode_image(image_bytes(200, 160, "PNG", seed=3))
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "a"}},
                                             {"type": "text", "text": "What is it?"}]}]
    ids = loaded.tokenizer.encode(loaded.chat_template.render(messages, add_generation_prompt=True))
    patches = [loaded.model.image_processor.preprocess(img)]
    ids = expand_image_pads(ids, 151655, [patches[0].num_tokens])
    full, half = logits_both_ways(loaded.model, ids, [11, 22, 33],
                                  prepare=lambda c: loaded.model.prepare_images(c, ids, patches))
    err = rel(half, full)
    assert 0 < err <= TOLERANCE, err


def test_kv_type_option_and_memory(tiny_qwen3_untied):
    f16 = load_model(tiny_qwen3_untied, context_length=64)
    f32 = load_model(tiny_qwen3_untied, context_length=64, kv_type="f32")
    assert f32.engine.cache.k[0].dtype == np.float32
    assert f16.engine.cache.bytes_per_token * 2 == f32.engine.cache.bytes_per_token
    assert sum(a.nbytes for a in f16.engine.cache.k + f16.engine.cache.v) == 64 * f16.engine.cache.bytes_per_token
    from appliance.engine.load import ModelLoadError
    with pytest.raises(ModelLoadError, match="KV cache type 'q8'"):
        load_model(tiny_qwen3_untied, kv_type="q8")


def test_default_context_is_trained_context_capped_by_memory(tiny_qwen3_untied, monkeypatch, caplog):
    import json
    import logging

    from appliance.engine import load
    trained = json.load(open(f"{tiny_qwen3_untied}/config.json"))["max_position_embeddings"]
    with caplog.at_level(logging.INFO, logger="appliance.load"):
        plenty = load_model(tiny_qwen3_untied)
    assert plenty.context_length == trained
    assert f"context {trained} tokens (default" in caplog.text
    per_token = plenty.engine.cache.bytes_per_token
    monkeypatch.setattr(load, "available_memory", lambda: 2 * per_token * 1000)  # half of it: 1000 tokens
    assert load_model(tiny_qwen3_untied).context_length == min(trained, 1000)
    assert load_model(tiny_qwen3_untied, context_length=300).context_length == 300
    assert load_model(tiny_qwen3_untied, kv_type="f32").context_length == min(trained, 500)
