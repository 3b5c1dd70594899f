"""Embedding and reranking jobs on the engine thread: a decoder run to its final norm, then pooled (embedding
models: Qwen3-Embedding, GGUF `pooling_type` LAST/MEAN/CLS) or scored by two logits (Qwen3-Reranker).

Policies:
- What a model is for is decided at load (load/: `ModelTask`, from the checkpoint's own keys or the CLI's
  --embedding / --reranking); a job only carries token ids.
- Inputs run one after another through the engine's one sequence slot: the KV cache and the C decoder hold a
  single sequence, so several inputs in one multi-sequence prefill (a block-diagonal mask) would need a new
  kernel; what is cheap instead is prefix reuse. With last-token pooling (and for the reranker, whose prompts
  share the system text and the query) each input keeps the longest prefix it shares with the previous one
  (Engine.begin_sequence) and prefills only the rest: the last position's state is exact either way.
  Mean and first-token pooling need every position's state, so they start from an empty sequence.
- A sequence is prefilled in the engine's chunks; `should_cancel` is polled before each chunk, so a client that
  leaves stops the job within one chunk, and the whole chunks done stay reusable.
- Pooled vectors are L2-normalised when the model says so (sentence-transformers' Normalize module; llama.cpp
  normalises every pooled embedding); a reranker's score is softmax over its ("no", "yes") logits at the last
  position, the probability of "yes" (the Qwen3-Reranker model card's recipe).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

from .generate import Timings

POOLINGS = ("last", "mean", "cls")


@dataclass(frozen=True)
class ModelTask:
    """What a non-generative model serves. kind: 'embedding' (pooled, maybe normalised vectors) or 'rerank'
    (yes/no scores). `affixes`: ids the tokenizer's post-processor puts around an input (Qwen3-Embedding's
    tokenizer appends <|endoftext|>); `yes_no`: the reranker's two token ids."""
    kind: str
    pooling: str = "last"
    normalize: bool = True
    affixes: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())
    yes_no: tuple[int, int] | None = None
    head: object = None  # a GGUF reranker's classifier rows (2, hidden): "yes", "no" (llama.cpp's cls.output)
    source: str = ""  # where the kind was read from (for the start-up log)

    @property
    def description(self) -> str:
        if self.kind == "rerank":
            return "a reranker (yes/no scores)"
        return f"an embedding model ({self.pooling}-token pooling{', normalised' if self.normalize else ''})"


@dataclass(frozen=True)
class EmbeddingJob:
    """Sequences (token ids, each non-empty and within the context) to embed or score, in order."""
    sequences: tuple[tuple[int, ...], ...]
    task: ModelTask

    @property
    def prompt_ids(self) -> list[int]:  # the worker's JobTrace counts these
        return [t for s in self.sequences for t in s]

    def run(self, engine, should_cancel: Callable[[], bool]) -> Iterator["EmbeddingResult"]:
        yield run_job(engine, self, should_cancel)


@dataclass
class EmbeddingResult:
    """The job's end (the worker treats it like a FinishEvent: reason, prompt_tokens, timings)."""
    reason: str  # 'stop' | 'cancelled'
    vectors: list[np.ndarray]  # embedding: (hidden,) float32 each; rerank: empty
    scores: list[float]  # rerank: P(yes) per sequence; embedding: empty
    prompt_tokens: int
    timings: Timings = field(default_factory=Timings)
    completion_tokens: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)


def pool(h: np.ndarray, mode: str) -> np.ndarray:
    """One sequence's final-normed hidden states (T, hidden) -> (hidden,)."""
    if mode == "last":
        return h[-1]
    if mode == "cls":
        return h[0]
    if mode == "mean":
        return h.mean(axis=0, dtype=np.float64).astype(np.float32)
    raise ValueError(f"unknown pooling {mode!r}")


def l2_normalize(v: np.ndarray) -> np.ndarray:
    n = float(np.sqrt(np.dot(v.astype(np.float64), v.astype(np.float64))))
    return (v / n).astype(np.float32) if n > 0 else v.astype(np.float32)


def yes_probability(yes_logit: float, no_logit: float) -> float:
    """softmax over (no, yes), the yes share, computed stably in float64."""
    m = max(yes_logit, no_logit)
    ey, en = np.exp(np.float64(yes_logit) - m), np.exp(np.float64(no_logit) - m)
    return float(ey / (ey + en))


def _prefill(engine, ids: list[int], start: int, mode: str, should_cancel: Callable[[], bool],
             timings: Timings) -> np.ndarray | None:
    """ids[start:] appended in chunks. mode 'hidden': every new position's states (T_new, hidden);
    'last': the last position's logits (vocab,). None when cancelled between chunks."""
    parts, out = [], None
    for s in range(start, len(ids), engine.prefill_chunk):
        if should_cancel():
            return None
        chunk = list(ids[s:s + engine.prefill_chunk])
        last = s + len(chunk) >= len(ids)
        if mode == "hidden":
            parts.append(engine._forward(chunk, "hidden"))  # (T_chunk, hidden)
        else:
            out = engine._forward(chunk, "last" if last else "none")
        engine.prefill_chunks_run += 1
        timings.prefill_chunks += 1
    return np.concatenate(parts, axis=0) if mode == "hidden" else out


def run_job(engine, job: EmbeddingJob, should_cancel: Callable[[], bool]) -> EmbeddingResult:
    t0 = time.perf_counter()
    task = job.task
    timings = Timings()
    vectors: list[np.ndarray] = []
    scores: list[float] = []
    n_prompt = sum(len(s) for s in job.sequences)

    def finish(reason: str) -> EmbeddingResult:
        timings.total_ms = timings.prefill_ms = (time.perf_counter() - t0) * 1000.0
        engine.store.shrink(reserve=len(engine.cache_tokens) * engine.cache.bytes_per_token)
        return EmbeddingResult(reason, vectors, scores, n_prompt, timings)

    try:
        for seq in job.sequences:
            ids = list(seq)
            engine.check_fits(len(ids))
            whole = task.kind == "embedding" and task.pooling != "last"
            if whole:  # every position's state is needed: nothing reused
                if engine.disk is not None:
                    engine.disk.before_overwrite(0)
                engine.drop_sequence()
                start = 0
            else:
                start = engine.begin_sequence(ids, ())
                timings.cache_n += start
            if task.kind == "rerank" and task.head is not None:  # a classifier head over the last state
                h = _prefill(engine, ids, start, "hidden", should_cancel, timings)  # (T_new, hidden)
                if h is None:
                    return finish("cancelled")
                yes_no = np.asarray(task.head, dtype=np.float32) @ h[-1]  # (2,): "yes", "no"
                scores.append(yes_probability(float(yes_no[0]), float(yes_no[1])))
                continue
            if task.kind == "rerank":
                logits = _prefill(engine, ids, start, "last", should_cancel, timings)  # (vocab,)
                if logits is None:
                    return finish("cancelled")
                assert task.yes_no is not None  # a rerank task always has them (load.model_task)
                yes, no = task.yes_no
                scores.append(yes_probability(float(logits[yes]), float(logits[no])))
                continue
            h = _prefill(engine, ids, start, "hidden", should_cancel, timings)  # (T_new, hidden)
            if h is None:
                return finish("cancelled")
            v = pool(h, task.pooling)  # (hidden,)
            vectors.append(l2_normalize(v) if task.normalize else v.astype(np.float32))
    except Exception:
        engine.drop_sequence()  # keys/values of a failed step are not trusted
        raise
    return finish("stop")
