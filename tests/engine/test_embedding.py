"""Embedding models and rerankers on the engine against transformers on the same tiny random checkpoints:
Qwen3-Embedding (last-token pooling + normalize, as sentence-transformers runs it; mean pooling too) and
Qwen3-Reranker (the model card's yes/no recipe)."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from appliance.engine.embedding import EmbeddingJob, run_job
from appliance.engine.load import ModelLoadError, load_model
from appliance.protocol import rerank
from tests.support import tiny_models

TEXTS = ["The cat sat on the mat.", "The cat sat on the mat. It was warm.", "Edge boards answer questions",
         "Qwen3 embeddings: last-token pooling, then L2 normalisation, over a whole paragraph of text " * 3]


@pytest.fixture(scope="module")
def emb_dir(tmp_path_factory) -> str:
    return tiny_models.build_qwen3_embedding(str(tmp_path_factory.mktemp("qwen3-embedding")))


@pytest.fixture(scope="module")
def mean_dir(tmp_path_factory) -> str:
    return tiny_models.build_qwen3_embedding(str(tmp_path_factory.mktemp("qwen3-embedding-mean")), pooling="mean_tokens",
                                             seed=8)


def reference_embeddings(model_dir: str, texts: list[str], pooling: str = "last") -> np.ndarray:
    """transformers (float32) on the same directory: the tokenizer with its post-processor, the bare model's
    last hidden state, pooled, L2-normalised (sentence-transformers' Transformer -> Pooling -> Normalize)."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for t in texts:
            ids = tok(t, return_tensors="pt")
            h = model(**ids).last_hidden_state[0]  # (T, hidden)
            v = h[-1] if pooling == "last" else h.mean(0)
            out.append(torch.nn.functional.normalize(v, dim=0).numpy())
    return np.stack(out)


def reference_tokens(model_dir: str, text: str) -> list[int]:
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir)(text)["input_ids"]


def embed(lm, texts: list[str], cancel=lambda: False):
    head, tail = lm.task.affixes
    seqs = tuple(tuple(list(head) + lm.tokenizer.encode(t) + list(tail)) for t in texts)
    return run_job(lm.engine, EmbeddingJob(seqs, lm.task), cancel), seqs


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def test_qwen3_embedding_recognised_and_equal_to_transformers(emb_dir):
    lm = load_model(emb_dir, context_length=512, prefill_chunk=16)
    assert lm.kind == "embedding" and lm.task.pooling == "last" and lm.task.normalize
    assert lm.task.affixes == ((), (151643,))  # the post-processor's trailing <|endoftext|>
    res, seqs = embed(lm, TEXTS)
    assert list(seqs[0]) == reference_tokens(emb_dir, TEXTS[0])
    ours, ref = np.stack(res.vectors), reference_embeddings(emb_dir, TEXTS)
    assert res.reason == "stop" and ours.shape == (len(TEXTS), 64)
    assert np.all(cosine(ours, ref) > 1 - 1e-5), cosine(ours, ref)
    assert np.allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-6)
    assert res.prompt_tokens == sum(len(s) for s in seqs)
    # the second text starts with the first one's tokens but for the trailing <|endoftext|>: prefix reuse
    assert res.timings.cache_n >= len(seqs[0]) - 1
    # the same texts again in another order: the same vectors (reuse or not)
    again, _ = embed(lm, TEXTS[::-1])
    assert np.allclose(np.stack(again.vectors)[::-1], ours, atol=1e-5)


def test_mean_pooling_equal_to_transformers(mean_dir):
    lm = load_model(mean_dir, context_length=512, prefill_chunk=8)
    assert lm.task.pooling == "mean"
    res, _ = embed(lm, TEXTS)
    c = cosine(np.stack(res.vectors), reference_embeddings(mean_dir, TEXTS, "mean"))
    assert np.all(c > 1 - 1e-5), c


