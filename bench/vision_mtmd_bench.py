"""Qwen3-VL pair served by us vs llama.cpp's mtmd (llama-cpp-python), on the same files, in the same run.

The pair is a Qwen3-VL-2B-shaped checkpoint (real widths: text hidden 2048, 16/8 heads, head_dim 128, MLP
6144, vocab 151936; vision 24 blocks of 1024, 3 DeepStack mergers; random weights) with --text-layers of its 28
decoder layers, made into a pair by llama.cpp's own tools: convert_hf_to_gguf.py to F16, llama_model_quantize
to --text-type (Q4_0 by default), and convert_hf_to_gguf.py --mmproj to an F16 projector. One 448x448 PNG
(196 image tokens; a size mtmd's resize keeps, so both engines see the same pixels) in a one-message prompt.

Each engine runs in its own child process (RSS is its own): load, then the prompt timed in parts: image encode
(the vision tower and mergers), prefill (the decoder over the whole prompt, image embeddings included), then
--decode greedy steps. Rows: best of --repeat; time ratios are ours / llama.cpp (< 1: we are faster), tok/s
ratios ours / llama.cpp (> 1: we are faster). Goals (issue 25): encode <= 0.8x, prefill and decode >= 1.1x.

Usage: python bench/vision_mtmd_bench.py [--shape 2b|8b] [--text-layers 4] [--text-type Q4_0] [--repeat 2] [--decode 32]
Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
sys.path.insert(0, BENCH)
sys.path.insert(0, ROOT)  # this tree's appliance and tests.support, also in the child
CACHE = os.path.expanduser(os.environ.get("KESTREL_BENCH_CACHE", "~/.cache/kestrel-bench"))
MESSAGES = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}},
                                         {"type": "text", "text": "What is in this picture? Answer briefly."}]}]
IMAGE_SPAN = "<|vision_start|><|image_pad|><|vision_end|>"


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return 0.0


def make_pair(text_layers: int, text_type: str, shape: str = "2b") -> tuple[str, str, str]:
    """(checkpoint dir, text.gguf, mmproj.gguf), built once into the bench cache by llama.cpp's tools."""
    import peer
    import vision_bench

    from tests.support.llama_convert import convert_hf

    base = os.path.join(CACHE, f"qwen3vl-{shape}-shape-{text_layers}L")
    hf = os.path.join(base, "hf")
    if not os.path.exists(os.path.join(hf, "config.json")):
        vision_bench.build(hf + ".tmp", text_layers, shape)
        os.replace(hf + ".tmp", hf)
    text = os.path.join(base, f"text-{text_type}.gguf")
    mmproj = os.path.join(base, "mmproj-f16.gguf")
    if not os.path.exists(text):
        f16 = convert_hf(hf, os.path.join(base, "text-f16.gguf"), "f16", timeout=3600)
        peer.quantize(f16, text + ".tmp", text_type)
        os.replace(text + ".tmp", text)
    if not os.path.exists(mmproj):
        convert_hf(hf, mmproj, "f16", mmproj=True, timeout=3600)
    return hf, text, mmproj


def picture() -> tuple[bytes, tuple[int, int, bytes]]:
    import io

    from PIL import Image

    from tests.support.tiny_vl import image_bytes

    png = image_bytes(448, 448, "PNG", seed=1)
    im = Image.open(io.BytesIO(png)).convert("RGB")
    return png, (im.width, im.height, im.tobytes())


def ours_child(text: str, mmproj: str, repeat: int, decode: int, threads: int) -> dict:
    """Our engine on the pair, in this (child) process: load, then best-of-repeat encode / prefill / decode."""
    import numpy as np

    from appliance.engine.image_processing import decode_image
    from appliance.engine.load import load_model
    from appliance.engine.qwen3_vl import expand_image_pads

    t0 = time.perf_counter()
    loaded = load_model(text, mmproj=mmproj, context_length=1024, prefill_chunk=256, threads=threads)
    load_s = time.perf_counter() - t0
    rss_load = rss_mb()
    model = loaded.model
    png, _ = picture()
    patches = model.image_processor.preprocess(decode_image(png))
    ids = expand_image_pads(loaded.tokenizer.encode(loaded.chat_template.render(MESSAGES, add_generation_prompt=True)),
                            model.image_token_id, [patches.num_tokens])
    cache = model.new_cache(1024)
    enc = pf = dec = float("inf")
    tokens: list[int] = []
    for _ in range(repeat):
        cache.reset()
        t = time.perf_counter()
        model.prepare_images(cache, ids, [patches])
        enc = min(enc, time.perf_counter() - t)
        t = time.perf_counter()
        for s in range(0, len(ids), 256):
            logits = model.forward(np.asarray(ids[s:s + 256]), cache, "last")  # (1, vocab) at the last chunk
        pf = min(pf, time.perf_counter() - t)
        tokens = [int(np.argmax(logits[-1]))]
        t = time.perf_counter()
        for _ in range(decode):
            logits = model.forward(np.asarray(tokens[-1:]), cache, "last")
            tokens.append(int(np.argmax(logits[-1])))
        dec = min(dec, time.perf_counter() - t)
    return {"load_s": load_s, "rss_load_mb": rss_load, "rss_after_mb": rss_mb(), "encode_s": enc, "prefill_s": pf,
            "decode_s": dec, "prompt_tokens": len(ids), "image_tokens": patches.num_tokens, "tokens": tokens,
            "rendered": loaded.chat_template.render(MESSAGES, add_generation_prompt=True)}


