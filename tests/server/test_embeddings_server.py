"""Embeddings and rerank over real HTTP with the real clients (openai, ollama, LangChain's OpenAIEmbeddings and
OllamaEmbeddings) on tiny random Qwen3-Embedding / Qwen3-Reranker checkpoints, against transformers' vectors and
the reranker model card's scores; the bad inputs in each API's error shape; queue, 429 and cancel."""
from __future__ import annotations

import json
import threading

import numpy as np
import pytest

from appliance.engine.load import load_model
from tests.engine.test_embedding import DOCS, QUERY, TEXTS, card_scores, cosine, reference_embeddings
from tests.support import tiny_models
from tests.support.live_server import LiveServer, RawClient, request_bytes

CTX = 256


@pytest.fixture(scope="module")
def emb_dir(tmp_path_factory) -> str:
    return tiny_models.build_qwen3_embedding(str(tmp_path_factory.mktemp("qwen3-embedding")))


@pytest.fixture(scope="module")
def ref(emb_dir) -> np.ndarray:
    return reference_embeddings(emb_dir, TEXTS)


@pytest.fixture(scope="module")
def server(emb_dir):
    with LiveServer(emb_dir, ctx=CTX, prefill_chunk=32) as s:
        yield s


def call(server, path: str, body) -> tuple[int, dict]:
    return call_at(server.port, path, body)


def call_at(port: int, path: str, body) -> tuple[int, dict]:
    c = RawClient(port)
    c.send(request_bytes("POST", path, body))
    r = c.read_head()
    raw = c.read_body(r)
    c.close()
    return r.status, json.loads(raw)


def close_to(got, want) -> bool:
    return bool(np.all(cosine(np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)) > 1 - 1e-5))


def test_openai_client_float_and_base64(server, ref):
    from openai import OpenAI
    client = OpenAI(base_url=server.url + "/v1", api_key="none")
    r = client.embeddings.create(model="any", input=TEXTS)  # the client asks for base64 and decodes it
    assert [d.index for d in r.data] == list(range(len(TEXTS))) and r.model == server.api_cfg.model_name
    assert close_to([d.embedding for d in r.data], ref)
    assert r.usage.prompt_tokens == r.usage.total_tokens > len(TEXTS)
    f = client.embeddings.create(model="any", input=TEXTS[0], encoding_format="float")
    assert len(f.data) == 1 and close_to([f.data[0].embedding], ref[:1])
    # Matryoshka: the first 16 components, renormalised
    d = client.embeddings.create(model="any", input=TEXTS[:2], dimensions=16)
    want = ref[:2, :16] / np.linalg.norm(ref[:2, :16], axis=1, keepdims=True)
    got = np.array([e.embedding for e in d.data])
    assert got.shape == (2, 16) and np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6) and close_to(got, want)


def test_token_id_inputs_equal_text_inputs(server, ref, emb_dir):
    from openai import OpenAI
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(emb_dir)
    ids = [tok(t)["input_ids"] for t in TEXTS[:2]]  # with the post-processor's <|endoftext|>
    client = OpenAI(base_url=server.url + "/v1", api_key="none")
    many = client.embeddings.create(model="any", input=ids, encoding_format="float")
    one = client.embeddings.create(model="any", input=ids[0], encoding_format="float")
    assert close_to([e.embedding for e in many.data], ref[:2]) and close_to([one.data[0].embedding], ref[:1])
    assert many.usage.prompt_tokens == sum(len(i) for i in ids)


def test_ollama_client_embed_and_legacy(server, ref):
    import ollama
    client = ollama.Client(host=server.url)
    r = client.embed(model="any", input=TEXTS)
    assert close_to(r.embeddings, ref) and r.prompt_eval_count > len(TEXTS) and r.total_duration > 0
    one = client.embed(model="any", input=TEXTS[1])
    assert len(one.embeddings) == 1 and close_to(one.embeddings, ref[1:2])
    legacy = client.embeddings(model="any", prompt=TEXTS[2])
    assert close_to([legacy.embedding], ref[2:3])
    assert "embedding" in client.show("any").capabilities


def test_langchain_embeddings(server, ref):
    from langchain_ollama import OllamaEmbeddings
    from langchain_openai import OpenAIEmbeddings
    oai = OpenAIEmbeddings(model="any", base_url=server.url + "/v1", api_key="none",
                           check_embedding_ctx_length=False)  # send the texts, not tiktoken's ids
    assert close_to(oai.embed_documents(TEXTS), ref) and close_to([oai.embed_query(TEXTS[3])], ref[3:4])
    oll = OllamaEmbeddings(model="any", base_url=server.url)
    assert close_to(oll.embed_documents(TEXTS), ref) and close_to([oll.embed_query(TEXTS[0])], ref[:1])


