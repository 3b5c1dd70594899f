"""Files made the way published GGUFs are: a tiny Qwen3 and a tiny Qwen3-MoE written as F16 by our `convert`, then
quantized by llama.cpp's own quantizer (llama_model_quantize from the peer venv, bench/peer.py) to the file types
people download. Each loads through our loader and runs like llama.cpp runs the same file.

Dimensions are multiples of 256 (hidden 256, attention 4 x 64, MLP and experts 512 / 256), so llama.cpp really
writes the K and IQ types instead of falling back; each test first checks that the file holds the types it means
to test. The dense model has an untied output head, the MoE model ties it to the embedding table (both served
from the quantized tensors: the table by row lookups, the head by products), and the MoE's stacked experts are
read in place.

Tolerances. Both engines round activations to 8 bits (act32 / act256 here, q8_0 / q8_K there) with slightly
different scales, and this random model amplifies that rounding: llama.cpp's own Q8_0 file of the same model
differs from ours by ~2.2% of the logits' RMS (measured), the K and IQ files by 2-3.2%. Per position, the
relative RMS difference of the logits must be at most 5% at the median position and 6% at the worst one for the
dense model; in the MoE model a position where a token's top-2 experts are a near-tie in the router can route
differently in the two engines (measured up to 35% at such positions, Q8_0 included), so there at least 3 of 4
positions are within 6%. The top choice must agree wherever llama.cpp's own top-1 margin is decisive (above
0.5, the logits' RMS being ~3) at those positions within 6% (all of them for the dense model). Greedy decoding: the first 16 tokens equal llama.cpp's, or the first divergence
is a near-tie: at that step each engine's margin between the two tokens is below the largest logit difference
between the engines (the SmolLM2 tests' standard, made numeric).
"""
from __future__ import annotations

import collections

import numpy as np
import pytest

from appliance import convert
from appliance.engine.load import load_model
from tests.support import tiny_models
from tests.support.gguf_files import greedy_tokens

# llama.cpp file type -> the tensor types it must hold for the test to test them (all but the MoE's attention
# and head; for the MoE: in its stacked expert tensors)
FTYPES = {
    "Q4_K_M": {"Q4_K", "Q6_K"}, "Q5_K_M": {"Q5_K", "Q6_K"}, "Q5_0": {"Q5_0"}, "Q5_1": {"Q5_1"},
    "Q3_K_M": {"Q3_K", "Q4_K", "Q5_K"}, "Q2_K": {"Q2_K", "Q3_K"}, "IQ4_XS": {"IQ4_XS"}, "IQ4_NL": {"IQ4_NL"},
}
MOE_EXPERT_TYPES = {"Q4_K_M": {"Q4_K"}, "Q5_K_M": {"Q5_K"}, "Q5_0": {"Q5_0"}, "Q5_1": {"Q5_1"},
                    "Q3_K_M": {"Q3_K", "Q4_K"}, "Q2_K": {"Q2_K", "Q3_K"}, "IQ4_XS": {"IQ4_XS"}, "IQ4_NL": {"IQ4_NL"}}
CASES = [(m, f) for m in ("dense", "moe") for f in FTYPES]
TEXT = "The quick brown fox jumps over the lazy dog. 12345, said she."
N_GREEDY = 16


@pytest.fixture(scope="module")
def f16_files(tmp_path_factory):
    """{model: F16 GGUF path} of the two tiny checkpoints (dimensions multiples of 256)."""
    d = tmp_path_factory.mktemp("llama-quants")
    dense = tiny_models.build_qwen3(str(d / "dense"), hidden=256, intermediate=512, heads=4, head_dim=64,
                                    kv_heads=2, layers=2, tie=False, seed=7)
    moe = tiny_models.build_qwen3_moe(str(d / "moe"), hidden=256, intermediate=512, moe_intermediate=256, heads=4,
                                      head_dim=64, kv_heads=2, experts=8, top_k=2, layers=2, tie=True, seed=11)
    out = {}
    for name, src in (("dense", dense), ("moe", moe)):
        out[name] = str(d / f"{name}-f16.gguf")
        assert convert.main([src, out[name], "--type", "f16"]) == 0
    return out


@pytest.fixture(scope="module")
def quantized(peer, f16_files, tmp_path_factory):
    """quantized(model, ftype) -> path of the file llama.cpp's quantizer wrote (made once per module)."""
    d, made = tmp_path_factory.mktemp("llama-quantized"), {}

    def get(model: str, ftype: str) -> str:
        if (model, ftype) not in made:
            made[model, ftype] = peer.quantize(f16_files[model], str(d / f"{model}-{ftype}.gguf"), ftype)
        return made[model, ftype]
    return get


