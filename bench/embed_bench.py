"""Embeddings throughput: inputs/s and tokens/s for a batch of 32 short texts and one of 4 long ones, ours (the
engine's embedding job, no HTTP) against llama.cpp's embedding mode (llama-cpp-python, same GGUF, same threads,
one text per decode as llama-server's single slot runs them), in one run.

The file: a Qwen3-Embedding-0.6B-shaped random model (hidden 1024, 16 heads / 8 KV heads of 128, MLP 3072) with
`--layers` layers (default 4 of the real 28: same per-layer work, a shorter run), written by transformers and
converted by llama.cpp's own convert_hf_to_gguf.py (Q8_0 by default), or `--model PATH.gguf`.

    python bench/embed_bench.py [--threads 2] [--layers 4] [--outtype q8_0] [--model PATH.gguf]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
import peer  # noqa: E402

from appliance.engine.embedding import EmbeddingJob, run_job  # noqa: E402
from appliance.engine.load import load_model, set_native_threads  # noqa: E402

WORDS = ("the board reads the manual and answers questions about the machine in the kitchen while the shop "
         "catalogue lists parts prices and the house keeps its notes").split()


def texts(n: int, words: int, seed: int) -> list[str]:
    out = []
    for i in range(n):
        out.append(" ".join(WORDS[(seed + i * 7 + j * 3) % len(WORDS)] for j in range(words)) + f" #{i}")
    return out


def make_file(tmp: str, layers: int, outtype: str) -> str:
    from tests.support import tiny_models
    from tests.support.gguf_files import convert_with_llama_cpp
    hf = tiny_models.build_qwen3_embedding(os.path.join(tmp, "qwen3-embedding"), hidden=1024, layers=layers,
                                           heads=16, kv_heads=8, head_dim=128, intermediate=3072, seed=1)
    return convert_with_llama_cpp(hf, os.path.join(tmp, f"emb-{outtype}.gguf"), outtype)


def ours(path: str, batch: list[str], runs: int) -> dict:
    lm = load_model(path, context_length=2048)
    head, tail = lm.task.affixes
    seqs = tuple(tuple(list(head) + lm.tokenizer.encode(t) + list(tail)) for t in batch)
    run_job(lm.engine, EmbeddingJob(seqs[:1], lm.task), lambda: False)  # warm-up: pages in the weights
    best = None
    for _ in range(runs):
        lm.engine.drop_sequence()  # no reuse of the previous run's last input
        t0 = time.perf_counter()
        res = run_job(lm.engine, EmbeddingJob(seqs, lm.task), lambda: False)
        dt = time.perf_counter() - t0
        best = dt if best is None else min(best, dt)
    return {"seconds": best, "tokens": res.prompt_tokens}


def theirs(path: str, batch: list[str], runs: int, threads: int) -> dict:
    with peer.LlamaCppPeer(path, n_threads=threads, n_ctx=2048, embedding=True) as p:
        p.embed(batch[:1])
        results = [p.embed(batch) for _ in range(runs)]
    best = min(results, key=lambda r: r["seconds"])
    return {"seconds": best["seconds"], "tokens": best["tokens"]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--outtype", default="q8_0")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--model")
    a = ap.parse_args()
    set_native_threads(a.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = a.model or make_file(tmp, a.layers, a.outtype)
        print(f"file: {os.path.basename(path)}, threads {a.threads}, load {os.getloadavg()[0]:.1f}")
        for name, batch in (("32 short", texts(32, 10, 0)), ("4 long", texts(4, 400, 5))):
            o, t = ours(path, batch, a.runs), theirs(path, batch, a.runs, a.threads)
            print(f"{name:9s} ours {len(batch) / o['seconds']:7.1f} inputs/s {o['tokens'] / o['seconds']:8.0f} tok/s | "
                  f"llama.cpp {len(batch) / t['seconds']:7.1f} inputs/s {t['tokens'] / t['seconds']:8.0f} tok/s | "
                  f"ratio {t['seconds'] / o['seconds']:.2f}x (tokens {o['tokens']} / {t['tokens']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
