"""Qwen3.5 (hybrid Gated DeltaNet + gated full attention, dense and MoE) against transformers on tiny random
checkpoints in the published ForConditionalGeneration layout; the chunked delta rule against the token loop;
the hybrid cache's cut points; prefix reuse giving the tokens of an engine that never reuses."""
import json

import numpy as np
import pytest
import torch

from appliance.engine.generate import Engine, FinishEvent, GenerationRequest
from appliance.engine.layer_runner import native_delta
from appliance.engine.load import load_model
from appliance.engine.load.hf import build_qwen3_5
from appliance.engine.prefix_cache import common_prefix
from appliance.engine.qwen3_5 import NUMPY_DELTA, GatedDeltaNet, SharedExpertMoE
from appliance.engine.safetensors import SafeTensors
from appliance.engine.sampling import SamplingParams
from appliance.native.delta_numpy import (
    causal_conv1d,
    gated_delta_chunked,
    gated_delta_step,
    l2_normalize,
)

PROMPT = [151644, 872, 198, 9707, 11, 1246, 525, 498, 30, 151645, 198, 151644, 77091, 198]
LONG = (PROMPT * 9)[:120]  # > 64 tokens: two delta-rule chunks in one prefill
GREEDY = SamplingParams(temperature=0.0)
LOGPROB_BOUND = 2e-3  # max |log p(ours) - log p(transformers)| over every position and vocabulary entry


@pytest.fixture(params=["tiny_qwen3_5", "tiny_qwen3_5_moe"])
def checkpoint(request):
    return request.getfixturevalue(request.param)


def ours(path):
    """The checkpoint's text decoder (the model is a Qwen35VLModel over it: the checkpoints carry a vision tower)."""
    with open(f"{path}/config.json") as f:
        model = build_qwen3_5(SafeTensors(path), json.load(f))[1]
    return getattr(model, "text", model)


def reference(path):
    from transformers import AutoModelForImageTextToText
    return AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()


def log_softmax(x):
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


# ---- the delta rule ---------------------------------------------------------------------------------------

def delta_inputs(T, nh=3, dk=8, dv=5, seed=0):
    rng = np.random.default_rng(seed)
    f = np.float32
    q = (l2_normalize(rng.standard_normal((T, nh, dk)).astype(f)) * f(dk ** -0.5)).astype(f)
    k = l2_normalize(rng.standard_normal((T, nh, dk)).astype(f)).astype(f)
    v = rng.standard_normal((T, nh, dv)).astype(f)
    g = -rng.uniform(0.0, 2.0, (T, nh)).astype(f)
    beta = rng.uniform(0.0, 1.0, (T, nh)).astype(f)
    state = rng.standard_normal((nh, dk, dv)).astype(f)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_delta_rule_equals_token_loop(chunk):
    q, k, v, g, beta, s0 = delta_inputs(150)
    s_loop, s_chunk = s0.copy(), s0.copy()
    want = gated_delta_step(q, k, v, g, beta, s_loop)
    got = gated_delta_chunked(q, k, v, g, beta, s_chunk, chunk)
    assert np.max(np.abs(got - want)) <= 1e-4 * max(1.0, np.max(np.abs(want)))
    assert np.max(np.abs(s_chunk - s_loop)) <= 1e-4 * max(1.0, np.max(np.abs(s_loop)))
    assert not np.allclose(s_loop, s0)  # the state moved


def test_delta_rule_in_pieces_equals_one_call():
    q, k, v, g, beta, s0 = delta_inputs(40, seed=1)
    whole, pieces = s0.copy(), s0.copy()
    want = gated_delta_chunked(q, k, v, g, beta, whole, 16)
    got = np.concatenate([gated_delta_chunked(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], pieces, 16)
                          for a, b in ((0, 13), (13, 14), (14, 40))])
    np.testing.assert_allclose(got, want, atol=1e-5)
    np.testing.assert_allclose(pieces, whole, atol=1e-5)


def test_causal_conv_state_carries_across_calls():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((20, 6)).astype(np.float32)
    w = rng.standard_normal((6, 4)).astype(np.float32)
    s1, s2 = np.zeros((3, 6), np.float32), np.zeros((3, 6), np.float32)
    whole = causal_conv1d(x, s1, w)
    parts = np.concatenate([causal_conv1d(x[:7], s2, w), causal_conv1d(x[7:8], s2, w), causal_conv1d(x[8:], s2, w)])
    np.testing.assert_allclose(parts, whole, atol=1e-6)
    np.testing.assert_array_equal(s1, x[-3:])
    t = torch.nn.functional.conv1d(torch.tensor(x.T[None]), torch.tensor(w[:, None, :]), padding=3, groups=6)[0, :, :20]
    np.testing.assert_allclose(whole, torch.nn.functional.silu(t).numpy().T, atol=1e-5)


