"""Interop with llama.cpp (llama-cpp-python, the reference GGUF implementation) on the same files.

llama.cpp runs from the peer venv of bench/peer.py. Decision: these tests use that cached venv and, when it
is missing, build it (llama-cpp-python from its PyPI sdist, 6-10 minutes on 2 cores, ~20 under load; once
per machine, cached in ~/.cache/kestrel-bench or $KESTREL_PEER_VENV). That keeps the project's own venv
free of a compiled llama.cpp and is the same build the benchmark measures against; a fresh CI machine pays
the build once and stays inside the 30-minute budget.

Checked: (1) tokenization of our GGUF tokenizer equals llama.cpp's, for the real SmolLM2 file (`smollm` pre-
tokenizer) and for our converted Qwen3 file (`qwen2`); (2) tiny random Qwen3, Llama and Qwen2 checkpoints converted
by our `convert` load in llama.cpp and in ours: in f16/f32 both give the same greedy tokens; in q8_0/q4_0
their teacher-forced logits agree (both round activations to 8 bits there, in different kernels).
"""
from __future__ import annotations

import numpy as np
import pytest

from appliance import convert
from appliance.engine.load import load_model
from tests.support.gguf_files import build_tiny, fetch_smollm2, greedy_tokens

TEXTS = ["What is the capital of France?", "12345 digits 3.14159 and  double  spaces\n\n\tTab  \n",
         "Ünïcödé — 日本語のテキスト 🙂 émigré", "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
         "<think>\nhmm\n</think>\n\nI'm sure you've", "def f(x):\n    return x**2  # ok", "   leading spaces"]


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_qwen3_untied):
    """{(model, type): path} converted once for the module."""
    out = tmp_path_factory.mktemp("interop")
    paths = {}
    sources = {"qwen3": tiny_qwen3_untied}
    for arch in ("llama", "qwen2"):
        sources[arch] = build_tiny(str(tmp_path_factory.mktemp(f"tiny-{arch}-interop")), arch)
    for model, src in sources.items():
        for kind in ("f32", "f16", "q8_0", "q4_0"):
            p = str(out / f"{model}-{kind}.gguf")
            assert convert.main([src, p, "--type", kind]) == 0
            paths[model, kind] = p
    return paths


def test_smollm2_tokenizer_matches_llama_cpp(peer):
    path = fetch_smollm2()
    ours = load_model(path).tokenizer
    with peer.LlamaCppPeer(path, n_threads=1) as p:
        for text in TEXTS:
            assert ours.encode(text) == p.tokenize(text), text


def test_converted_qwen_tokenizer_matches_llama_cpp(peer, files):
    ours = load_model(files["qwen3", "q8_0"]).tokenizer
    with peer.LlamaCppPeer(files["qwen3", "q8_0"], n_threads=1) as p:
        for text in TEXTS:
            assert ours.encode(text) == p.tokenize(text), text


@pytest.mark.parametrize("model", ["qwen3", "llama", "qwen2"])
@pytest.mark.parametrize("kind", ["f32", "f16"])
def test_same_greedy_tokens_as_llama_cpp(peer, files, model, kind):
    lm = load_model(files[model, kind])
    prompt = lm.tokenizer.encode(lm.chat_template.render([{"role": "user", "content": "Hello there!"}],
                                                         add_generation_prompt=True))
    with peer.LlamaCppPeer(files[model, kind], n_threads=2) as p:
        theirs = p.greedy(prompt, 12)
    assert greedy_tokens(lm, prompt, 12) == theirs


@pytest.mark.parametrize("model", ["qwen3", "llama"])
@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_quantized_logits_agree_with_llama_cpp(peer, files, model, kind):
    lm = load_model(files[model, kind])
    ids = lm.tokenizer.encode("The quick brown fox jumps over the lazy dog. 12345, said she.")
    with peer.LlamaCppPeer(files[model, kind], n_threads=2) as p:
        theirs = np.array(p.logits(ids), dtype=np.float32)  # (T, vocab)
    ours = lm.model.forward(np.array(ids), lm.model.new_cache(len(ids)), logits="all")  # (T, vocab)
    assert np.abs(ours - theirs).max() < 0.05 * np.abs(theirs).max()
    assert np.mean(ours.argmax(-1) == theirs.argmax(-1)) >= 0.9
