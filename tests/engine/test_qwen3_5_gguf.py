"""Qwen3.5 (dense `qwen35`, MoE `qwen35moe`) from GGUF files made by llama.cpp's own converter: the file's
layout; the same logits and greedy tokens as the Hugging Face directory it came from (through our engine) and as
transformers; a file with the multi-token-prediction block loads to the same model; llama.cpp on the same file
agrees; what the loader cannot compute exactly is refused."""
import numpy as np
import pytest
import torch

from appliance.engine.generate import GenerationRequest
from appliance.engine.load import ModelLoadError, decoder_of, load_model
from appliance.engine.load.gguf import open_gguf, read_metadata
from appliance.engine.load.gguf_qwen35 import HeadOrder, grouped_heads, qwen35_config
from appliance.engine.qwen3_5 import FULL, LINEAR, GatedDeltaNet, SharedExpertMoE
from appliance.engine.sampling import SamplingParams
from appliance.native.qtypes import QType

PROMPT = [151644, 872, 198, 9707, 11, 1246, 525, 498, 30, 151645, 198, 151644, 77091, 198]
LONG = (PROMPT * 9)[:120]  # two delta-rule chunks in one prefill
GREEDY = SamplingParams(temperature=0.0)
# max |log p(ours, GGUF) - log p(transformers)| over every position and vocabulary entry (measured: f32 4.4e-4 dense,
# 1.6e-3 MoE; f16 4.2e-4 dense, 4.1e-3 MoE, as the Hugging Face directory's BF16 read in place gives: 4.2e-3; on an
# AVX2-only AMD EPYC the MoE f32 file is 2.9e-3 off, its HF directory 4.2e-3: other kernels' rounding, which the
# routing amplifies)
LOGPROB_BOUND = {"f32": 4e-3, "f16": 6e-3}
# max |logit(GGUF) - logit(HF directory)| / max |logit|: the same values in another container, read by other
# matmul kernels (the directory's BF16 in place, the file's F32 / F16), over 8 layers of random weights (measured:
# 3.6e-5 dense, 2.8e-4 MoE, whose routing amplifies the kernels' differences)
FILE_BOUND = 5e-4
# llama.cpp on the same f32 file, teacher-forced one token at a time: max |logit diff| / max |logit| (measured:
# 1.2e-4 dense; 4.5e-3 MoE, where llama.cpp is 40x farther from transformers than we are: 4.3e-2 vs 1.1e-3 abs)
PEER_BOUND = {"dense": 1e-3, "moe": 1e-2}
# a router tie: the k-th and (k+1)-th expert scores this close (measured on the AVX2 EPYC: 3.7e-5 / 7.9e-5 at one
# position of the MoE f32 file, where the two files pick different experts; the next-closest gap was 4e-3)
ROUTE_TIE = 1e-3


@pytest.fixture(params=["dense", "moe"])
def files(request):
    return request.getfixturevalue("qwen3_5_gguf" if request.param == "dense" else "qwen3_5_moe_gguf")


def reference(path):
    from transformers import AutoModelForImageTextToText
    return AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()


def log_softmax(x):
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def logits(path, ids):
    m = load_model(path, context_length=256).model
    return m.forward(np.array(ids), m.new_cache(256), "all")  # (T, vocab)


def logits_and_router_scores(path, ids):
    """The logits, each MoE layer's router scores of the same forward (none for a dense model) and the experts
    a token is routed to."""
    m = load_model(path, context_length=256).model
    scores: list[np.ndarray] = []
    for layer in decoder_of(m).layers:
        if isinstance(layer.mlp, SharedExpertMoE):
            def routed(x, moe=layer.mlp.routed):
                scores.append(x @ moe.router.T)  # (T, experts)
                return moe(x)
            layer.mlp.routed = routed
    top_k = decoder_of(m).config.num_experts_per_tok
    return m.forward(np.array(ids), m.new_cache(256), "all"), scores, top_k  # (T, vocab), [(T, experts)], k


def routing_ties(a: list[np.ndarray], b: list[np.ndarray], top_k: int) -> list[int]:
    """Positions where two runs route a token to different experts; each must be a near-tie of the router in both
    (the k-th and (k+1)-th scores within ROUTE_TIE): there the experts' outputs differ by design, not by a fault."""
    flips = set()
    for sa, sb in zip(a, b):
        for p in range(len(sa)):
            if set(np.argsort(-sa[p])[:top_k]) != set(np.argsort(-sb[p])[:top_k]):
                for s in (sa[p], sb[p]):
                    top = np.sort(s)[::-1]
                    assert top[top_k - 1] - top[top_k] < ROUTE_TIE, f"position {p}: routing differs without a tie"
                flips.add(p)
    return sorted(flips)