def test_bad_input_is_a_400_in_each_api_shape(server):
    cases = [{"input": []}, {"input": ["x"] * 10_000}, {"input": 5}, {"input": ["ok", 3]}, {"input": [[1, 2], "a"]},
             {"input": ""}, {"input": [[]]}, {"input": [-1]}, {"input": "x", "encoding_format": "int8"},
             {"input": "x", "dimensions": 0}, {"input": "x", "dimensions": "8"}, {"input": "word " * 400},
             {"input": [[999_999_999]]}, {}]
    for body in cases:
        status, err = call(server, "/v1/embeddings", {"model": "m", **body})
        assert status == 400 and set(err) == {"error"} and err["error"]["type"] == "invalid_request_error", body
        assert err["error"]["param"] in ("input", "encoding_format", "dimensions"), (body, err)
    over = call(server, "/v1/embeddings", {"input": ["fine", "word " * 400]})[1]["error"]
    assert over["code"] == "context_length_exceeded" and "input[1]" in over["message"]
    for body in ({"input": []}, {"input": ["a", 1]}, {"input": "x", "truncate": "yes"}, {"input": "word " * 400,
                                                                                        "truncate": False}):
        status, err = call(server, "/api/embed", {"model": "m", **body})
        assert status == 400 and set(err) == {"error"} and isinstance(err["error"], str), body
    # Ollama cuts an input to the context by default
    status, ok = call(server, "/api/embed", {"model": "m", "input": "word " * 400})
    assert status == 200 and len(ok["embeddings"]) == 1 and ok["prompt_eval_count"] == CTX - 1
    assert call(server, "/api/embeddings", {"model": "m", "prompt": ""}) == (200, {"embedding": []})
    # what the model does not serve: chat, rerank
    status, err = call(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert status == 400 and "an embedding model" in err["error"]["message"]
    status, err = call(server, "/api/chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert status == 400 and "an embedding model" in err["error"]
    status, err = call(server, "/v1/rerank", {"query": "q", "documents": ["d"]})
    assert status == 400 and "does not serve reranking" in err["error"]["message"]


def test_chat_model_refuses_embeddings(tiny_qwen3_tied):
    with LiveServer(tiny_qwen3_tied, ctx=CTX) as s:
        status, err = call(s, "/v1/embeddings", {"input": "hello"})
        assert status == 400 and err["error"]["code"] == "model_not_supported"
        assert "a text generation model" in err["error"]["message"] and "--embedding" in err["error"]["message"]
        status, err = call(s, "/api/embed", {"model": "m", "input": "hello"})
        assert status == 400 and "a text generation model" in err["error"]


def test_queue_429_and_cancel_on_disconnect(emb_dir):
    """A big batch holds the engine: with --queue 0 the next request is a 429 in each API's shape; the batch's
    client leaving stops it within a prefill chunk."""
    with LiveServer(emb_dir, ctx=CTX, prefill_chunk=8, queue=0) as s:
        big = {"input": [f"text number {i} " * 20 for i in range(400)]}
        c = RawClient(s.port)
        c.send(request_bytes("POST", "/v1/embeddings", big))
        s.wait_for(lambda: s.worker.busy, what="the batch to start")
        status, err = call(s, "/v1/embeddings", {"input": "x"})
        assert status == 429 and err["error"]["code"] == "queue_full"
        status, err = call(s, "/api/embed", {"model": "m", "input": "x"})
        assert status == 429 and isinstance(err["error"], str)
        c.close()
        s.wait_for(lambda: any(t.finish_reason == "cancelled" for t in s.traces()), what="the cancel")
        t = next(t for t in s.traces() if t.finish_reason == "cancelled")
        assert t.cancel_requested and t.polls_after_cancel <= 2
        assert call(s, "/v1/embeddings", {"input": "after"})[0] == 200


# ---- rerank ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def reranker_dir(tmp_path_factory) -> str:
    return tiny_models.build_qwen3(str(tmp_path_factory.mktemp("qwen3-reranker")), seed=11, kv_heads=2)


@pytest.fixture(scope="module")
def rerank_server(reranker_dir):
    with LiveServer(reranker_dir, load=lambda: load_model(reranker_dir, context_length=CTX, task="rerank")) as s:
        yield s


def test_rerank_scores_and_order(rerank_server, reranker_dir):
    ref = card_scores(reranker_dir, QUERY, DOCS)
    status, r = call(rerank_server, "/v1/rerank", {"model": "m", "query": QUERY, "documents": DOCS})
    assert status == 200 and r["object"] == "list" and r["usage"]["prompt_tokens"] > 0
    got = {x["index"]: x["relevance_score"] for x in r["results"]}
    assert np.allclose([got[i] for i in range(len(DOCS))], ref, atol=1e-5, rtol=0)
    assert [x["index"] for x in r["results"]] == sorted(range(len(DOCS)), key=lambda i: -ref[i])
    assert all("document" not in x for x in r["results"])
    for path in ("/rerank", "/v1/reranking", "/reranking"):
        status, again = call(rerank_server, path, {"query": QUERY, "documents": [{"text": d} for d in DOCS],
                                                   "top_n": 2, "return_documents": True})
        assert status == 200 and [x["index"] for x in again["results"]] == [x["index"] for x in r["results"][:2]]
        assert [x["document"]["text"] for x in again["results"]] == [DOCS[x["index"]] for x in again["results"]]
    # equal documents: equal scores, kept in their order
    status, ties = call(rerank_server, "/v1/rerank", {"query": QUERY, "documents": ["same", DOCS[0], "same"]})
    order = [x["index"] for x in ties["results"]]
    assert order.index(0) < order.index(2)


def test_rerank_bad_input(rerank_server):
    cases = [{"documents": ["d"]}, {"query": "q"}, {"query": "q", "documents": []}, {"query": "", "documents": ["d"]},
             {"query": "q", "documents": [1]}, {"query": "q", "documents": "d"}, {"query": "q", "documents": ["d"] * 1001},
             {"query": "q", "documents": ["d"], "top_n": 0}, {"query": ["q"], "documents": ["d"]}]
    for body in cases:
        status, err = call(rerank_server, "/v1/rerank", body)
        assert status == 400 and set(err) == {"error"} and err["error"]["param"] in ("query", "documents", "top_n")
    status, err = call(rerank_server, "/v1/rerank", {"query": "q", "documents": ["short", "word " * 400]})
    assert status == 400 and err["error"]["code"] == "context_length_exceeded" and "documents[1]" in err["error"]["message"]
    status, err = call(rerank_server, "/v1/embeddings", {"input": "x"})
    assert status == 400 and "a reranker" in err["error"]["message"]


# ---- llama-server's utilities ------------------------------------------------------------------------------

def test_tokenize_detokenize_apply_template(server, emb_dir, tiny_qwen3_tied):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(emb_dir)
    text = "Hello <|im_start|> wörld é"
    status, r = call(server, "/tokenize", {"content": text})
    assert status == 200 and r["tokens"] == tok(text, add_special_tokens=False)["input_ids"]
    status, r2 = call(server, "/tokenize", {"content": text, "add_special": True, "with_pieces": True})
    assert [t["id"] for t in r2["tokens"]] == r["tokens"] + [151643]
    pieces = [t["piece"] for t in r2["tokens"]]
    joined = b"".join(bytes(p) if isinstance(p, list) else p.encode() for p in pieces)
    assert joined == (text + "<|endoftext|>").encode()
    assert call(server, "/detokenize", {"tokens": r2["tokens"] and [t["id"] for t in r2["tokens"]]}) == \
        (200, {"content": text + "<|endoftext|>"})
    for path, body in (("/tokenize", {}), ("/tokenize", {"content": 3}), ("/tokenize", {"content": "x",
                       "parse_special": False}), ("/detokenize", {"tokens": ["a"]}), ("/detokenize", {"tokens": [10**9]})):
        status, err = call(server, path, body)
        assert status == 400 and set(err) == {"error"}, (path, body)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    with LiveServer(tiny_qwen3_tied, ctx=CTX) as s:
        status, r = call(s, "/apply-template", {"messages": msgs})
        chat_tok = AutoTokenizer.from_pretrained(tiny_qwen3_tied)
        assert status == 200 and r == {"prompt": chat_tok.apply_chat_template(msgs, tokenize=False,
                                                                               add_generation_prompt=True)}
        assert call(s, "/apply-template", {"messages": "x"})[0] == 400


def test_concurrent_clients_share_the_queue(server, ref):
    from openai import OpenAI
    client = OpenAI(base_url=server.url + "/v1", api_key="none")
    out: dict[int, list] = {}

    def run(i):
        out[i] = client.embeddings.create(model="any", input=TEXTS[i]).data[0].embedding
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(TEXTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert close_to([out[i] for i in range(len(TEXTS))], ref)


def test_cli_flags(emb_dir, reranker_dir, tiny_qwen3_tied, cli_server):
    """The executable as a user runs it: an embedding directory serves /v1/embeddings with no flag,
    --pooling overrides its pooling, --reranking makes a causal LM a reranker; misuse is one line, status 1."""
    import subprocess
    import sys

    from openai import OpenAI
    proc, port = cli_server(emb_dir, "--ctx", "256", "--pooling", "mean")
    r = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none").embeddings.create(model="any", input=TEXTS)
    mean_ref = reference_embeddings(emb_dir, TEXTS, "mean")
    assert close_to([d.embedding for d in r.data], mean_ref)
    proc, port = cli_server(reranker_dir, "--ctx", "256", "--reranking")
    status, body = call_at(port, "/v1/rerank", {"query": QUERY, "documents": DOCS})
    assert status == 200 and len(body["results"]) == len(DOCS)
    for args, words in ((["--pooling", "mean"], "--pooling applies to an embedding model"),
                        (["--embedding", "--prompt", "hi"], "--prompt needs a text generation model")):
        q = subprocess.run([sys.executable, "-m", "appliance", "--model", tiny_qwen3_tied, "--ctx", "256", *args],
                           capture_output=True, text=True, timeout=300)
        assert q.returncode == 1 and words in q.stderr and "Traceback" not in q.stderr, q.stderr
