"""Qwen3.5 (hybrid Gated DeltaNet) against llama.cpp on the same GGUF files, side by side in one run (gguf_bench.py's
machinery: interleaved runs, median, the load average and copy bandwidth per row), plus the memory a long context
costs: recurrent-state bytes of the Qwen3.5 2B against the KV bytes a Qwen3-1.7B holds at 4K.

The file: a Qwen3.5-2B-shaped checkpoint (text side: hidden 2048, MLP 6144, 8 heads / 2 KV of head_dim 256,
partial rotary 0.25, Gated DeltaNet with 16 key and 16 value heads of 128, conv kernel 4, vocab 248320, tied) with
only LAYERS layers (every 4th full attention, as the 2B's 24), random weights built by transformers, converted by
llama.cpp's own convert_hf_to_gguf.py to F16 and quantized by llama.cpp's own quantizer (Q8_0, Q4_0, Q4_K_M). Few
layers keep the files small on a shared 2-core machine; the 248K LM head is read in full every token, so its
share of a token's bytes is larger here than in the 24-layer 2B (the row prints the weight MB per token).

    python bench/qwen35_bench.py [--types q8_0,q4_0,q4_k_m] [--threads 1,2] [--runs 3] [--layers 4]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gguf_bench  # noqa: E402  (a sibling file; bench/ is not a package)

from appliance.native import kernels  # noqa: E402
from tests.support.gguf_files import peer_module  # noqa: E402
from tests.support.llama_convert import convert_hf  # noqa: E402

QWEN35_2B = dict(vocab_size=248320, hidden_size=2048, intermediate_size=6144, num_attention_heads=8,
                 num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
                 linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                 full_attention_interval=4, max_position_embeddings=32768, tie_word_embeddings=True,
                 rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                                  "mrope_section": [11, 11, 10], "mrope_interleaved": True})
FULL_LAYERS_2B = 24
QUANT = {"q8_0": "Q8_0", "q4_0": "Q4_0", "q4_k_m": "Q4_K_M"}


def build_checkpoint(out_dir: str, layers: int) -> str:
    """The 2B's text widths with `layers` layers, random (transformers' init), the real Qwen tokenizer (the vocab
    padded to 248320 by the converter), text-only Qwen3_5ForCausalLM layout."""
    if os.path.exists(os.path.join(out_dir, "config.json")):
        return out_dir
    import torch
    import transformers

    from tests.support.tiny_models import FIXTURES, write_generation_config, write_tokenizer

    torch.manual_seed(0)
    cfg = transformers.Qwen3_5TextConfig(num_hidden_layers=layers, rms_norm_eps=1e-6, **QWEN35_2B)
    model = transformers.Qwen3_5ForCausalLM(cfg)
    tmp = out_dir + ".tmp"
    model.to(torch.bfloat16).save_pretrained(tmp, safe_serialization=True)
    write_tokenizer(tmp)
    write_generation_config(tmp)
    shutil.copyfile(os.path.join(FIXTURES, "qwen3", "chat_template.jinja"), os.path.join(tmp, "chat_template.jinja"))
    os.replace(tmp, out_dir)
    return out_dir


def files(layers: int, types: list[str]) -> dict[str, str]:
    base = os.path.join(gguf_bench.CACHE, f"qwen35-2b-{layers}l")
    hf = build_checkpoint(base + "-hf", layers)
    f16 = base + "-f16.gguf"
    if not os.path.exists(f16):
        convert_hf(hf, f16, "f16", timeout=3600, extra=("--no-mtp",))  # no MTP head in it
    out = {}
    for t in types:
        path = f"{base}-{t}.gguf"
        if not os.path.exists(path):
            peer_module().quantize(f16, path, QUANT[t])
        out[t] = path
    return out


def state_vs_kv(ctx: int = 4096) -> dict:
    """Bytes a sequence of ctx tokens holds: the Qwen3.5 2B (24 layers: 18 linear with a fixed recurrent state,
    6 full attention with f16 KV) against a Qwen3-1.7B (28 layers of f16 KV, 8 KV heads of 128)."""
    c = QWEN35_2B
    n_full = FULL_LAYERS_2B // c["full_attention_interval"]
    n_linear = FULL_LAYERS_2B - n_full
    conv_dim = 2 * c["linear_num_key_heads"] * c["linear_key_head_dim"] + c["linear_num_value_heads"] * c["linear_value_head_dim"]
    conv = (c["linear_conv_kernel_dim"] - 1) * conv_dim * 4  # float32, as recurrent_cache.RecurrentState
    ssm = c["linear_num_value_heads"] * c["linear_key_head_dim"] * c["linear_value_head_dim"] * 4
    q35_kv = 2 * n_full * c["num_key_value_heads"] * c["head_dim"] * ctx * 2
    qwen3_kv = 2 * 28 * 8 * 128 * ctx * 2
    return dict(ctx=ctx, linear_layers=n_linear, full_layers=n_full, state_bytes=n_linear * (conv + ssm),
                q35_kv_bytes=q35_kv, qwen3_1_7b_kv_bytes=qwen3_kv)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--types", default="q8_0,q4_0,q4_k_m")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--decode", type=int, default=32)
    args = ap.parse_args(argv)
    peer = peer_module()
    peer.ensure_peer()
    types = args.types.split(",")
    paths = files(args.layers, types)
    threads = [int(t) for t in args.threads.split(",")]
    print(f"native library: {kernels.available() and kernels.simd_name()}; peer: {peer.PACKAGE}", flush=True)
    rows = []
    for t in types:
        rows += gguf_bench.bench_model(f"q35-2b/{args.layers}L {t}", paths[t], threads, args.runs, args.prompt,
                                       args.decode, peer)
    print(f"\nQwen3.5-2B-shaped, {args.layers} layers; decode: {args.decode} tokens; prefill: {args.prompt}-token prompt; "
          f"median of {args.runs} interleaved runs; tok/s; ratio = ours / llama.cpp; load = 1-min load average")
    print(gguf_bench.HEADER)
    for r in rows:
        gguf_bench.print_row(r)
    m = state_vs_kv()
    print("\nat 4K context: " + json.dumps(m))
    print(f"Qwen3.5-2B: recurrent state {m['state_bytes'] / 2**20:.1f} MiB (fixed) + KV {m['q35_kv_bytes'] / 2**20:.0f} MiB"
          f" = {(m['state_bytes'] + m['q35_kv_bytes']) / 2**20:.0f} MiB; Qwen3-1.7B KV {m['qwen3_1_7b_kv_bytes'] / 2**20:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