def rel(a, b):
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def test_converter_writes_the_qwen35_layout(qwen3_5_gguf, qwen3_5_moe_gguf):
    for files, arch in ((qwen3_5_gguf, "qwen35"), (qwen3_5_moe_gguf, "qwen35moe")):
        r = open_gguf(files["f16"])
        meta, t = read_metadata(r), {x.name: x for x in r.tensors}
        assert meta["general.architecture"] == arch
        assert meta[f"{arch}.attention.recurrent_layers"] == [True, True, True, False] * 2
        assert (meta[f"{arch}.ssm.group_count"], meta[f"{arch}.ssm.time_step_rank"]) == (2, 4)
        assert meta[f"{arch}.rope.dimension_count"] == 8  # partial rotary: half of 16
        for name in ("ssm_a", "ssm_dt.bias", "ssm_conv1d.weight", "attn_qkv.weight", "attn_gate.weight",
                     "ssm_beta.weight", "ssm_alpha.weight", "ssm_norm.weight", "ssm_out.weight"):
            assert f"blk.0.{name}" in t and f"blk.3.{name}" not in t, name
        assert "blk.3.attn_q.weight" in t and "blk.0.post_attention_norm.weight" in t
        assert [int(n) for n in t["blk.0.ssm_conv1d.weight"].shape] == [4, 2 * 32 + 64]  # ne: K, conv_dim
        assert t["blk.0.attn_qkv.weight"].tensor_type.name == "F16"
        if arch == "qwen35moe":
            assert [int(n) for n in t["blk.0.ffn_gate_inp_shexp.weight"].shape] == [64, 1]


def test_layers_and_weights_as_mapped(qwen3_5_moe_gguf):
    m = load_model(qwen3_5_moe_gguf["f16"], context_length=64).model
    assert m.config.layer_types == (LINEAR, LINEAR, LINEAR, FULL) * 2 and m.config.rotary_dim == 8
    mixer = m.layers[0].mixer
    assert isinstance(mixer, GatedDeltaNet) and isinstance(m.layers[0].mlp, SharedExpertMoE)
    assert isinstance(mixer.qkv, HeadOrder) and mixer.qkv.weight.qtype == QType.F16  # stored bits, not widened
    assert mixer.qkv.weight.raw.base is not None  # a view of the file mapping


