"""Embeddings, rerank and llama-server utility requests/responses, sans I/O, byte for byte."""
from __future__ import annotations

import base64
import json
import struct

import pytest

from appliance.protocol import embeddings as emb, llama_utils as utils, rerank
from appliance.protocol.errors import ApiError, error_body
from appliance.protocol.sse import json_bytes


def body(obj) -> bytes:
    return json.dumps(obj).encode()


def err(fn, obj) -> bytes:
    with pytest.raises(ApiError) as e:
        fn(body(obj) if not isinstance(obj, bytes) else obj)
    assert e.value.status == 400
    return error_body(e.value)


def test_openai_input_shapes():
    p = emb.parse_openai_embeddings
    assert p(body({"input": "hi"})) == emb.EmbeddingsQuery(("hi",))
    assert p(body({"input": ["a", "b"], "model": "x", "user": "u"})).inputs == ("a", "b")
    assert p(body({"input": [1, 2, 3]})).inputs == ((1, 2, 3),)
    assert p(body({"input": [[1, 2], [3]], "encoding_format": "base64", "dimensions": 8})) == \
        emb.EmbeddingsQuery(((1, 2), (3,)), "base64", 8)
    assert p(body({"input": "x", "encoding_format": None, "dimensions": None})) == emb.EmbeddingsQuery(("x",))


def test_openai_input_errors_byte_for_byte():
    p = emb.parse_openai_embeddings
    assert err(p, {}) == (b'{"error":{"message":"Missing required parameter: \'input\'.","type":"invalid_request_error",'
                          b'"param":"input","code":"missing_required_parameter"}}')
    assert err(p, {"input": []}) == (b'{"error":{"message":"Invalid \'input\': the list is empty; send at least one '
                                     b'input.","type":"invalid_request_error","param":"input","code":"invalid_value"}}')
    assert b"10000 inputs; at most 2048" in err(p, {"input": ["x"] * 10_000})
    assert b"2049 inputs" in err(p, {"input": [[1]] * 2049})
    assert err(p, {"input": 5}) == (b'{"error":{"message":"Invalid type for \'input\': expected a string or an array of '
                                    b'strings, but got an integer instead.","type":"invalid_request_error","param":'
                                    b'"input","code":"invalid_type"}}')
    assert b"Invalid type for 'input[1]': expected a string, but got an integer instead." in err(p, {"input": ["a", 1]})
    assert b"Invalid type for 'input[0]': expected a string, but got an array" in err(p, {"input": [[1], "a"]})
    assert b"Invalid 'input[0]': the string is empty." in err(p, {"input": ""})
    assert b"Invalid 'input[0]': the token list is empty." in err(p, {"input": [[]]})
    assert b"Invalid 'input[1]': a token id is a non-negative integer, got -1." in err(p, {"input": [3, -1]})
    assert b"got a boolean" in err(p, {"input": [[1, True]]})
    assert b"'encoding_format': 'int8'; expected 'float' or 'base64'" in err(p, {"input": "x", "encoding_format": "int8"})
    assert b'"param":"dimensions"' in err(p, {"input": "x", "dimensions": 0})
    assert b"expected an integer, but got a string" in err(p, {"input": "x", "dimensions": "4"})
    assert b"not valid UTF-8" in err(p, b"\xff")


def test_ollama_shapes():
    q = emb.parse_ollama_embed(body({"model": "m", "input": ["a", "b"], "truncate": False, "dimensions": 3,
                                     "keep_alive": "5m", "options": {"num_ctx": 4}}))
    assert q == emb.EmbeddingsQuery(("a", "b"), "float", 3, truncate=False)
    assert emb.parse_ollama_embed(body({"input": "a"})).truncate is True
    assert err(emb.parse_ollama_embed, {"input": []}).startswith(b'{"error":{"message":"Invalid \'input\': the list is')
    assert b"expected a boolean" in err(emb.parse_ollama_embed, {"input": "a", "truncate": "no"})
    assert emb.parse_ollama_embeddings(body({"model": "m", "prompt": "hi"})) == \
        emb.EmbeddingsQuery(("hi",), truncate=True, param="prompt")
    assert emb.parse_ollama_embeddings(body({"prompt": ""})).inputs == ()
    assert b'"param":"prompt"' in err(emb.parse_ollama_embeddings, {"input": "a"})