def tensor_types(path: str, experts_only: bool) -> collections.Counter:
    import gguf
    return collections.Counter(t.tensor_type.name for t in gguf.GGUFReader(path).tensors
                               if len(t.shape) > 1 and (not experts_only or "_exps" in t.name))


def assert_same_or_near_tie(p, lm, prompt: list[int], ours: list[int], theirs: list[int]) -> None:
    k = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    if k is None:
        return
    prefix = prompt + theirs[:k]
    th = np.array(p.logits(prefix), np.float32)[-1]
    ou = lm.model.forward(np.array(prefix), lm.model.new_cache(len(prefix)), logits="all")[-1]
    gap = float(np.abs(th - ou).max())
    their_margin, our_margin = th[theirs[k]] - th[ours[k]], ou[ours[k]] - ou[theirs[k]]
    assert abs(their_margin) <= gap and abs(our_margin) <= gap, (
        f"greedy tokens differ from step {k} (ours {ours}, llama.cpp {theirs}) and it is not a near-tie: margins "
        f"{their_margin:.3f} (llama.cpp) / {our_margin:.3f} (ours) against an engine difference of {gap:.3f}")


@pytest.mark.parametrize("model,ftype", CASES)
def test_llama_cpp_quantized_file_runs_like_llama_cpp(peer, quantized, model, ftype):
    path = quantized(model, ftype)
    held = tensor_types(path, experts_only=model == "moe")
    want = MOE_EXPERT_TYPES[ftype] if model == "moe" else FTYPES[ftype]
    assert want <= set(held), f"llama.cpp's {ftype} file holds {dict(held)}, not {want}"
    lm = load_model(path)
    ids = lm.tokenizer.encode(TEXT)
    prompt = lm.tokenizer.encode(lm.chat_template.render([{"role": "user", "content": "Hello there!"}],
                                                         add_generation_prompt=True))
    with peer.LlamaCppPeer(path, n_threads=2) as p:
        theirs = np.array(p.logits(ids), dtype=np.float32)  # (T, vocab), one token at a time
        ours = lm.model.forward(np.array(ids), lm.model.new_cache(len(ids)), logits="all")
        per_pos = np.sqrt(np.mean((ours - theirs) ** 2, axis=-1) / np.mean(theirs ** 2, axis=-1))
        assert np.median(per_pos) <= 0.05, np.round(per_pos, 3)
        same_routing = per_pos <= 0.06  # dense: every position
        if model == "dense":
            assert same_routing.all(), np.round(per_pos, 3)
        else:
            assert np.mean(same_routing) >= 0.75, np.round(per_pos, 3)
        top2 = np.sort(theirs, axis=-1)[:, -2:]
        decisive = (top2[:, 1] - top2[:, 0] > 0.5) & same_routing
        assert decisive.sum() >= len(ids) // 4
        assert np.array_equal(ours.argmax(-1)[decisive], theirs.argmax(-1)[decisive])
        assert_same_or_near_tie(p, lm, prompt, greedy_tokens(lm, prompt, N_GREEDY), p.greedy(prompt, N_GREEDY))


def test_llama_cpp_q3_k_m_moe_through_the_cli_server(peer, quantized, cli_server):
    """The file llama.cpp writes for a 16 GB board's 30B-A3B (Q3_K_M: Q3_K / Q4_K experts, a Q6_K head), served
    by the real CLI: the streamed completion is the engine's greedy text, whose tokens are llama.cpp's (or part
    from them at a near-tie)."""
    from openai import OpenAI

    from appliance.engine.generate import GenerationRequest
    from appliance.engine.sampling import SamplingParams
    path = quantized("moe", "Q3_K_M")
    lm = load_model(path)
    prompt = lm.tokenizer.encode(TEXT)
    events = list(lm.engine.generate(GenerationRequest(prompt, SamplingParams(temperature=0.0), max_tokens=12,
                                                       ignore_eos=True)))
    ours = [e.token_id for e in events[:-1]]
    with peer.LlamaCppPeer(path, n_threads=2) as p:
        assert_same_or_near_tie(p, lm, prompt, ours, p.greedy(prompt, len(ours)))
    proc, port = cli_server(path, "--threads", "2")
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
    stream = client.completions.create(model="any", prompt=TEXT, max_tokens=12, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in stream) == "".join(e.text for e in events)