def test_value_head_order_inverts_the_converters():
    nk, nv, d = 2, 6, 3
    hf = np.arange(nv * d)  # Hugging Face order: grouped by key head
    file = hf.reshape(nk, nv // nk, d).transpose(1, 0, 2).reshape(-1)  # the converter's tiled order
    np.testing.assert_array_equal(file[grouped_heads(nk, nv, d)], hf)


@pytest.mark.parametrize("kind", ["f32", "f16"])
def test_gguf_equals_hf_directory_and_transformers(files, kind):
    want, want_scores, top_k = logits_and_router_scores(files["hf"], LONG)
    got, got_scores, _ = logits_and_router_scores(files[kind], LONG)
    with torch.no_grad():
        ref = reference(files["hf"])(torch.tensor([LONG])).logits[0].numpy()
    ties = routing_ties(want_scores, got_scores, top_k)
    assert len(ties) <= 2, ties  # a tie is rare: more would be a fault, not rounding
    keep = np.setdiff1d(np.arange(len(LONG)), ties)
    got, want, ref = got[keep], want[keep], ref[keep]
    diff = float(np.max(np.abs(log_softmax(got) - log_softmax(ref))))
    print(f"{files[kind].rsplit('/', 1)[-1]}: max |logit diff| vs HF directory {np.max(np.abs(got - want)):.2e} "
          f"(rel {rel(got, want):.2e}); max |logprob diff| vs transformers {diff:.2e} over {len(keep)} positions "
          f"(left out: {ties}, router near-ties that the two files break apart)")
    assert rel(got, want) <= FILE_BOUND
    assert diff <= LOGPROB_BOUND[kind]
    assert np.array_equal(got.argmax(-1), ref.argmax(-1))


def test_greedy_tokens_match_transformers(files):
    with torch.no_grad():
        out = reference(files["hf"]).generate(torch.tensor([PROMPT]), max_new_tokens=24, min_new_tokens=24,
                                              do_sample=False)
    want = out[0, len(PROMPT):].tolist()
    for path in (files["hf"], files["f32"], files["f16"]):
        loaded = load_model(path, context_length=256, prefill_chunk=5)
        events = list(loaded.engine.generate(GenerationRequest(PROMPT, GREEDY, max_tokens=24, ignore_eos=True)))
        assert [e.token_id for e in events[:-1]] == want, path


@pytest.fixture(scope="module")
def mtp_files(qwen3_5_gguf, qwen3_5_moe_gguf, tmp_path_factory):
    from tests.support.llama_convert import convert_hf
    from tests.support.qwen3_5_gguf import with_mtp_head

    out = tmp_path_factory.mktemp("qwen3_5-mtp")
    paths = {}
    for name, files in (("dense", qwen3_5_gguf), ("moe", qwen3_5_moe_gguf)):
        src = with_mtp_head(files["hf"], str(out / f"{name}-hf"))
        paths[name] = (convert_hf(src, str(out / f"{name}-mtp-f16.gguf"), "f16"), files["f16"])
    return paths


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_a_file_with_the_mtp_block_loads_to_the_same_model(mtp_files, name):
    with_mtp, without = mtp_files[name]
    meta = read_metadata(open_gguf(with_mtp))
    arch = meta["general.architecture"]
    assert meta[f"{arch}.block_count"] == 9 and meta[f"{arch}.nextn_predict_layers"] == 1
    assert "blk.8.nextn.eh_proj.weight" in {t.name for t in open_gguf(with_mtp).tensors}
    assert load_model(with_mtp, context_length=64).config.num_hidden_layers == 8
    np.testing.assert_array_equal(logits(with_mtp, PROMPT), logits(without, PROMPT))


def test_metadata_that_does_not_fit_is_refused(qwen3_5_gguf, tmp_path):
    r = open_gguf(qwen3_5_gguf["f32"])
    meta, tensors = read_metadata(r), {t.name: t for t in r.tensors}
    assert qwen35_config(meta, tensors).layer_types == (LINEAR, LINEAR, LINEAR, FULL) * 2
    no_list = {k: v for k, v in meta.items() if k != "qwen35.attention.recurrent_layers"}
    assert qwen35_config(no_list, tensors).layer_types == (LINEAR, LINEAR, LINEAR, FULL) * 2  # from the interval
    bad = [({"qwen35.attention.recurrent_layers": [True] * 7}, "recurrent_layers"),
           ({"qwen35.ssm.inner_size": 50}, "value heads"),
           ({"qwen35.rope.dimension_count": 7}, "rotary"),
           ({"qwen35.rope.scaling.type": "yarn"}, "rope scaling"),
           ({"qwen35.nextn_predict_layers": 2}, "multi-token-prediction")]
    for change, message in bad:
        with pytest.raises(ValueError, match=message):
            qwen35_config({**meta, **change}, tensors)
    with pytest.raises(ModelLoadError, match="--mmproj .*no such file"):  # pairs: test_qwen3_5_gguf_vision.py
        load_model(qwen3_5_gguf["f32"], mmproj=str(tmp_path / "mmproj.gguf"))


def test_qwen35_pre_tokenizer_matches_llama_cpps_tokenizer_test():
    """llama.cpp's vocabulary file for the `qwen35` pre-tokenizer and its tokenizer test (texts, expected ids)."""
    from appliance.engine.gguf_tokenizer import build_tokenizer
    from tests.support.llama_convert import llama_cpp_file

    path = "models/ggml-vocab-qwen35.gguf"
    vocab = llama_cpp_file(path)
    meta = read_metadata(open_gguf(vocab))
    assert meta["tokenizer.ggml.pre"] == "qwen35"
    tok = build_tokenizer(meta)
    with open(llama_cpp_file(path + ".inp"), encoding="utf-8") as f:
        texts = f.read().split("\n__ggml_vocab_test__\n")
    with open(llama_cpp_file(path + ".out"), encoding="utf-8") as f:
        ids = [[int(x) for x in line.split()] for line in f.read().split("\n")]
    assert len(texts) > 40 and any("\u0301" in t for t in texts)  # decomposed accents among them
    for text, want in zip(texts, ids):
        assert tok.encode(text) == want, text


def test_the_tensor_set_is_checked(qwen3_5_gguf):
    from appliance.engine.load.gguf import GGUFModelFile
    from appliance.engine.load.gguf_qwen35 import build_qwen35

    r = open_gguf(qwen3_5_gguf["f32"])
    meta = read_metadata(r)
    cfg = qwen35_config(meta, {t.name: t for t in r.tensors})
    f = GGUFModelFile(r)
    f.tensors.pop("blk.1.ssm_a")
    with pytest.raises(ValueError, match="blk.1.ssm_a is missing"):
        build_qwen35(cfg, f, meta)
    f = GGUFModelFile(r)
    f.tensors["blk.3.ssm_a"] = f.tensors["blk.1.ssm_a"]  # a full-attention layer has no delta-rule decay
    with pytest.raises(ValueError, match="blk.3.ssm_a is not used by this model's layers"):
        build_qwen35(cfg, f, meta)


def test_llama_cpp_agrees_on_the_same_file(peer, files):
    """llama.cpp's logits (teacher-forced, one token at a time) and greedy tokens on the f32 and f16 files."""
    theirs, ours, greedy = {}, {}, {}
    for kind in ("f32", "f16"):
        with peer.LlamaCppPeer(files[kind], n_threads=2) as p:
            theirs[kind] = np.array(p.logits(PROMPT), dtype=np.float32)  # (T, vocab)
            greedy[kind] = p.greedy(PROMPT, 12)
        ours[kind] = logits(files[kind], PROMPT)
        assert theirs[kind].shape == ours[kind].shape
        d = float(np.max(np.abs(log_softmax(ours[kind]) - log_softmax(theirs[kind]))))
        print(f"{files[kind].rsplit('/', 1)[-1]} vs llama.cpp: max |logit diff| "
              f"{np.max(np.abs(ours[kind] - theirs[kind])):.2e} (rel {rel(ours[kind], theirs[kind]):.2e}), "
              f"max |logprob diff| {d:.2e}")
    with torch.no_grad():
        ref = reference(files["hf"])(torch.tensor([PROMPT])).logits[0].numpy()
    own = rel(theirs["f16"], theirs["f32"])
    print(f"llama.cpp f16 vs its own f32: rel {own:.2e}; f32 vs transformers: llama.cpp rel "
          f"{rel(theirs['f32'], ref):.2e}, ours {rel(ours['f32'], ref):.2e}")
    moe = "moe" in files["f32"].rsplit("/", 1)[-1]
    assert rel(ours["f32"], theirs["f32"]) <= PEER_BOUND["moe" if moe else "dense"]
    assert rel(ours["f32"], ref) <= rel(theirs["f32"], ref)  # where we differ, llama.cpp is the farther one
    # f16: llama.cpp rounds the activations to f16 for its F16 matmuls (ours stay f32): it is as far from its own
    # f32 logits as from ours
    assert rel(ours["f16"], theirs["f16"]) <= 1.25 * own + PEER_BOUND["dense"]
    for kind in ("f32", "f16"):
        loaded = load_model(files[kind], context_length=256)
        events = list(loaded.engine.generate(GenerationRequest(PROMPT, GREEDY, max_tokens=12, ignore_eos=True)))
        assert [e.token_id for e in events[:-1]] == greedy["f32"], kind  # (llama.cpp's f16 run may leave them)


@pytest.fixture(scope="module")
def calm_q8_0(tmp_path_factory):
    """A dense checkpoint of smaller weights (init std 0.05) and the converter's q8_0 file of it."""
    from tests.support.qwen3_5_gguf import build_files
    return build_files(str(tmp_path_factory.mktemp("qwen3_5-q8_0")), moe=False, types=("q8_0",), init_std=0.05)


def test_q8_0_file_agrees_with_llama_cpp(peer, calm_q8_0):
    """Both round the weights (and the activations, each in its own kernels) to 8 bits: the logits move by about
    a tenth of their range from the float model's, alike (measured: ours 0.120, llama.cpp 0.128, each other
    0.094), and the teacher-forced top choices agree at every position."""
    path = calm_q8_0["q8_0"]
    assert {t.tensor_type.name for t in open_gguf(path).tensors if t.name.startswith("blk.0.attn_qkv")} == {"Q8_0"}
    ours = logits(path, PROMPT)
    with peer.LlamaCppPeer(path, n_threads=2) as p:
        theirs = np.array(p.logits(PROMPT), dtype=np.float32)  # (T, vocab)
    with torch.no_grad():
        ref = reference(calm_q8_0["hf"])(torch.tensor([PROMPT])).logits[0].numpy()
    print(f"q8_0: rel logit diff ours vs llama.cpp {rel(ours, theirs):.3f}, vs transformers: ours {rel(ours, ref):.3f}, "
          f"llama.cpp {rel(theirs, ref):.3f}")
    assert np.array_equal(ours.argmax(-1), theirs.argmax(-1))
    assert rel(ours, theirs) <= 0.15 and rel(ours, ref) <= 1.1 * rel(theirs, ref)
