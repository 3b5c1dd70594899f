"""Embeddings, rerank and llama-server's utilities: POST /v1/embeddings (also /embeddings), Ollama's /api/embed
and /api/embeddings, /v1/rerank (/rerank, /v1/reranking, /reranking), /tokenize, /detokenize, /apply-template.
Parsing and response shapes live in protocol/ (embeddings.py, rerank.py, llama_utils.py); the engine side in
engine/embedding.py.

Policies:
- What the served model is for was decided at load (LoadedModel.task). An embeddings request to a generative
  model, or a rerank request to anything but a reranker, is a 400 naming the model's kind (llama-server answers
  these with 501 "start it with --embeddings"; a 4xx in the API's own shape is what clients report properly);
  the chat APIs refuse an embedding model or a reranker the same way (generation.run_ticket). The utilities
  serve every model.
- An embedding or rerank request is one job in the same FIFO queue as generations (429 past it, 503 while
  loading or shutting down); its inputs run one after another in that job (engine/embedding.py: no
  multi-sequence prefill, prefix reuse between inputs instead). A client that disconnects cancels the job
  within one prefill chunk (leaving the Ticket sets its cancel flag).
- Tokenizing, checking and building the response (tens of thousands of floats) run in the preparation threads
  (Preparer.prepare), never on the event loop. Every input must fit the context (< context length tokens), or
  it is a 400 naming it; Ollama's `truncate` (default true) cuts it to fit instead.
- String inputs get the tokenizer's post-processor tokens (Qwen3-Embedding's trailing <|endoftext|>), as
  sentence-transformers and llama.cpp add them; token-id inputs are taken as they are.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Callable

from ..engine.embedding import EmbeddingJob, EmbeddingResult
from ..engine.kv_cache import ContextLengthError
from ..engine.token_bounds import TooManyTokens
from ..h11_server import Exchange
from ..protocol import embeddings as emb, llama_utils as utils, rerank
from ..protocol.errors import ApiError, internal_error, server_shutdown, wrong_model_kind
from ..protocol.requests import parse_chat_request
from .config import Routes
from .preparer import Preparer
from .worker import EngineFailure, ShuttingDown

if TYPE_CHECKING:
    from ..engine.load import LoadedModel

log = logging.getLogger("appliance.embeddings")


def wrong_kind(loaded: LoadedModel, name: str, wanted: str) -> ApiError:
    return wrong_model_kind(loaded.kind, name, wanted)


class EmbeddingsApi:
    def __init__(self, prep: Preparer):
        self.prep = prep

    def routes(self) -> Routes:
        r: Routes = {"/v1/embeddings": {"POST": self.openai}, "/embeddings": {"POST": self.openai},
                     "/api/embed": {"POST": self.ollama_embed}, "/api/embeddings": {"POST": self.ollama_embeddings},
                     "/tokenize": {"POST": self.tokenize}, "/detokenize": {"POST": self.detokenize},
                     "/apply-template": {"POST": self.apply_template}}
        for path in ("/v1/rerank", "/rerank", "/v1/reranking", "/reranking"):
            r[path] = {"POST": self.rerank}
        return r

    # ---- the job ---------------------------------------------------------------------------------------
    async def _run(self, ex: Exchange, job: EmbeddingJob) -> tuple[EmbeddingResult, float]:
        """The job through the queue and the engine: its result and the time it waited (ms)."""
        t_arrival = time.perf_counter()
        ex.notes["prompt_tokens"] = sum(len(s) for s in job.sequences)
        ticket = self.prep.admit()
        result: Any = None
        async with ticket:
            try:
                await ticket.wait_turn()
            except ShuttingDown:
                raise server_shutdown() from None
            async for ev in ticket.start(job):
                result = ev
            ticket.finished()
        queue_ms = ex.notes["queue_ms"] = ((ticket.trace.started if ticket.trace else t_arrival) - t_arrival) * 1e3
        if isinstance(result, EngineFailure):
            if isinstance(result.error, ContextLengthError):
                raise ApiError(400, str(result.error), param="input", code="context_length_exceeded")
            log.error("embedding job failed: %r", result.error, exc_info=result.error)
            raise internal_error()
        if not isinstance(result, EmbeddingResult) or result.reason != "stop":
            raise internal_error()
        ex.notes["finish"] = "stop"
        return result, queue_ms

    def _sequences(self, loaded: LoadedModel, q: emb.EmbeddingsQuery) -> tuple[tuple[int, ...], ...]:
        """Worker thread: the query's inputs as token ids that fit the context."""
        prep, ctx = self.prep, loaded.context_length
        tok: Any = loaded.tokenizer
        assert loaded.task is not None  # an embedding model (checked by the caller)
        head, tail = loaded.task.affixes
        room = ctx - 1 - len(head) - len(tail)  # the engine needs len < context
        out = []
        for i, item in enumerate(q.inputs):
            where = f"{q.param}[{i}]" if len(q.inputs) > 1 or q.param == "input" else q.param
            if isinstance(item, tuple):
                try:
                    ids = prep.check_token_ids(loaded, item, where)
                except ApiError as e:  # param: the field, as for every other input error
                    raise ApiError(400, e.message, param=q.param, code=e.code) from None
            elif q.truncate:
                ids = list(head) + tok.encode(item)[:room] + list(tail)
            else:
                try:
                    ids = list(head) + tok.encode_within(item, room + 1) + list(tail)
                except TooManyTokens as e:
                    raise self._too_long(where, e.at_least + len(head) + len(tail), ctx, True) from None
            if len(ids) >= ctx:
                raise self._too_long(where, len(ids), ctx, False)
            out.append(tuple(ids))
        return tuple(out)

    @staticmethod
    def _too_long(where: str, n: int, ctx: int, at_least: bool) -> ApiError:
        return ApiError(400, f"Invalid '{where}': it has {'at least ' if at_least else ''}{n} tokens; this model's "
                             f"maximum context length is {ctx} tokens.", param=where.partition("[")[0],
                        code="context_length_exceeded")

    async def _embed(self, ex: Exchange, parse: Callable[[bytes], emb.EmbeddingsQuery]):
        prep = self.prep
        loaded = prep.loaded()
        body = await ex.read_body()

        def prepare():
            q = parse(body)
            if loaded.kind != "embedding":
                raise wrong_kind(loaded, prep.model_name, "embedding")
            return q, self._sequences(loaded, q)
        q, seqs = await prep.prepare(prepare)
        if not seqs or loaded.task is None:
            return q, loaded, None, 0.0, 0.0
        t0 = time.perf_counter()
        result, queue_ms = await self._run(ex, EmbeddingJob(seqs, loaded.task))
        return q, loaded, result, queue_ms, (time.perf_counter() - t0) * 1e3

    # ---- embeddings ------------------------------------------------------------------------------------
    async def openai(self, ex: Exchange) -> None:
        q, loaded, result, _, _ = await self._embed(ex, emb.parse_openai_embeddings)
        renorm = loaded.task is not None and loaded.task.normalize
        body = await self.prep.prepare(lambda: emb.openai_response(
            self.prep.model_name, [v.tolist() for v in result.vectors], result.prompt_tokens, q, renorm))
        await self.prep.send_json(ex, body)

    async def ollama_embed(self, ex: Exchange) -> None:
        q, loaded, result, queue_ms, total_ms = await self._embed(ex, emb.parse_ollama_embed)
        renorm = loaded.task is not None and loaded.task.normalize
        body = await self.prep.prepare(lambda: emb.ollama_embed_response(
            self.prep.model_name, [v.tolist() for v in result.vectors], result.prompt_tokens, q, renorm,
            int(total_ms * 1e6), int(queue_ms * 1e6)))
        await self.prep.send_json(ex, body)

    async def ollama_embeddings(self, ex: Exchange) -> None:
        _, _, result, _, _ = await self._embed(ex, emb.parse_ollama_embeddings)
        vectors = [v.tolist() for v in result.vectors] if result is not None else []
        await self.prep.send_json(ex, emb.ollama_embeddings_response(vectors))

    # ---- rerank ----------------------------------------------------------------------------------------
    async def rerank(self, ex: Exchange) -> None:
        prep = self.prep
        loaded = prep.loaded()
        body = await ex.read_body()

        def prepare():
            q = rerank.parse_rerank(body)
            if loaded.kind != "rerank":
                raise wrong_kind(loaded, prep.model_name, "rerank")
            tok: Any = loaded.tokenizer
            ctx = loaded.context_length
            head, tail = tok.encode(rerank.PREFIX), tok.encode(rerank.SUFFIX)
            room = ctx - 1 - len(head) - len(tail)
            seqs = []
            for i, doc in enumerate(q.documents):
                try:
                    pair = tok.encode_within(rerank.pair_text(q.instruction, q.query, doc), room + 1)
                except TooManyTokens as e:
                    raise ApiError(400, f"Invalid 'documents[{i}]': with the query it has at least "
                                        f"{e.at_least + len(head) + len(tail)} tokens; this model's maximum context "
                                        f"length is {ctx} tokens.", param="documents",
                                   code="context_length_exceeded") from None
                seqs.append(tuple(head + pair + tail))
            return q, tuple(seqs)
        q, seqs = await prep.prepare(prepare)
        assert loaded.task is not None  # a reranker (checked in prepare)
        result, _ = await self._run(ex, EmbeddingJob(seqs, loaded.task))
        await prep.send_json(ex, rerank.rerank_response(prep.model_name, q, result.scores, result.prompt_tokens))

    # ---- llama-server's utilities ----------------------------------------------------------------------
    async def tokenize(self, ex: Exchange) -> None:
        prep = self.prep
        loaded = prep.loaded()
        body = await ex.read_body()

        def work():
            q = utils.parse_tokenize(body)
            tok = loaded.tokenizer
            ids = tok.encode(q.content, add_special_tokens=q.add_special)
            pieces = [tok.token_bytes(i, skip_special_tokens=False) for i in ids] if q.with_pieces else None
            return utils.tokenize_response(ids, pieces)
        await prep.send_json(ex, await prep.prepare(work))

    async def detokenize(self, ex: Exchange) -> None:
        prep = self.prep
        loaded = prep.loaded()
        body = await ex.read_body()

        def work():
            ids = prep.check_token_ids(loaded, utils.parse_detokenize(body), "tokens")
            return utils.detokenize_response(loaded.tokenizer.decode(ids, skip_special_tokens=False))
        await prep.send_json(ex, await prep.prepare(work))

    async def apply_template(self, ex: Exchange) -> None:
        prep = self.prep
        loaded = prep.loaded()
        body = await ex.read_body()

        def work():
            req = parse_chat_request(body, defaults=loaded.default_sampling, context_length=loaded.context_length,
                                     images_supported=loaded.multimodal, stream_extensions=False)
            req = prep.fit_tools(loaded, req)
            try:
                prompt = loaded.chat_template.render(req.messages, tools=req.tools, add_generation_prompt=True,
                                                     **req.template_kwargs)
            except ValueError as e:  # ChatTemplateError: the template refused these messages
                raise ApiError(400, str(e), param="messages", code="invalid_messages") from None
            return utils.apply_template_response(prompt)
        await prep.send_json(ex, await prep.prepare(work))
