"""Qwen3-30B-A3B-shaped mixture-of-experts, ours against llama.cpp on the same GGUF files, side by side in one
run: decode tok/s (128 tokens) and prefill tok/s (256-token prompt), median of >= 3 interleaved runs, plus the
bytes of weights read per decoded token against the dense equivalent (every expert read), and how many distinct
(layer, expert) pairs one request (prefill + decode) read. Memory: the resident size (MB) of the file mapping after
a request with expert pages kept, and after one with --moe-release-pages behaviour (madvise after each use),
with the decode speed of that release run.

The model has the real widths (hidden 2048, 128 experts, top-8, moe_intermediate 768, 32 heads, 4 KV heads,
head_dim 128, vocab 151936) and fewer layers (default 4 of 48) so it fits this machine's time; random blocks
with sane scales (speed does not depend on the values), cached in ~/.cache/kestrel-bench; `llama-<ftype>`
(llama-q4_k_m, llama-q3_k_m) is the same model written as random F16 and quantized by llama.cpp's quantizer (the
files people download: Q4_K_M's experts Q4_K with Q6_K ffn_down on part of the layers, Q3_K_M's Q3_K + Q4_K/Q5_K).

    python bench/moe_bench.py [--types q4_0,q8_0,llama-q4_k_m] [--layers 4] [--threads 2] [--runs 3]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gguf_bench import (
    CACHE,
    LLAMA_PREFIX,
    Ours,
    attention_plan,
    copy_bandwidth,
    interleaved,
    llama_quantized,
    side_by_side,
    write_random_gguf,
)

from appliance.engine.load.gguf import open_gguf
from appliance.engine.page_release import mapping_rss
from appliance.engine.qwen3_moe import set_release_pages
from appliance.native import kernels
from tests.support.gguf_files import peer_module

QWEN3_30B_A3B = dict(hidden=2048, heads=32, kv_heads=4, head_dim=128, experts=128, top_k=8, moe_inter=768,
                     vocab=151936, intermediate=6144)


def write_random_moe(path: str, qtype_name: str, layers: int, s: dict = QWEN3_30B_A3B) -> str:
    from appliance.engine.config import Qwen3Config
    from appliance.engine.qwen3_moe import MoEConfig

    cfg = Qwen3Config(model_type="qwen3_moe", vocab_size=s["vocab"], hidden_size=s["hidden"],
                      intermediate_size=s["intermediate"], num_hidden_layers=layers, num_attention_heads=s["heads"],
                      num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"], rms_norm_eps=1e-6, rope_theta=1e6,
                      max_position_embeddings=40960, tie_word_embeddings=False)
    moe = MoEConfig(s["experts"], s["top_k"], s["moe_inter"], True)
    D, E, F = s["hidden"], s["experts"], s["moe_inter"]
    plan = [("token_embd.weight", (s["vocab"], D))]
    routers = []
    for i in range(layers):
        p = f"blk.{i}."
        routers.append(p + "ffn_gate_inp.weight")
        plan += attention_plan(p, s) + [(routers[-1], (E, D)), (p + "ffn_gate_exps.weight", (E, F, D)),
                                        (p + "ffn_up_exps.weight", (E, F, D)), (p + "ffn_down_exps.weight", (E, D, F))]
    plan += [("output_norm.weight", (D,)), ("output.weight", (s["vocab"], D))]
    return write_random_gguf(path, cfg, plan, qtype_name, f"random-qwen3-30b-a3b-{layers}l-{qtype_name.lower()}",
                             moe, f32=tuple(routers))


def bytes_per_token(path: str, top_k: int) -> tuple[int, int]:
    """(bytes read per decoded token with top-k routing, bytes if every expert were read: the dense equivalent)."""
    r = open_gguf(path)
    sparse = dense = 0
    for t in r.tensors:
        n = int(t.n_bytes)
        if t.name == "token_embd.weight":
            continue  # one row per token
        if "_exps." in t.name:
            experts = int(t.shape[-1])
            sparse += n * top_k // experts
            dense += n
        else:
            sparse += n
            dense += n
    return sparse, dense


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--types", default="q4_0,q8_0")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--threads", default="2")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--decode", type=int, default=128)
    args = ap.parse_args(argv)
    peer = peer_module()
    peer.ensure_peer()
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e9:.1f} GB/s; native library: {kernels.available()}", flush=True)
    print(f"{'type':<13}{'thr':>4}{'dec ours':>10}{'dec llama':>10}{'ratio':>7}{'pre ours':>10}{'pre llama':>10}"
          f"{'ratio':>7}{'MB/tok':>8}{'dense MB':>9}{'experts read':>14}{'RSS kept':>10}{'released':>10}{'dec rel':>10}", flush=True)
    for t in args.types.split(","):
        if t.startswith(LLAMA_PREFIX):
            f16 = write_random_moe(os.path.join(CACHE, f"random-qwen3-30b-a3b-{args.layers}l-f16.gguf"), "F16",
                                   args.layers)
            path = llama_quantized(f16, t[len(LLAMA_PREFIX):])
        else:
            path = write_random_moe(os.path.join(CACHE, f"random-qwen3-30b-a3b-{args.layers}l-{t}.gguf"), t.upper(),
                                    args.layers)
        sparse, dense = bytes_per_token(path, QWEN3_30B_A3B["top_k"])
        ours = Ours(path, args.prompt, args.decode)
        stats = ours.lm.model.expert_stats
        for n in (int(x) for x in args.threads.split(",")):
            with side_by_side(ours, peer, n) as theirs:
                per_tok = []

                def count_experts():  # distinct (layer, expert) pairs one request read
                    per_tok.append(stats.distinct_experts)
                    stats.reset()
                stats.reset()
                measured = interleaved(ours, theirs, args.runs, after_ours=count_experts)
                rss_kept = mapping_rss(ours.lm.model.layers[0].mlp.experts[0].gate.raw)  # the file mapping's RSS
                set_release_pages(ours.lm.model, True)
                rel_pre, rel_dec = ours.run(args.prompt, args.decode)
                rss_released = mapping_rss(ours.lm.model.layers[0].mlp.experts[0].gate.raw)
                set_release_pages(ours.lm.model, False)
            od, td, op, tp = (statistics.median(measured[k])
                              for k in ("ours_dec", "llama_dec", "ours_pre", "llama_pre"))
            print(f"{t:<13}{n:>4}{od:>10.2f}{td:>10.2f}{od / td:>7.2f}{op:>10.1f}{tp:>10.1f}{op / tp:>7.2f}"
                  f"{sparse / 1e6:>8.0f}{dense / 1e6:>9.0f}{statistics.median(per_tok):>8.0f}/{QWEN3_30B_A3B['experts'] * args.layers}"
                  f"{rss_kept / 1e6:>10.0f}{rss_released / 1e6:>10.0f}{rel_dec:>10.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
