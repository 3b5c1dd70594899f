"""Constrained decoding cost: decode tok/s with a JSON schema vs without, on the same model in the same run.

Models: SmolLM2-135M-Instruct Q4_1 (the real file; its fast decode makes the per-token mask cost show most) and a
Qwen3-1.7B-shaped random model (bench/gguf_bench.py's writer; vocabulary 151,936, so the mask is the widest).

For each model and sampling mode (greedy, and temperature 1.0 with the full filter path), runs without and with
the schema alternate (median of --runs); both decode --decode tokens (the schema is an array of at least 40
objects, so the grammar never completes first; the unconstrained run ignores EOS). Printed per row: both decode
speeds, the overhead per token (1 - constrained / free tok/s), and the grammar's own cost measured apart from the
forward pass: the generated tokens replayed through a fresh constraint, timing mask + accept per token. That figure
does not move with the machine's load; the tok/s ones do (the 1-minute load average is printed per row).

    python bench/constrained_bench.py [--models smollm2,q4_0] [--threads 1] [--runs 3] [--decode 128]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from gguf_bench import bench_file

from appliance.engine.constraint import constraint_for
from appliance.engine.generate import GenerationRequest
from appliance.engine.load import load_model
from appliance.engine.sampling import SamplingParams
from appliance.native import kernels
from appliance.protocol.structured import OutputFormat

SCHEMA = {"type": "array", "minItems": 40, "items": {
    "type": "object", "additionalProperties": False, "required": ["name", "age", "city", "tags"],
    "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"},
                   "city": {"enum": ["Paris", "Berlin", "Tokyo", "Lima"]},
                   "tags": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 12}}}}}
PROMPT = [{"role": "user", "content": "List forty people as JSON: name, age, city and a few tags each."}]


def run(lm, prompt: list[int], sampling: SamplingParams, decode: int, constraint) -> tuple[float, list[int]]:
    req = GenerationRequest(prompt, sampling, max_tokens=decode, ignore_eos=constraint is None, constraint=constraint)
    fin = list(lm.engine.generate(req))[-1]
    assert fin.completion_tokens == decode, (fin.reason, fin.completion_tokens)
    return fin.timings.tok_s, fin.token_ids


def grammar_ms_per_token(compiled, tokens: list[int]) -> float:
    """Mask + accept per token, replaying `tokens` through a fresh constraint (the forward pass left out)."""
    c = compiled.start()
    t0 = time.perf_counter()
    for t in tokens:
        allowed = c.allowed()
        np.flatnonzero(allowed)          # what Sampler.sample does with the mask before its filters
        c.accept(t)
    return (time.perf_counter() - t0) * 1000.0 / len(tokens)


def bench_model(label: str, path: str, runs: int, decode: int, threads: int) -> list[dict]:
    lm = load_model(path, context_length=1024)
    if kernels.available():
        kernels.set_threads(threads)
    print(f"{label}: native library {kernels.available() and kernels.simd_name()}, threads {threads}",
          file=sys.stderr, flush=True)
    prompt = lm.tokenizer.encode(lm.chat_template.render(PROMPT, add_generation_prompt=True, enable_thinking=False))
    vocab = lm.engine.model.config.vocab_size
    t0 = time.perf_counter()
    compiled = constraint_for(OutputFormat("json_schema", SCHEMA), lm.tokenizer, vocab, lm.eos_ids)
    compile_ms = (time.perf_counter() - t0) * 1000.0      # includes the tokenizer table on first use
    rows = []
    for mode, sampling in (("greedy", SamplingParams(temperature=0.0)),
                           ("t=1.0", SamplingParams(temperature=1.0, seed=1))):
        run(lm, prompt, sampling, 8, None)                # warm-up
        load = os.getloadavg()[0]
        free, constrained, tokens = [], [], []
        for _ in range(runs):                             # interleaved, so machine noise hits both alike
            free.append(run(lm, prompt, sampling, decode, None)[0])
            s, tokens = run(lm, prompt, sampling, decode, compiled)
            constrained.append(s)
        grammar = statistics.median(grammar_ms_per_token(compiled, tokens) for _ in range(3))
        text = lm.tokenizer.decode(tokens)
        row = dict(model=label, vocab=vocab, mode=mode, free=statistics.median(free),
                   constrained=statistics.median(constrained), grammar_ms=grammar, compile_ms=compile_ms, load=load,
                   runs=dict(free=free, constrained=constrained), sample=text[:80])
        rows.append(row)
        print_row(row, file=sys.stderr)
        print("  output starts:", repr(text[:100]), file=sys.stderr)
    return rows


HEADER = (f"{'model':<19}{'vocab':>7}{'mode':>7}{'free tok/s':>11}{'schema tok/s':>13}{'overhead':>9}"
          f"{'free ms/tok':>12}{'grammar ms/tok':>15}{'grammar %':>10}{'load':>6}")


def print_row(r: dict, file=sys.stdout) -> None:
    free_ms = 1000.0 / r["free"]
    print(f"{r['model']:<19}{r['vocab']:>7}{r['mode']:>7}{r['free']:>11.2f}{r['constrained']:>13.2f}"
          f"{100 * (1 - r['constrained'] / r['free']):>8.1f}%{free_ms:>12.2f}{r['grammar_ms']:>15.3f}"
          f"{100 * r['grammar_ms'] / free_ms:>9.1f}%{r['load']:>6.1f}", file=file, flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2,q4_0")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--decode", type=int, default=128)
    args = ap.parse_args(argv)
    rows = []
    for m in args.models.split(","):
        rows += bench_model(*bench_file(m), args.runs, args.decode, args.threads)
    print(f"\ndecode: {args.decode} tokens, median of {args.runs} interleaved runs; overhead = 1 - schema / free "
          f"tok/s; grammar ms/tok = mask + accept alone (tokens replayed); load = 1-min load average (2 cores, "
          f"shared); schema compile (first use, with the tokenizer table): "
          + ", ".join(f"{r['model']} {r['compile_ms']:.0f} ms" for r in rows[::2]))
    print(HEADER)
    for r in rows:
        print_row(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