def test_cancel_between_chunks(emb_dir):
    lm = load_model(emb_dir, context_length=512, prefill_chunk=4)
    polls = []

    def cancel():
        polls.append(1)
        return len(polls) > 3
    res, _ = embed(lm, TEXTS, cancel)
    assert res.reason == "cancelled" and len(polls) == 4 and len(res.vectors) < len(TEXTS)


def test_embedding_flags_and_refusals(emb_dir, tiny_qwen3_tied, tmp_path):
    chat = load_model(tiny_qwen3_tied, context_length=256)
    assert chat.kind == "generate" and chat.task is None
    forced = load_model(tiny_qwen3_tied, context_length=256, task="embedding", pooling="mean")
    assert forced.kind == "embedding" and forced.task.pooling == "mean" and "--embedding" in forced.task.source
    with pytest.raises(ModelLoadError, match="--pooling"):
        load_model(tiny_qwen3_tied, context_length=256, pooling="mean")
    # a pooling we do not run is refused at load with one line naming it
    bad = tmp_path / "bad"
    shutil.copytree(emb_dir, bad)
    with open(bad / "1_Pooling" / "config.json", "w") as f:
        json.dump({"pooling_mode_max_tokens": True}, f)
    with pytest.raises(ModelLoadError, match="max_tokens"):
        load_model(str(bad), context_length=256)


# ---- reranker --------------------------------------------------------------------------------------------

QUERY = "What is the capital of China?"
DOCS = ["The capital of China is Beijing.", "Gravity is a force that attracts two bodies towards each other.",
        "Beijing", "Paris is the capital of France and its largest city."]


def card_scores(model_dir: str, query: str, docs: list[str], instruction: str = rerank.DEFAULT_INSTRUCTION):
    """The Qwen3-Reranker model card's transformers recipe: prefix + pair + suffix tokens, the last position's
    logits of "yes" and "no", log_softmax, exp of the "yes" one."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    yes, no = tok.convert_tokens_to_ids("yes"), tok.convert_tokens_to_ids("no")
    prefix = tok.encode(rerank.PREFIX, add_special_tokens=False)
    suffix = tok.encode(rerank.SUFFIX, add_special_tokens=False)
    out = []
    with torch.no_grad():
        for d in docs:
            pair = tok(rerank.pair_text(instruction, query, d), add_special_tokens=True)["input_ids"]
            ids = torch.tensor([prefix + pair + suffix])
            logits = model(input_ids=ids).logits[:, -1, :]
            two = torch.stack([logits[:, no], logits[:, yes]], dim=1)
            out.append(float(torch.nn.functional.log_softmax(two, dim=1)[:, 1].exp()[0]))
    return out


@pytest.fixture(scope="module")
def reranker_dir(tmp_path_factory) -> str:
    return tiny_models.build_qwen3(str(tmp_path_factory.mktemp("qwen3-reranker")), seed=11, kv_heads=2)


def test_reranker_scores_equal_the_model_card_recipe(reranker_dir):
    lm = load_model(reranker_dir, context_length=512, prefill_chunk=16, task="rerank")
    assert lm.kind == "rerank" and lm.task.yes_no == (lm.tokenizer.id_of("yes"), lm.tokenizer.id_of("no"))
    tok = lm.tokenizer
    head, tail = tok.encode(rerank.PREFIX), tok.encode(rerank.SUFFIX)
    seqs = tuple(tuple(head + tok.encode(rerank.pair_text(rerank.DEFAULT_INSTRUCTION, QUERY, d)) + tail) for d in DOCS)
    res = run_job(lm.engine, EmbeddingJob(seqs, lm.task), lambda: False)
    ref = card_scores(reranker_dir, QUERY, DOCS)
    assert np.allclose(res.scores, ref, atol=1e-5, rtol=0), (res.scores, ref)
    assert len(set(np.argsort(ref))) == len(DOCS)
    # documents after the first reuse the shared system text + query
    assert res.timings.cache_n >= (len(DOCS) - 1) * (len(head) + 10)
