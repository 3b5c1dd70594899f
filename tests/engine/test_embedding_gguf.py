"""GGUF embedding models and rerankers as llama.cpp's own converter (convert_hf_to_gguf.py of the peer's source
distribution) writes them: `qwen3.pooling_type` LAST / MEAN with add_eos_token, and RANK with the 2-row
cls.output head and ["yes", "no"] labels. Same vectors as transformers, same scores as the model card's recipe."""
from __future__ import annotations

import os

import numpy as np
import pytest

from appliance.engine.embedding import EmbeddingJob, run_job
from appliance.engine.load import load_model
from appliance.protocol import rerank
from tests.engine.test_embedding import DOCS, QUERY, TEXTS, card_scores, cosine, embed, reference_embeddings
from tests.support import tiny_models
from tests.support.gguf_files import convert_with_llama_cpp


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-embed")
    last = tiny_models.build_qwen3_embedding(str(root / "qwen3-embedding"))
    mean = tiny_models.build_qwen3_embedding(str(root / "qwen3-embedding-mean"), pooling="mean_tokens", seed=9)
    # the converter knows a Qwen3 reranker by its name (or its README's "# Qwen3-Reranker" title)
    rr = tiny_models.build_qwen3(str(root / "qwen3-reranker-tiny"), seed=11, kv_heads=2)
    return {name: (d, convert_with_llama_cpp(d, os.path.join(root, f"{name}.gguf")))
            for name, d in (("last", last), ("mean", mean), ("rerank", rr))}


@pytest.mark.parametrize("name,pooling", [("last", "last"), ("mean", "mean")])
def test_converter_embedding_file_equals_transformers(files, name, pooling):
    hf_dir, path = files[name]
    lm = load_model(path, context_length=512, prefill_chunk=16)
    assert lm.kind == "embedding" and lm.task.pooling == pooling and lm.task.affixes == ((), (151643,))
    assert lm.task.source == f"qwen3.pooling_type {3 if pooling == 'last' else 1}"
    res, _ = embed(lm, TEXTS)
    c = cosine(np.stack(res.vectors), reference_embeddings(hf_dir, TEXTS, pooling))
    assert np.all(c > 1 - 1e-5), c


def test_converter_reranker_file_scores_equal_the_model_card(files):
    hf_dir, path = files["rerank"]
    lm = load_model(path, context_length=512, prefill_chunk=16)  # no flag: pooling_type RANK says it
    assert lm.kind == "rerank" and lm.task.head.shape == (2, 64)
    tok = lm.tokenizer
    head, tail = tok.encode(rerank.PREFIX), tok.encode(rerank.SUFFIX)
    seqs = tuple(tuple(head + tok.encode(rerank.pair_text(rerank.DEFAULT_INSTRUCTION, QUERY, d)) + tail) for d in DOCS)
    res = run_job(lm.engine, EmbeddingJob(seqs, lm.task), lambda: False)
    ref = card_scores(hf_dir, QUERY, DOCS)
    assert np.allclose(res.scores, ref, atol=1e-5, rtol=0), (res.scores, ref)
