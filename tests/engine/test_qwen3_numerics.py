"""Our numpy Qwen3 decoder against transformers' float32 forward on the same bf16 checkpoints."""
import numpy as np
import pytest
import torch

from appliance.engine.config import Qwen3Config
from appliance.engine.layer_runner import choose_runner
from appliance.engine.load.hf import build_qwen3
from appliance.engine.safetensors import SafeTensors

PROMPT = [151644, 872, 198, 9707, 11, 1246, 525, 498, 30, 151645, 198, 151644, 77091, 198, 35946, 3555, 374]


def load_ours(path):
    import json
    with open(f"{path}/config.json") as f:
        cfg_dict = json.load(f)
    m = build_qwen3(SafeTensors(path), cfg_dict)[1]
    choose_runner(m)  # as load_model does
    return m


def load_reference(path):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    return model


def rel_err(a, b):
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.fixture(params=["tiny_qwen3_tied", "tiny_qwen3_untied"])
def checkpoint(request):
    return request.getfixturevalue(request.param)


def test_config_reads_both_rope_spellings(tiny_qwen3_tied):
    import json
    with open(f"{tiny_qwen3_tied}/config.json") as f:
        d = json.load(f)
    assert "rope_parameters" in d
    new = Qwen3Config.from_dict(d)
    old = dict(d)
    old.pop("rope_parameters")
    old["rope_theta"] = 1_000_000.0
    assert Qwen3Config.from_dict(old) == new
    assert new.rope_theta == 1_000_000.0


def test_prompt_logits_match_transformers(checkpoint):
    ours, ref = load_ours(checkpoint), load_reference(checkpoint)
    with torch.no_grad():
        want = ref(torch.tensor([PROMPT])).logits[0].numpy()  # (T, V)
    cache = ours.new_cache(64)
    got = ours.forward(np.array(PROMPT), cache, "all")
    assert got.shape == want.shape
    assert rel_err(got[-1], want[-1]) <= 1e-4
    assert rel_err(got, want) <= 1e-4
    # chunked prefill gives the same last logits
    cache2 = ours.new_cache(64)
    ours.forward(np.array(PROMPT[:5]), cache2, "none")
    ours.forward(np.array(PROMPT[5:11]), cache2, "none")
    last = ours.forward(np.array(PROMPT[11:]), cache2, "last")
    assert rel_err(last, want[-1]) <= 1e-4


def test_cached_decode_matches_full_forward(checkpoint):
    ours = load_ours(checkpoint)
    rng = np.random.default_rng(0)
    extra = rng.integers(0, 151000, size=20).tolist()
    cache = ours.new_cache(64)
    ours.forward(np.array(PROMPT), cache, "none")
    for tok in extra:
        step = ours.forward(np.array([tok]), cache, "last")
    full = ours.forward(np.array(PROMPT + extra), ours.new_cache(64), "last")
    assert cache.length == len(PROMPT) + 20
    assert rel_err(step, full) <= 1e-5


def test_greedy_tokens_match_generate(checkpoint):
    from appliance.engine.generate import GenerationRequest
    from appliance.engine.load import load_model
    from appliance.engine.sampling import SamplingParams

    ref = load_reference(checkpoint)
    with torch.no_grad():
        out = ref.generate(torch.tensor([PROMPT]), max_new_tokens=32, min_new_tokens=32, do_sample=False)
    want = out[0, len(PROMPT):].tolist()
    loaded = load_model(checkpoint)
    events = list(loaded.engine.generate(GenerationRequest(PROMPT, SamplingParams(temperature=0.0), max_tokens=32,
                                                           ignore_eos=True)))
    got = [e.token_id for e in events[:-1]]
    assert events[-1].reason == "length"
    assert got == want