# ---- against transformers -----------------------------------------------------------------------------------

def test_layers_follow_config(tiny_qwen3_5, tiny_qwen3_5_moe):
    dense, moe = ours(tiny_qwen3_5), ours(tiny_qwen3_5_moe)
    assert [isinstance(layer.mixer, GatedDeltaNet) for layer in dense.layers] == [True, True, False] * 2
    assert [isinstance(layer.mixer, GatedDeltaNet) for layer in moe.layers] == [True, False] * 2
    assert all(isinstance(layer.mlp, SharedExpertMoE) for layer in moe.layers)
    assert dense.new_cache(32).kv.k[0].shape[0] == 2 and len(dense.new_cache(32).kv.k) == 2  # KV: full layers only


@pytest.mark.parametrize("delta", ["numpy", "native"])
def test_logprobs_match_transformers(checkpoint, delta):
    m, ref = ours(checkpoint), reference(checkpoint)
    if delta == "native":
        ops = native_delta()
        assert ops is not None, "the native library is not built"
        assert ops.conv.__module__ == "appliance.native.kernels"  # the conv1d in C too
        m.delta = ops
    else:
        assert m.delta is NUMPY_DELTA
    with torch.no_grad():
        want = ref(torch.tensor([LONG])).logits[0].numpy()
    got = m.forward(np.array(LONG), m.new_cache(256), "all")
    diff = float(np.max(np.abs(log_softmax(got) - log_softmax(want))))
    print(f"{checkpoint.rsplit('/', 1)[-1]} ({delta} delta rule): max |logprob diff| {diff:.2e} over {len(LONG)} "
          "positions")
    assert diff <= LOGPROB_BOUND
    assert np.array_equal(got.argmax(-1), want.argmax(-1))


def test_chunked_prefill_and_decode_match_one_forward(checkpoint):
    m = ours(checkpoint)
    extra = np.random.default_rng(1).integers(0, 151000, size=8).tolist()
    full = m.forward(np.array(LONG + extra), m.new_cache(256), "all")
    cache = m.new_cache(256)
    got = [m.forward(np.array(LONG[:50]), cache, "all"), m.forward(np.array(LONG[50:]), cache, "all")]
    got += [m.forward(np.array([t]), cache, "all") for t in extra]  # the one-token recurrence
    np.testing.assert_allclose(np.concatenate(got), full, atol=2e-4 * np.max(np.abs(full)))


def test_greedy_tokens_match_generate(checkpoint):
    ref = reference(checkpoint)
    with torch.no_grad():
        out = ref.generate(torch.tensor([PROMPT]), max_new_tokens=24, min_new_tokens=24, do_sample=False)
    loaded = load_model(checkpoint, context_length=256)
    events = list(loaded.engine.generate(GenerationRequest(PROMPT, GREEDY, max_tokens=24, ignore_eos=True)))
    assert [e.token_id for e in events[:-1]] == out[0, len(PROMPT):].tolist()


def test_a_text_only_layout_refuses_images(tiny_qwen3_5, tmp_path):
    """The checkpoint carries a vision tower (tests/engine/test_qwen3_5_vision.py serves images from it); without a
    vision_config the same tensors load as a text model that refuses image parts."""
    import shutil
    assert load_model(tiny_qwen3_5, context_length=128).multimodal
    text_only = tmp_path / "text-only"
    shutil.copytree(tiny_qwen3_5, text_only)
    cfg = json.loads((text_only / "config.json").read_text())
    del cfg["vision_config"]
    (text_only / "config.json").write_text(json.dumps(cfg))
    loaded = load_model(str(text_only), context_length=128)
    assert not loaded.multimodal
    with pytest.raises(ValueError, match="does not accept images"):
        list(loaded.engine.generate(GenerationRequest(PROMPT, GREEDY, max_tokens=2, images=(object(),))))


