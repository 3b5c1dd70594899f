"""Qwen3-VL's vision tower on the board (issues 25 / 26): one image's encode time on the 4 A76s, from the kernel
table's prefill costs (bench/a76_model.py), ours against llama.cpp's mtmd, for an F16 and a Q8_0 mmproj.

    python bench/a76_vision.py [--side 448] [--ghz 2.4] [--cores 4]
    (bench/a76_model.py prints the same table after its own unless --quick or --no-context)

Policy:
- The tower as transformers' Qwen3VLVisionModel computes it (mtmd's clip graph mirrors it), widths from the
  checkpoints' config.json (bench/vision_bench.py's SHAPES): the patch embedding, a matmul over flattened
  2 x 16 x 16 x 3 patches; `depth` blocks of full attention over the image's patches (qkv, proj, a GELU MLP); the
  merger and one DeepStack merger per deepstack index, each on a quarter of the tokens (4 patches merged: fc1
  4h -> 4h, fc2 4h -> out). Norms, GELU, RoPE, the softmax and the bias adds are left out (a few flops per element
  against the hidden width's multiply-adds).
- Each side's weight products priced per 32 multiply-adds with its prefill tile of the mmproj's type, as the kernel
  table has them: ours the 16-bit float tile (F16 widened to f32 FMAs) and the x8 Q8_0 tile; llama.cpp's tinyBLAS
  F16 tile (fp16 FMAs) and its 4x4 Q8_0 gemm. Attention's two products (scores and probability x value, patches^2 x
  hidden multiply-adds each per block) at the F32 tiles on both sides: ours vision.c's sa_task (kq_f32_tiles on
  f32 q, k, v), mtmd's clip without flash attention (F32 mul_mats: tinyBLAS F32).
- Compute only: 784 patches per weight read (448 x 448) make the tower compute-bound on the board (the 2B tower's
  F16 weights are 0.8 GB, 40 ms at 20 GB/s, against seconds of arithmetic). Nothing of the text side.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import a76_model  # noqa: E402
import vision_bench  # noqa: E402

PATCH, TEMPORAL, MERGE = 16, 2, 2  # Qwen3-VL's patch, temporal patch and spatial merge sizes
MMPROJ_TYPES = ("F16", "Q8_0")
SIDES = ("ours", "llama.cpp")


def tower_macs(v: dict, side: int = 448) -> dict[str, float]:
    """Multiply-adds of one side x side image through a tower of vision_bench's widths: 'weights' (every linear),
    'attention' (scores + probability x value)."""
    n = (side // PATCH) ** 2  # patches (the image repeated over the temporal patch: one frame)
    h, i, out = v["hidden_size"], v["intermediate_size"], v["out_hidden_size"]
    embed = n * 3 * TEMPORAL * PATCH * PATCH * h
    block = n * (h * 3 * h + h * h + 2 * h * i)
    merged, mh = n // (MERGE * MERGE), h * MERGE * MERGE
    mergers = (1 + len(v["deepstack_visual_indexes"])) * merged * (mh * mh + mh * out)
    return {"weights": embed + v["depth"] * block + mergers, "attention": v["depth"] * 2 * n * n * h, "patches": n}


def encode_seconds(costs: dict, v: dict, mmproj: str, side_name: str, board: dict, side: int = 448) -> dict:
    """Seconds of one image's encode on the board's cores; costs: a76_model.board_costs (side, kind, qtype) ->
    A76 cycles per 32 multiply-adds."""
    hz = board["cores"] * board["ghz"] * 1e9
    m = tower_macs(v, side)
    w = m["weights"] / 32 * costs[(side_name, "prefill", mmproj)] / hz
    a = m["attention"] / 32 * costs[(side_name, "prefill", "F32")] / hz
    return {"s": w + a, "weights_s": w, "attention_s": a, **m}


def vision_report(res: dict, board: dict, side: int = 448) -> str:
    costs = a76_model.board_costs(res)
    out = [f"Qwen3-VL vision towers on the board: one {side} x {side} image, {board['cores']} A76 at {board['ghz']} "
           "GHz (compute only), seconds; llama.cpp = mtmd's clip graph on the same mmproj.", "",
           "| tower | mmproj | code | GMAC weights + attention | weights s | attention s | encode s | ours / llama.cpp |",
           "| --- | --- | --- | --- | ---: | ---: | ---: | ---: |"]
    for name, spec in vision_bench.SHAPES.items():
        v = spec["vision"]
        for q in MMPROJ_TYPES:
            r = {s: encode_seconds(costs, v, q, s, board, side) for s in SIDES
                 if (s, "prefill", q) in costs and (s, "prefill", "F32") in costs}
            for s, e in r.items():
                ratio = f"{e['s'] / r['llama.cpp']['s']:.2f}x" if s == "ours" and "llama.cpp" in r else ""
                out.append(f"| Qwen3-VL-{name.upper()} | {q} | {s} | {e['weights'] / 1e9:.0f} + "
                           f"{e['attention'] / 1e9:.0f} | {e['weights_s']:.2f} | {e['attention_s']:.2f} | "
                           f"{e['s']:.2f} | {ratio} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--side", type=int, default=448, help="image side in pixels (a multiple of 32)")
    ap.add_argument("--ghz", type=float, default=2.4)
    ap.add_argument("--cores", type=int, default=4)
    ap.add_argument("--llama-src", help="llama.cpp's ggml/ directory (default: the peer's sdist, fetched once)")
    a = ap.parse_args(argv)
    if a.side % (PATCH * MERGE):
        ap.error(f"--side {a.side}: not a multiple of {PATCH * MERGE}")
    ks = [k for k in a76_model.KERNELS if k.kind == "prefill" and k.qtype in MMPROJ_TYPES + ("F32",)]
    res = a76_model.measure(ks, a76_model.llama_src(a.llama_src))
    print(vision_report(res, {"ghz": a.ghz, "cores": a.cores, "bw": 20.0}, a.side))
    return 0


if __name__ == "__main__":
    sys.exit(main())