def test_vectors_dimensions_and_base64():
    v = [0.6, 0.8, 0.0, 0.0]
    assert emb.shape_vector(v, None, True) == v and emb.shape_vector(v, 10, True) == v
    assert emb.shape_vector([3.0, 4.0, 12.0], 2, True) == [0.6, 0.8]
    assert emb.shape_vector([3.0, 4.0, 12.0], 2, False) == [3.0, 4.0]
    assert emb.shape_vector([0.0, 0.0, 1.0], 2, True) == [0.0, 0.0]
    assert emb.encode_base64([1.0, -2.5]) == base64.b64encode(struct.pack("<2f", 1.0, -2.5)).decode()
    q = emb.EmbeddingsQuery(("a", "b"), "base64")
    got = json_bytes(emb.openai_response("m", [[1.0, 0.0], [0.5, 0.25]], 7, q, True))
    assert got == (b'{"object":"list","data":[{"object":"embedding","index":0,"embedding":"AACAPwAAAAA="},'
                   b'{"object":"embedding","index":1,"embedding":"AAAAPwAAgD4="}],"model":"m","usage":'
                   b'{"prompt_tokens":7,"total_tokens":7}}')
    assert json_bytes(emb.openai_response("m", [[1.0, 0.0]], 2, emb.EmbeddingsQuery(("a",)), True)) == \
        (b'{"object":"list","data":[{"object":"embedding","index":0,"embedding":[1.0,0.0]}],"model":"m",'
         b'"usage":{"prompt_tokens":2,"total_tokens":2}}')
    assert json_bytes(emb.ollama_embed_response("m", [[3.0, 4.0, 1.0]], 5, emb.EmbeddingsQuery(("a",), dimensions=2),
                                                True, 1500, 20)) == \
        b'{"model":"m","embeddings":[[0.6,0.8]],"total_duration":1500,"load_duration":20,"prompt_eval_count":5}'
    assert emb.ollama_embeddings_response([]) == {"embedding": []}
    assert emb.ollama_embeddings_response([[0.5]]) == {"embedding": [0.5]}


def test_rerank_request_and_response():
    q = rerank.parse_rerank(body({"model": "m", "query": "q", "documents": ["a", {"text": "b"}], "top_n": 5,
                                  "return_documents": True, "instruct": "Find code"}))
    assert q == rerank.RerankQuery("q", ("a", "b"), 5, True, "Find code")
    assert rerank.parse_rerank(body({"query": "q", "documents": ["a"]})).instruction == rerank.DEFAULT_INSTRUCTION
    for bad, part in [({"documents": ["a"]}, b"Missing required parameter: 'query'."),
                      ({"query": "q", "documents": []}, b"the list is empty; send at least one document"),
                      ({"query": "q", "documents": ["a"] * 1001}, b"1001 documents; at most 1000"),
                      ({"query": "q", "documents": [{"txt": "a"}]}, b"'documents[0]': expected a string or an object"),
                      ({"query": "q", "documents": ["a"], "top_n": 0}, b"'top_n': 0 is less than the minimum of 1."),
                      ({"query": 1, "documents": ["a"]}, b"Invalid type for 'query': expected a string"),
                      ({"query": "q", "documents": ["a"], "return_documents": 1}, b"expected a boolean")]:
        assert part in err(rerank.parse_rerank, bad), bad
    assert rerank.pair_text("I", "Q", "D") == "<Instruct>: I\n<Query>: Q\n<Document>: D"
    assert rerank.PREFIX.endswith('"yes" or "no".<|im_end|>\n<|im_start|>user\n')
    assert rerank.SUFFIX == "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    q = rerank.RerankQuery("q", ("a", "b", "c", "d"), top_n=3, return_documents=True)
    assert json_bytes(rerank.rerank_response("m", q, [0.25, 0.75, 0.25, 0.5], 40)) == (
        b'{"model":"m","object":"list","usage":{"prompt_tokens":40,"total_tokens":40},"results":['
        b'{"index":1,"relevance_score":0.75,"document":{"text":"b"}},'
        b'{"index":3,"relevance_score":0.5,"document":{"text":"d"}},'
        b'{"index":0,"relevance_score":0.25,"document":{"text":"a"}}]}')
    plain = rerank.rerank_response("m", rerank.RerankQuery("q", ("a", "b")), [0.1, 0.1], 3)
    assert plain["results"] == [{"index": 0, "relevance_score": 0.1}, {"index": 1, "relevance_score": 0.1}]


def test_llama_utilities():
    assert utils.parse_tokenize(body({"content": "hi"})) == utils.TokenizeQuery("hi")
    assert utils.parse_tokenize(body({"content": "hi", "add_special": True, "with_pieces": True,
                                      "parse_special": True})) == utils.TokenizeQuery("hi", True, True)
    assert b"'parse_special': false is not supported" in err(utils.parse_tokenize, {"content": "x",
                                                                                    "parse_special": False})
    assert b"Missing required parameter: 'content'." in err(utils.parse_tokenize, {})
    assert json_bytes(utils.tokenize_response([1, 2], None)) == b'{"tokens":[1,2]}'
    assert json_bytes(utils.tokenize_response([5, 6, 7], [b"Hi", b"\xc3", "é".encode()])) == \
        '{"tokens":[{"id":5,"piece":"Hi"},{"id":6,"piece":[195]},{"id":7,"piece":"é"}]}'.encode()
    assert utils.parse_detokenize(body({"tokens": [1, 0]})) == [1, 0]
    assert b"Invalid 'tokens[1]': a token id is a non-negative integer, got a string." in \
        err(utils.parse_detokenize, {"tokens": [1, "a"]})
    assert b"expected an array" in err(utils.parse_detokenize, {"tokens": 3})
    assert json_bytes(utils.detokenize_response("a b")) == b'{"content":"a b"}'
    assert json_bytes(utils.apply_template_response("<|im_start|>")) == b'{"prompt":"<|im_start|>"}'