def test_mtp_tensors_are_ignored(tiny_qwen3_5, tmp_path):
    """A file carrying a multi-token-prediction head (mtp.*) loads to the same model."""
    import os
    import shutil

    from safetensors.torch import load_file, save_file
    d = tmp_path / "with-mtp"
    shutil.copytree(tiny_qwen3_5, d)
    tensors = load_file(os.path.join(d, "model.safetensors"))
    tensors["mtp.fc.weight"] = torch.ones((64, 128), dtype=torch.bfloat16)
    tensors["mtp.layers.0.input_layernorm.weight"] = torch.ones(64, dtype=torch.bfloat16)
    save_file(tensors, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    a, b = ours(tiny_qwen3_5), ours(str(d))
    np.testing.assert_array_equal(a.forward(np.array(PROMPT), a.new_cache(64)), b.forward(np.array(PROMPT), b.new_cache(64)))


# ---- the hybrid cache and prefix reuse ---------------------------------------------------------------------

def test_cache_cuts_only_where_a_state_exists(tiny_qwen3_5):
    m = ours(tiny_qwen3_5)
    cache = m.new_cache(256)
    m.forward(np.array(LONG[:40]), cache, "none")
    cache.snapshot()  # at 40
    m.forward(np.array(LONG[40:41]), cache, "none")  # none at 41
    m.forward(np.array(LONG[41:60]), cache, "none")
    cache.snapshot()  # at 60
    assert cache.reusable(59) == 40 and cache.reusable(60) == 60 and cache.reusable(10) == 0
    with pytest.raises(ValueError):
        cache.truncate(41)
    cache.truncate(40)
    resumed = m.forward(np.array(LONG[40:]), cache, "last")
    np.testing.assert_allclose(resumed, m.forward(np.array(LONG), m.new_cache(256), "last"), atol=1e-4)


def greedy(engine, ids, n=8, should_cancel=lambda: False) -> FinishEvent:
    events = list(engine.generate(GenerationRequest(list(ids), GREEDY, max_tokens=n, ignore_eos=True), should_cancel))
    assert isinstance(events[-1], FinishEvent)
    return events[-1]


def test_prefix_reuse_gives_the_tokens_of_no_reuse(tiny_qwen3_5):
    loaded = load_model(tiny_qwen3_5, context_length=512, prefill_chunk=16, kv_type="f32", cache_ram_mb=64)
    e = loaded.engine
    ref = Engine(loaded.model, loaded.tokenizer, e.eos_ids, e.context_length, e.prefill_chunk, kv_dtype=np.float32,
                 reuse_prefix=False)

    def render(messages):
        return loaded.tokenizer.encode(loaded.chat_template.render(messages, add_generation_prompt=True))

    messages, cached = [{"role": "system", "content": "You are a terse assistant."}], []
    turns = ["Hello there, who are you?", "Tell me about the weather in Paris.", "And in Rome?"]
    for i, text in enumerate(turns):
        messages.append({"role": "user", "content": text})
        ids = render(messages)
        if i == 1:  # a request cancelled mid-prefill first (after one chunk), then the same prompt again
            calls = iter(range(100))
            shared = common_prefix(e.cache_tokens, (), ids, ())  # the first chunk ends where it leaves turn 1
            cancelled = greedy(e, ids, should_cancel=lambda calls=calls: next(calls) >= 1)
            n = cancelled.timings.cache_n
            assert cancelled.reason == "cancelled" and len(ids) - n > 16
            first = shared - n if 0 < shared - n < 16 else 16
            assert len(e.cache_tokens) == n + first and e.cache_tokens == ids[:len(e.cache_tokens)]
        got, want = greedy(e, ids), greedy(ref, ids)
        assert got.token_ids == want.token_ids
        assert want.timings.cache_n == 0
        cached.append(got.timings.cache_n)
        messages.append({"role": "assistant", "content": loaded.tokenizer.decode(got.token_ids)})
    print(f"cached prompt tokens per turn: {cached}")
    assert cached[0] == 0 and cached[1] >= 16 and cached[2] > cached[1]
    # an edited first message: nothing in the cache is a whole prefix of it, so it runs from scratch, correctly
    edited = render([{"role": "system", "content": "You are verbose."}, {"role": "user", "content": "Hi"}])
    got = greedy(e, edited)
    assert got.token_ids == greedy(ref, edited).token_ids and got.timings.cache_n == 0
    # back to the conversation: its end state was kept in the store
    again = render(messages + [{"role": "user", "content": "Thanks."}])
    got = greedy(e, again)
    assert got.token_ids == greedy(ref, again).token_ids and got.timings.cache_n > cached[2]
    retry = greedy(e, again)  # the same prompt again: the state before its last token was kept
    assert retry.token_ids == got.token_ids and retry.timings.cache_n == len(again) - 1
