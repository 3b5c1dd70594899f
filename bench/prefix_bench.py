"""Prefix reuse: turn-2 time to first token on a 1,000- and a 4,000-token history, ours with and without reuse
and llama.cpp (llama-cpp-python, same GGUF, same threads) with and without its prompt cache, in one run; KV
bytes per token (f16 vs f32); resident memory with 4 cached conversations.

A conversation: turn 1 is the history (random token ids) and an 8-token answer; turn 2 is the history, that
answer and a 30-token new user turn. Turn-2 TTFT with reuse prefills only what turn 1 did not run; without
reuse, all of it. TTFT here is the engine's (prefill of what is not cached + the first token), no HTTP.

    python bench/prefix_bench.py [--threads 2] [--histories 1000,4000] [--model PATH.gguf]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
import peer
from gguf_bench import bench_file

from appliance.engine.generate import GenerationRequest
from appliance.engine.load import load_model
from appliance.engine.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
ANSWER, NEW_TURN = 8, 30


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def conversation(seed: int, history: int) -> tuple[list[int], list[int]]:
    rng = np.random.default_rng(seed)
    return ([int(t) for t in rng.integers(100, 30000, history)],
            [int(t) for t in rng.integers(100, 30000, NEW_TURN)])


def ours_turn(engine, ids, n=1):
    fin = list(engine.generate(GenerationRequest(ids, GREEDY, max_tokens=n, ignore_eos=True)))[-1]
    return fin


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--histories", default="1000,4000")
    ap.add_argument("--model", help="a .gguf file (default: the random Qwen3-1.7B-shaped Q4_0 of gguf_bench)")
    ap.add_argument("--rss-tokens", type=int, default=1000, help="history length of the 4 cached conversations")
    args = ap.parse_args(argv)
    path = args.model or bench_file("q4_0")[1]
    histories = [int(x) for x in args.histories.split(",") if x]
    ctx = max(histories + [args.rss_tokens]) + ANSWER + NEW_TURN + 64
    print(f"model {os.path.basename(path)}, threads {args.threads}, load average {os.getloadavg()[0]:.1f}, "
          f"{os.cpu_count()} CPUs", flush=True)
    base_rss = rss_mb()
    lm = load_model(path, context_length=ctx, prefill_chunk=512, threads=args.threads, cache_ram_mb=4096)
    eng = lm.engine
    eng.warm_up()
    rows = []
    peer_or_none = peer.LlamaCppPeer(path, n_threads=args.threads, n_ctx=ctx) if histories else contextlib.nullcontext()
    with peer_or_none as theirs:
        if histories:
            theirs.turn(conversation(99, 64)[0], reuse=False)  # pages the weights in
        for i, h in enumerate(histories):
            hist, new = conversation(i, h)
            load = os.getloadavg()[0]
            # ours: turn 1, then turn 2 reusing it, then turn 2 again from scratch
            t1 = ours_turn(eng, hist, ANSWER)
            turn2 = hist + t1.token_ids + new
            with_reuse = ours_turn(eng, turn2)
            eng.reuse_prefix = False
            without = ours_turn(eng, turn2)
            eng.reuse_prefix = True
            # llama.cpp: the same, its context keeping turn 1 (prompt + answer)
            theirs.turn(hist, reuse=False, decode=ANSWER)
            their_reuse = theirs.turn(turn2, reuse=True)
            their_cold = theirs.turn(turn2, reuse=False)
            rows.append(dict(history=h, prompt=len(turn2), ours_cached=with_reuse.timings.cache_n,
                             ours_reuse=with_reuse.timings.ttft_ms, ours_cold=without.timings.ttft_ms,
                             theirs_cached=their_reuse["cached"], theirs_reuse=their_reuse["ttft_ms"],
                             theirs_cold=their_cold["ttft_ms"], load=load))
            r = rows[-1]
            print(f"history {h}: ours {r['ours_reuse']:.0f} ms reused {r['ours_cached']} / {r['ours_cold']:.0f} ms "
                  f"cold; llama.cpp {r['theirs_reuse']:.0f} ms reused {r['theirs_cached']} / "
                  f"{r['theirs_cold']:.0f} ms cold (load {load:.1f})", flush=True)
    # memory: KV bytes per token, and 4 conversations kept warm
    f16_bpt = eng.cache.bytes_per_token
    f32_bpt = f16_bpt * 2 if eng.cache.dtype == np.float16 else f16_bpt
    eng.drop_sequence()
    eng.store.clear()
    before = rss_mb()
    convs = [conversation(100 + j, args.rss_tokens) for j in range(4)]
    for hist, _ in convs:
        ours_turn(eng, hist, ANSWER)
    t0 = time.perf_counter()
    warm = [ours_turn(eng, hist + new).timings.cache_n for hist, new in convs]  # each turn 2 finds its copy
    after = rss_mb()
    print(f"4 conversations of {args.rss_tokens} tokens: turn 2 reused {warm} tokens ({(time.perf_counter() - t0):.1f} s); "
          f"store {eng.store.nbytes / 2**20:.0f} MB in {len(eng.store)} copies; RSS {base_rss:.0f} MB before load, "
          f"{before:.0f} MB loaded, {after:.0f} MB with 4 conversations", flush=True)
    print()
    print("| history | turn-2 prompt | ours, reuse | ours, no reuse | cut | llama.cpp, cache | llama.cpp, no cache "
          "| ours / llama.cpp (cached) | load |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['history']} | {r['prompt']} | {r['ours_reuse']:.0f} ms ({r['ours_cached']} reused) "
              f"| {r['ours_cold']:.0f} ms | {100 * (1 - r['ours_reuse'] / r['ours_cold']):.1f}% "
              f"| {r['theirs_reuse']:.0f} ms ({r['theirs_cached']} reused) | {r['theirs_cold']:.0f} ms "
              f"| {r['ours_reuse'] / r['theirs_reuse']:.2f}x | {r['load']:.1f} |")
    print()
    print(f"KV bytes/token: f16 {f16_bpt} ({f16_bpt * 4096 / 2**20:.0f} MB per 4K context), f32 {f32_bpt}; "
          f"RSS with 4 cached {args.rss_tokens}-token conversations: {after:.0f} MB ({after - before:+.0f} MB over the loaded model; "
          f"copies {eng.store.nbytes / 2**20:.0f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
