"""A GGUF embedding file made by llama.cpp's converter, served by us over HTTP (openai client), gives the vectors
llama.cpp's embedding mode gives on the same file (the peer: llama-cpp-python built from source)."""
from __future__ import annotations

import os

import numpy as np
import pytest

from tests.engine.test_embedding import TEXTS, cosine
from tests.support import tiny_models
from tests.support.gguf_files import convert_with_llama_cpp
from tests.support.live_server import LiveServer


@pytest.mark.parametrize("pooling", ["lasttoken", "mean_tokens"])
def test_our_vectors_equal_llama_cpp_embedding_mode(peer, tmp_path, pooling):
    from openai import OpenAI
    hf = tiny_models.build_qwen3_embedding(str(tmp_path / "qwen3-embedding"), pooling=pooling, seed=13)
    path = convert_with_llama_cpp(hf, os.path.join(tmp_path, "emb.gguf"))
    with peer.LlamaCppPeer(path, n_threads=2, n_ctx=512, embedding=True) as p:
        theirs = p.embed(TEXTS)
    with LiveServer(path, ctx=512) as s:
        r = OpenAI(base_url=s.url + "/v1", api_key="none").embeddings.create(model="any", input=TEXTS)
        ours = np.array([d.embedding for d in r.data])
    assert r.usage.prompt_tokens == theirs["tokens"]  # the same tokens (llama.cpp appends the EOS too)
    c = cosine(ours, np.array(theirs["vectors"]))
    assert np.all(c > 1 - 1e-5), c
