"""Rerank requests and responses, sans I/O: POST /v1/rerank (also /rerank, /v1/reranking, /reranking, as
llama-server routes them), the llama-server / Jina / Cohere shape.

Policies:
- `query` a non-empty string; `documents` a non-empty list (at most MAX_DOCUMENTS) of strings or of
  `{"text": ...}` objects (Cohere's older form); `top_n` a positive integer (more than there are documents means
  all); `return_documents` (default false) puts `document: {"text": ...}` in each result; `instruction` (also
  `instruct`) replaces the model card's default task instruction.
- A pair is scored on the Qwen3-Reranker model card's prompt: PREFIX, then "<Instruct>: ...\\n<Query>: ...\\n
  <Document>: ...", then SUFFIX, the three tokenized separately and joined, as the card's recipe does.
- Results are sorted by relevance_score, highest first; equal scores keep the documents' order (stable).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from appliance.protocol.fields import check_type, get, invalid, json_kind, load_json_object

MAX_DOCUMENTS = 1000
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
          "Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


@dataclass(frozen=True)
class RerankQuery:
    query: str
    documents: tuple[str, ...]
    top_n: int | None = None
    return_documents: bool = False
    instruction: str = DEFAULT_INSTRUCTION


def _document(d: Any, i: int) -> str:
    if isinstance(d, dict) and isinstance(d.get("text"), str):
        return d["text"]
    if not isinstance(d, str):
        raise invalid("documents", f"Invalid type for 'documents[{i}]': expected a string or an object with "
                                   f"'text', but got {json_kind(d)} instead.", "invalid_type")
    return d


def parse_rerank(body: bytes) -> RerankQuery:
    data = load_json_object(body)
    query = data.get("query")
    if query is None:
        raise invalid("query", "Missing required parameter: 'query'.", "missing_required_parameter")
    check_type(query, "string", "query")
    if not query:
        raise invalid("query", "Invalid 'query': the string is empty.", "invalid_value")
    docs = data.get("documents")
    if docs is None:
        raise invalid("documents", "Missing required parameter: 'documents'.", "missing_required_parameter")
    check_type(docs, "array", "documents")
    if not docs:
        raise invalid("documents", "Invalid 'documents': the list is empty; send at least one document.",
                      "invalid_value")
    if len(docs) > MAX_DOCUMENTS:
        raise invalid("documents", f"Invalid 'documents': {len(docs)} documents; at most {MAX_DOCUMENTS} are "
                                   f"allowed in one request.", "invalid_value")
    documents = tuple(_document(d, i) for i, d in enumerate(docs))
    top_n = get(data, "top_n", "integer")
    if top_n is not None and top_n < 1:
        raise invalid("top_n", f"Invalid 'top_n': {top_n} is less than the minimum of 1.", "invalid_value")
    ret = get(data, "return_documents", "boolean", default=False)
    instruction = get(data, "instruction", "string") or get(data, "instruct", "string") or DEFAULT_INSTRUCTION
    return RerankQuery(query, documents, top_n, ret, instruction)


def pair_text(instruction: str, query: str, document: str) -> str:
    """The user part of the model card's prompt for one (query, document) pair."""
    return f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"


def rerank_response(model: str, q: RerankQuery, scores: Sequence[float], prompt_tokens: int) -> dict[str, Any]:
    order = sorted(range(len(scores)), key=lambda i: -scores[i])  # sorted() is stable: ties keep their order
    if q.top_n is not None:
        order = order[:q.top_n]
    results = []
    for i in order:
        r: dict[str, Any] = {"index": i, "relevance_score": float(scores[i])}
        if q.return_documents:
            r["document"] = {"text": q.documents[i]}
        results.append(r)
    return {"model": model, "object": "list", "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
            "results": results}