def theirs(text: str, mmproj: str, rendered: str, repeat: int, decode: int, threads: int) -> dict:
    import peer_mtmd

    _, pixels = picture()
    t0 = time.perf_counter()
    with peer_mtmd.MtmdPeer(text, mmproj, n_threads=threads, n_ctx=1024) as p:
        load_s = time.perf_counter() - t0
        rss_load = p.info["rss_mb"]
        prompt = rendered.replace(IMAGE_SPAN, p.marker)
        runs = [p.bench(prompt, [pixels], decode) for _ in range(repeat)]
    best = {k: min(r[k] for r in runs) for k in ("encode_s", "prefill_s", "decode_s")}
    return {"load_s": load_s, "rss_load_mb": rss_load, "rss_after_mb": runs[-1]["rss_mb"],
            "prompt_tokens": runs[-1]["prompt_tokens"], "tokens": runs[-1]["tokens"], **best}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--text-layers", type=int, default=4)
    ap.add_argument("--text-type", default="Q4_0")
    ap.add_argument("--shape", default="2b", choices=["2b", "8b"], help="Qwen3-VL-2B's or -8B's widths")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--child", nargs=2, metavar=("TEXT", "MMPROJ"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(ours_child(*args.child, args.repeat, args.decode, args.threads)))
        return 0
    import vision_bench

    t = time.perf_counter()
    _, text, mmproj = make_pair(args.text_layers, args.text_type, args.shape)
    build_s = time.perf_counter() - t
    load_before = os.getloadavg()[0]
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", text, mmproj, "--repeat",
                        str(args.repeat), "--decode", str(args.decode), "--threads", str(args.threads)],
                       capture_output=True, text=True, cwd=ROOT)
    if p.returncode != 0:
        raise SystemExit(f"our child failed: {p.stderr[-2000:]}")
    ours = json.loads(p.stdout.strip().splitlines()[-1])
    ref = theirs(text, mmproj, ours.pop("rendered"), args.repeat, args.decode, args.threads)
    n, d = ours["prompt_tokens"], args.decode

    def row(name, o, r, per_s=None):
        if per_s is None:
            return {"ours_ms": round(1000 * o, 1), "llama_ms": round(1000 * r, 1), "ratio_time": round(o / r, 2)}
        return {"ours_tok_s": round(per_s / o, 1), "llama_tok_s": round(per_s / r, 1), "ratio_tok_s": round(r / o, 2)}

    result = {
        "pair": f"Qwen3-VL-{args.shape.upper()} widths, {args.text_layers} of "
                f"{vision_bench.SHAPES[args.shape]['text_depth']} text layers, {args.text_type} text + F16 mmproj "
                "(llama.cpp's converter and quantizer), random weights",
        "image": "448x448 PNG", "image_tokens": ours["image_tokens"], "prompt_tokens": n,
        "same_prompt_length": n == ref["prompt_tokens"], "threads": args.threads, "build_s": round(build_s, 1),
        "load_avg": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "image_encode": row("encode", ours["encode_s"], ref["encode_s"]),
        "prefill": row("prefill", ours["prefill_s"], ref["prefill_s"], n),
        "decode": row("decode", ours["decode_s"], ref["decode_s"], d),
        "rss_mb": {"ours_after_load": round(ours["rss_load_mb"]), "llama_after_load": round(ref["rss_load_mb"]),
                   "ours_after_image": round(ours["rss_after_mb"]), "llama_after_image": round(ref["rss_after_mb"])},
        "load_s": {"ours": round(ours["load_s"], 1), "llama": round(ref["load_s"], 1)},
    }
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
