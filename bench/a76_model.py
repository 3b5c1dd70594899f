"""Off-board cost model of the RK3588 board: our NEON kernels and llama.cpp's, cycles per block on Cortex-A76 and
Cortex-A55 (llvm-mca over the inner loops clang makes of them, bench/a76_mca.py), and the decode and prefill
tok/s those cycles and the board's memory bandwidth predict per model shape.

    python bench/a76_model.py [--quick] [--llama-src DIR] [--bw 20] [--ghz 2.4] [--cores 4]
    (then bench/a76_context.py's decode at context and bench/a76_vision.py's vision towers, unless --no-context)

Policy:
- Ours: the tile kernels of the dotprod level (matmul_neon.c, `*_neondot`), called by `flatten` wrappers with
  the shape as constants: decode is one column (T = 1) of the row layout (what MoE experts and the types without
  an x8 layout read) and of the x8 layout (dense Q8_0/Q4_0/Q4_K/Q6_K); prefill is one full pass of the x8
  kernels (8 columns for Q8_0 / Q4_0, 4 for the K formats). The constants pick the code the library runs at those
  shapes: the row tiles have a single-column path of their own and the x8 kernels are specialised for a full pass
  and for one column (matmul_x8_neon.inc). llama.cpp (the peer's source distribution, bench/peer.py's version,
  unpacked once into ~/.cache/kestrel-bench/llama-src): its in-place dot products (arch/arm/quants.c, `ggml_vec_dot_*`) and the
  repacked ones (arch/arm/repack.cpp, `ggml_gemv_*` / `ggml_gemm_*`): on an A76 (dotprod, no i8mm) it repacks
  Q4_0/Q8_0 to 4x4 and Q4_K/Q5_K/Q6_K to 8x4 for decode and prefill alike, so those are its board kernels.
- The float kernels (F32/F16/BF16 products, attention's probability x value tiles) and their llama.cpp
  equivalents: bench/a76_float.py (ours as GCC compiles them there; it says why).
- Unit: cycles per 32 weights (per 32 weights x 1 column for prefill tiles), from cycles per iteration and the
  iteration's multiply-adds (its sdot count x 16: a whole number of blocks of the tile's rows x columns, checked).
- Board: 4 Cortex-A76 at 2.4 GHz (RK3588 datasheet clock) sharing an assumed 20 GB/s of read bandwidth (LPDDR4x
  at 4224 MT/s on 64 bits is 33.8 GB/s peak; 20 GB/s is an assumption of what the A76 cluster sustains, not a
  measurement). A matrix-vector product costs max(compute over the cores, weight bytes / bandwidth): llvm-mca
  has no memory stalls, so the bound is added here, and nothing else (attention, norms, activation quantization,
  thread sync) is counted: the figures are upper bounds of the weight products alone.
"""
from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import a76_float  # noqa: E402  (siblings; bench/ is not a package)
import a76_mca as mca  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OURS_SRC = os.path.join(ROOT, "appliance", "native", "src")
OURS_FLAGS = ["-ffp-contract=off", "-fno-trapping-math"]  # appliance/native/build.py's CFLAGS beyond -O3
PEER_VERSION = "0.3.36"  # bench/peer.py's PACKAGE
BYTES_PER_WEIGHT = {"Q8_0": 34 / 32, "Q4_0": 18 / 32, "Q4_K": 144 / 256, "Q5_K": 176 / 256, "Q6_K": 210 / 256,
                    "IQ4_XS": 136 / 256}

# our wrappers: name -> (C call with the shape as constants)
_W32 = "(const uint8_t *w, size_t rb, int64_t nb, const void *a, float *o)"
_X8 = "(const uint8_t *g, int64_t nb, const void *a, float *o)"
OURS_CALLS = {
    "dec_q8_0": (_W32, "q8_0_neondot(w, rb, 0, 4, nb, a, 0, 1, o, 4)"),
    "dec_q4_0": (_W32, "q4_0_neondot(w, rb, 0, 4, nb, a, 0, 1, o, 4)"),
    "dec_q4_K": (_W32, "q4_K_neondot(w, rb, 0, 4, nb, a, 0, 1, o, 4)"),
    "dec_q5_K": (_W32, "q5_K_neondot(w, rb, 0, 4, nb, a, 0, 1, o, 4)"),
    "dec_q6_K": (_W32, "q6_K_neondot(w, rb, 0, 4, nb, a, 0, 1, o, 4)"),
    "dec_iq4_xs": (_W32, "iq4_xs_neondot(w, rb, 0, 4, nb, a, 0, 1, o, 4)"),
    "x8dec_q8_0": (_X8, "x8_neondot(KQ_Q8_0, g, nb, a, 1, o, 8, 0, 8)"),
    "x8dec_q4_0": (_X8, "x8_neondot(KQ_Q4_0, g, nb, a, 1, o, 8, 0, 8)"),
    "x8dec_q4_K": (_X8, "x8k_neondot(g, nb, a, 1, o, 8, 0, 8)"),
    "x8dec_q5_K": (_X8, "x8q5_neondot(g, nb, a, 1, o, 8, 0, 8)"),
    "x8dec_q6_K": (_X8, "x8q6_neondot(g, nb, a, 1, o, 8, 0, 8)"),
    "x8dec_iq4_xs": (_X8, "x8iq4_neondot(g, nb, a, 1, o, 8, 0, 8)"),
    # Q8_0 / Q4_0 prefill: the 8-column wide pass, a row half (4 rows) over all blocks at a time (x8_half_pass;
    # the K formats' 4-column passes too, x8k_half_pass / x8q6_half_pass / x8iq4_half_pass)
    "x8pre_q8_0": (_X8, "x8_neondot(KQ_Q8_0, g, nb, a, 8, o, 8, 0, 8)"),
    "x8pre_q4_0": (_X8, "x8_neondot(KQ_Q4_0, g, nb, a, 8, o, 8, 0, 8)"),
    "x8pre_q4_K": (_X8, "x8k_neondot(g, nb, a, 4, o, 8, 0, 8)"),
    "x8pre_q5_K": (_X8, "x8q5_neondot(g, nb, a, 4, o, 8, 0, 8)"),
    "x8pre_q6_K": (_X8, "x8q6_neondot(g, nb, a, 4, o, 8, 0, 8)"),
    "x8pre_iq4_xs": (_X8, "x8iq4_neondot(g, nb, a, 4, o, 8, 0, 8)"),
    # the K formats' rows in place from 4 columns on (a MoE expert's tokens) are k_cols (matmul_neon_k.inc), which no
    # wrapper inlines (too large): this call only makes the build emit it; its loop over 4-column passes is timed
    "pre_q4_K": (_W32, "q4_K_neondot(w, rb, 0, 4, nb, a, 0, 4, o, 4)"),
    # k_cols with the type a constant (one of its four variants: mins or not, scale pairs or not), the column count
    # not (its loop over 4-column passes is the loop timed)
    **{f"kcols_{q}": ("(const uint8_t *w, size_t rb, int64_t nb, const void *a, float *o, int64_t T, int64_t ldo)",
                      f"k_cols_neondot(KQ_{q}, w, rb, 0, 4, nb, a, 0, T, o, ldo)") for q in ("Q4_K", "Q5_K", "Q6_K",
                                                                                           "IQ4_XS")},
    **a76_float.OURS_FLOAT_CALLS,
}


@dataclass(frozen=True)
class Kernel:
    side: str     # "ours" | "llama.cpp"
    kind: str     # "decode" | "prefill"
    qtype: str
    layout: str   # how the weights are laid out for it
    src: str      # "ours" | "quants.c" | "repack.cpp"
    func: str
    rows: int     # the tile: rows x cols, one block (32 or 256 weights) at least per iteration of the inner loop
    cols: int
    block: int

    @property
    def macs(self) -> int:  # of one block of the tile
        return self.rows * self.cols * self.block


def _k(side, kind, q, layout, src, func, rows, cols, block) -> Kernel:
    return Kernel(side, kind, q, layout, src, func, rows, cols, block)


KERNELS = [
    _k("ours", "decode", "Q8_0", "rows in place", "ours", "mca_dec_q8_0", 4, 1, 32),
    _k("ours", "decode", "Q8_0", "x8", "ours", "mca_x8dec_q8_0", 8, 1, 32),
    _k("llama.cpp", "decode", "Q8_0", "rows in place", "quants.c", "ggml_vec_dot_q8_0_q8_0", 1, 1, 32),
    _k("llama.cpp", "decode", "Q8_0", "4x4 repack", "repack.cpp", "ggml_gemv_q8_0_4x4_q8_0", 4, 1, 32),
    _k("ours", "decode", "Q4_0", "rows in place", "ours", "mca_dec_q4_0", 4, 1, 32),
    _k("ours", "decode", "Q4_0", "x8", "ours", "mca_x8dec_q4_0", 8, 1, 32),
    _k("llama.cpp", "decode", "Q4_0", "rows in place", "quants.c", "ggml_vec_dot_q4_0_q8_0", 1, 1, 32),
    _k("llama.cpp", "decode", "Q4_0", "4x4 repack", "repack.cpp", "ggml_gemv_q4_0_4x4_q8_0", 4, 1, 32),
    _k("ours", "decode", "Q4_K", "rows in place", "ours", "mca_dec_q4_K", 4, 1, 256),
    _k("ours", "decode", "Q4_K", "x8", "ours", "mca_x8dec_q4_K", 8, 1, 256),
    _k("llama.cpp", "decode", "Q4_K", "rows in place", "quants.c", "ggml_vec_dot_q4_K_q8_K", 1, 1, 256),
    _k("llama.cpp", "decode", "Q4_K", "8x4 repack", "repack.cpp", "ggml_gemv_q4_K_8x4_q8_K", 8, 1, 256),
    _k("ours", "decode", "Q6_K", "rows in place", "ours", "mca_dec_q6_K", 4, 1, 256),
    _k("ours", "decode", "Q6_K", "x8", "ours", "mca_x8dec_q6_K", 8, 1, 256),
    _k("llama.cpp", "decode", "Q6_K", "rows in place", "quants.c", "ggml_vec_dot_q6_K_q8_K", 1, 1, 256),
    _k("llama.cpp", "decode", "Q6_K", "8x4 repack", "repack.cpp", "ggml_gemv_q6_K_8x4_q8_K", 8, 1, 256),
    _k("ours", "decode", "Q5_K", "rows in place", "ours", "mca_dec_q5_K", 4, 1, 256),
    _k("ours", "decode", "Q5_K", "x8", "ours", "mca_x8dec_q5_K", 8, 1, 256),
    _k("llama.cpp", "decode", "Q5_K", "rows in place", "quants.c", "ggml_vec_dot_q5_K_q8_K", 1, 1, 256),
    _k("llama.cpp", "decode", "Q5_K", "8x4 repack", "repack.cpp", "ggml_gemv_q5_K_8x4_q8_K", 8, 1, 256),
    _k("ours", "decode", "IQ4_XS", "rows in place", "ours", "mca_dec_iq4_xs", 4, 1, 256),
    _k("ours", "decode", "IQ4_XS", "x8", "ours", "mca_x8dec_iq4_xs", 8, 1, 256),
    _k("llama.cpp", "decode", "IQ4_XS", "rows in place", "quants.c", "ggml_vec_dot_iq4_xs_q8_K", 1, 1, 256),
    _k("ours", "prefill", "Q8_0", "x8, 8 columns, a row half at a time", "ours", "mca_x8pre_q8_0", 4, 8, 32),
    _k("llama.cpp", "prefill", "Q8_0", "4x4 repack, 4 columns", "repack.cpp", "ggml_gemm_q8_0_4x4_q8_0", 4, 4, 32),
    _k("ours", "prefill", "Q4_0", "x8, 8 columns, a row half at a time", "ours", "mca_x8pre_q4_0", 4, 8, 32),
    _k("llama.cpp", "prefill", "Q4_0", "4x4 repack, 16 columns", "repack.cpp", "ggml_gemm_q4_0_4x4_q8_0", 4, 16, 32),
    _k("ours", "prefill", "Q4_K", "x8, 4 columns, a row half at a time", "ours", "mca_x8pre_q4_K", 4, 4, 256),
    _k("llama.cpp", "prefill", "Q4_K", "8x4 repack, 4 columns", "repack.cpp", "ggml_gemm_q4_K_8x4_q8_K", 8, 4, 256),
    _k("ours", "prefill", "Q6_K", "x8, 4 columns, a row half at a time", "ours", "mca_x8pre_q6_K", 4, 4, 256),
    _k("llama.cpp", "prefill", "Q6_K", "8x4 repack, 4 columns", "repack.cpp", "ggml_gemm_q6_K_8x4_q8_K", 8, 4, 256),
]
K_COLS = "rows in place, passes of 4 columns (k_cols: unpacked and transposed once per super-block)"
KERNELS += [_k("ours", "prefill", q, K_COLS, "ours", f"mca_kcols_{q}", 4, 4, 256) for q in ("Q4_K", "Q5_K", "Q6_K", "IQ4_XS")]
KERNELS += [_k("ours", "prefill", "Q5_K", "x8, 4 columns, a row half at a time", "ours", "mca_x8pre_q5_K", 4, 4, 256),
            _k("ours", "prefill", "IQ4_XS", "x8, 4 columns, a row half at a time", "ours", "mca_x8pre_iq4_xs", 4, 4,
               256)]
KERNELS += [_k("llama.cpp", "prefill", "Q5_K", "8x4 repack, 4 columns", "repack.cpp", "ggml_gemm_q5_K_8x4_q8_K", 8, 4,
               256)]
KERNELS += a76_float.float_kernels(_k)  # F32/F16/BF16 products, attention's p x V (bench/a76_float.py)
QUICK = {"mca_dec_q8_0", "mca_dec_q4_0", "mca_x8dec_q4_0", "mca_x8pre_q4_0"}


def ours_harness(names) -> str:
    lines = ['#include "matmul_neon.c"']
    names = [n for n in names if n.startswith("mca_")]
    for n in dict.fromkeys(names):
        args, call = OURS_CALLS[n[len("mca_"):]]
        lines.append(f"__attribute__((flatten)) void {n}{args} {{ {call}; }}")
    return "\n".join(lines) + "\n"


def llama_src(path: str | None = None, fetch: bool = True) -> str | None:
    """The ggml/ directory of the peer's source distribution (downloaded and unpacked once), or None."""
    if path:
        return path
    if os.environ.get("KESTREL_LLAMA_SRC"):
        return os.environ["KESTREL_LLAMA_SRC"]
    dest = os.path.expanduser(f"~/.cache/kestrel-bench/llama-src/{PEER_VERSION}")
    ggml = os.path.join(dest, "ggml")
    if os.path.exists(os.path.join(ggml, "src", "ggml-cpu", "arch", "arm", "quants.c")):
        return ggml
    if not fetch:
        return None
    # the test support code's copy of the same sdist (tests/support/llama_convert.py), when it has one
    cached = os.path.expanduser(os.path.join(os.environ.get("KESTREL_LLAMA_SDIST_DIR", "~/.cache/kestrel-bench/sdist"),
                                             f"llama_cpp_python-{PEER_VERSION}.tar.gz"))
    with tempfile.TemporaryDirectory() as d:
        if os.path.exists(cached):
            tgz = cached
        else:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-binary", ":all:", "--no-deps",
                            f"llama-cpp-python=={PEER_VERSION}", "-d", d], check=True)
            (tgz,) = glob.glob(os.path.join(d, "*.tar.gz"))
        with tarfile.open(tgz) as t:
            pre = f"llama_cpp_python-{PEER_VERSION}/vendor/llama.cpp/"
            members = [m for m in t.getmembers() if m.name.startswith(pre + "ggml/") and not m.issym()]
            for m in members:
                m.name = m.name[len(pre):]
            os.makedirs(dest, exist_ok=True)
            t.extractall(dest, members=members, filter="data")
    return ggml


def sdots(loop: list[str]) -> int:
    return sum(1 for ln in loop if ln.split()[0] in ("sdot", "udot"))


def measure(kernels: list[Kernel], ggml: str | None, ours_src: str = OURS_SRC,
            gcc: bool = False, strict: bool = True) -> dict[Kernel, dict[str, float]]:
    """Kernel -> {'a76': cycles per 32 weights (x column), 'a55': ..., 'insns': instructions per 32}. Not strict:
    a kernel whose inner loop is not one whole iteration of its tile (GCC leaves a sub-loop rolled) is left out."""
    asm: dict[str, dict[str, list[str]]] = {}
    mine = [k.func for k in kernels if k.src == "ours" and k.qtype not in a76_float.FLOAT_QTYPES]
    mine_float = [k.func for k in kernels if k.src == "ours" and k.qtype in a76_float.FLOAT_QTYPES]
    if mine_float:  # GCC's code, the library's compiler (bench/a76_float.py says why not clang's here)
        asm["ours-gcc"] = mca.functions(mca.compile_asm(ours_harness(mine_float), [ours_src], flags=OURS_FLAGS,
                                                        gcc=True))
    if mine:
        asm["ours"] = mca.functions(mca.compile_asm(ours_harness(mine), [ours_src], flags=OURS_FLAGS, gcc=gcc))
        # the helpers the tile kernels call out of line (the build compiles each file on its own, no LTO)
        asm["ours"].update({k: v for k, v in mca.functions(mca.compile_asm(
            '#include "quant.c"\n', [ours_src], flags=OURS_FLAGS, gcc=gcc)).items() if k not in asm["ours"]})
    if ggml:
        inc = [os.path.join(ggml, "src", "ggml-cpu"), os.path.join(ggml, "src"), os.path.join(ggml, "include")]
        for src, text, cxx in (("quants.c", '#include "arch/arm/quants.c"', False),
                               ("repack.cpp", '#include "arch/arm/repack.cpp"', True),
                               ("vec.cpp", '#include "vec.cpp"', True), ("sgemm.cpp", '#include "llamafile/sgemm.cpp"', True),
                               ("llama_wrap", a76_float.LLAMA_WRAP, True)):
            if any(k.src == src for k in kernels):
                asm[src] = mca.functions(mca.compile_asm(text + "\n", inc, cxx=cxx))
    out = {}
    for k in kernels:
        if k.src not in asm and not (k.src == "ours" and "ours-gcc" in asm):
            continue
        src = "ours-gcc" if k.src == "ours" and k.qtype in a76_float.FLOAT_QTYPES else k.src
        body = mca.find_function(asm[src], k.func)
        if k.qtype in a76_float.FLOAT_QTYPES:  # float kernels: FMA lanes (bench/a76_float.py)
            loops = mca.innermost_loops(body)
            if not loops:
                raise ValueError(f"{k.func}: no loop found")
            loop = mca.splice_calls(max(loops, key=a76_float.float_macs), asm[src])
            macs = a76_float.float_macs(loop)
        else:
            # k_cols copies a column's nr running sums with a memcpy of nr x 4 bytes (nr is not constant there)
            loop = mca.splice_calls(mca.pick_loop(body), asm[k.src], ignore=("memcpy",) if k.layout == K_COLS else ())
            macs = sdots(loop) * 16
        blocks, rem = divmod(macs, k.macs)
        if blocks < 1 or rem:
            if not strict:
                continue
            raise ValueError(f"{k.func}: inner loop has {macs} multiply-adds, not a multiple of a block's "
                             f"{k.macs}")
        per32 = blocks * k.macs / 32
        res = {"insns": len(loop) / per32, "blocks": blocks}
        for core in ("a76", "a55"):
            res[core] = mca.mca(loop, core).cycles / per32
        out[k] = res
    return out


# ---- the board model ----

@dataclass(frozen=True)
class Shape:
    name: str
    mats: tuple[tuple[str, int, int], ...]  # (role, rows, n) per layer: weights read per token
    layers: int
    head: tuple[int, int]                   # output head (vocab, hidden)
    heads: int = 0                          # attention geometry (bench/a76_context.py): query heads, KV heads,
    kv_heads: int = 0                       # head_dim
    head_dim: int = 0


QWEN3_1_7B = Shape("Qwen3-1.7B", (("attn", 2048, 2048), ("attn", 1024, 2048), ("attn_v", 1024, 2048),
                                  ("attn", 2048, 2048), ("ffn", 6144, 2048), ("ffn", 6144, 2048),
                                  ("ffn_down", 2048, 6144)), 28, (151936, 2048), 16, 8, 128)
QWEN3_4B = Shape("Qwen3-4B", (("attn", 4096, 2560), ("attn", 1024, 2560), ("attn_v", 1024, 2560),
                              ("attn", 2560, 4096), ("ffn", 9728, 2560), ("ffn", 9728, 2560),
                              ("ffn_down", 2560, 9728)), 36, (151936, 2560), 32, 8, 128)
QWEN3_30B_A3B = Shape("Qwen3-30B-A3B (8 of 128 experts)", (("attn", 4096, 2048), ("attn", 512, 2048),
                                                           ("attn_v", 512, 2048), ("attn", 2048, 4096),
                                                           ("expert", 8 * 768, 2048), ("expert", 8 * 768, 2048),
                                                           ("expert_down", 8 * 2048, 768)), 48, (151936, 2048),
                      32, 4, 128)
# not in report's weight table (hidden 576 is no multiple of 256: no K-quant file); bench/a76_context.py's
SMOLLM2_135M = Shape("SmolLM2-135M", (("attn", 576, 576), ("attn", 192, 576), ("attn_v", 192, 576), ("attn", 576, 576),
                                      ("ffn", 1536, 576), ("ffn", 1536, 576), ("ffn_down", 576, 1536)), 30,
                     (49152, 576), 9, 3, 64)


def file_types(ftype: str, role: str) -> list[tuple[str, float]]:
    """(type, share) of a matrix in a file: Q4_K_M as llama.cpp's quantizer writes it, roughly (attn_v and ffn_down
    at Q6_K in about half of the layers, the head at Q6_K), the others uniform."""
    if ftype != "Q4_K_M":
        return [(ftype, 1.0)]
    if role in ("attn_v", "ffn_down", "expert_down"):
        return [("Q6_K", 0.5), ("Q4_K", 0.5)]
    return [("Q6_K", 1.0)] if role == "head" else [("Q4_K", 1.0)]


def predict(costs: dict[tuple[str, str, str], float], shape: Shape, ftype: str, side: str, board: dict) -> dict:
    """Decode and prefill tok/s of the weight products of one token. costs: (side, kind, qtype) -> cycles/32."""
    hz = board["cores"] * board["ghz"] * 1e9
    mats = [(role, r * n, shape.layers) for role, r, n in shape.mats] + [("head", shape.head[0] * shape.head[1], 1)]
    dec = pre = byt = comp = 0.0
    for role, w, count in mats:
        for q, share in file_types(ftype, role):
            kind_q = (side, "decode", q)
            if kind_q not in costs:
                return {}
            ww = w * count * share
            cyc = ww / 32 * costs[kind_q]
            b = ww * BYTES_PER_WEIGHT[q]
            dec += max(cyc / hz, b / (board["bw"] * 1e9))
            comp += cyc / hz
            byt += b
            pre_key = (side, "prefill expert", q)  # a MoE expert's tokens read its rows in place (moe_costs)
            if not (role.startswith("expert") and pre_key in costs):
                pre_key = (side, "prefill", q)
            pre += ww / 32 * costs.get(pre_key, float("nan")) / hz
    bw_limit = board["bw"] * 1e9 / byt
    return {"decode": 1 / dec, "bw_limit": bw_limit, "compute_limit": 1 / comp, "share": (1 / dec) / bw_limit, "prefill": 1 / pre,
            "gb": byt / 1e9}


def board_costs(res: dict[Kernel, dict[str, float]]) -> dict[tuple[str, str, str], float]:
    """The kernel each side runs on the board per (kind, qtype): ours x8 where it exists for a dense model (else
    in place), llama.cpp's repacked one where it repacks (else its in-place dot)."""
    out: dict[tuple[str, str, str], float] = {}
    for k in sorted(res, key=lambda k: 0 if k.layout.startswith("rows in place") else 1):
        out[(k.side, k.kind, k.qtype)] = res[k]["a76"]
    return out


def moe_costs(res: dict[Kernel, dict[str, float]]) -> dict[tuple[str, str, str], float]:
    """As board_costs, but our experts are read in place (the row layout), as the MoE layer does."""
    out = board_costs(res)
    for k, r in res.items():
        if k.side == "ours" and k.kind == "decode" and k.layout == "rows in place":
            out[("ours", "decode", k.qtype)] = r["a76"]
        if k.side == "ours" and k.layout == K_COLS:
            out[("ours", "prefill expert", k.qtype)] = r["a76"]
    return out


def report(res: dict[Kernel, dict[str, float]], board: dict, before: dict | None = None,
           label: str = "A76 before") -> str:
    """The kernel table (with the A76 cycles of another checkout's kernels, `before`, when given) and the board's."""
    bcol = f" {label} |" if before else ""
    lines = [f"| kind | type | code | layout (tile, blocks / iteration) |{bcol} A76 cycles / 32 w | A55 cycles / 32 w | "
             "insns / 32 w | ours / llama.cpp (A76) |", "| --- | --- | --- | --- |" + (" ---: |" if before else "") +
             " ---: | ---: | ---: | --- |"]
    for k, r in res.items():
        bval = ""
        if before:
            bval = f" {before[k]['a76']:.2f} |" if k in before else " |"
        ratio = ""
        if k.side == "ours":
            peers = [(p.layout, rr["a76"]) for p, rr in res.items()
                     if p.side != "ours" and p.kind == k.kind and p.qtype == k.qtype]
            ratio = ", ".join(f"{r['a76'] / c:.2f}x {lay}" for lay, c in peers)
        name = a76_float.DISPLAY.get(k.func, k.func.removeprefix("mca_"))
        lines.append(f"| {k.kind} | {k.qtype} | {k.side} `{name}` | {k.layout} "
                     f"({k.rows}x{k.cols}, {r['blocks']:.0f}) |{bval} "
                     f"{r['a76']:.2f} | {r['a55']:.2f} | {r['insns']:.1f} | {ratio} |")
    lines += ["", f"Board: {board['cores']} A76 at {board['ghz']} GHz, {board['bw']} GB/s (weight products only).", "",
              "| shape | file | code | GB / token | bandwidth limit tok/s | compute limit tok/s | decode tok/s | "
              "of the bandwidth limit | prefill tok/s |", "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for shape, costs in ((QWEN3_1_7B, board_costs(res)), (QWEN3_4B, board_costs(res)),
                         (QWEN3_30B_A3B, moe_costs(res))):
        for ftype in ("Q4_0", "Q8_0", "Q4_K_M"):
            for side in ("ours", "llama.cpp"):
                p = predict(costs, shape, ftype, side, board)
                if p:
                    lines.append(f"| {shape.name} | {ftype} | {side} | {p['gb']:.2f} | {p['bw_limit']:.1f} | "
                                 f"{p['compute_limit']:.1f} | {p['decode']:.1f} | {p['share']:.0%} | {p['prefill']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="our Q8_0/Q4_0 kernels only, no llama.cpp source")
    ap.add_argument("--llama-src", help="llama.cpp's ggml/ directory (default: the peer's sdist, fetched once)")
    ap.add_argument("--ours-src", default=OURS_SRC, help="our kernels' sources (another checkout's, to compare)")
    ap.add_argument("--before", help="another checkout's kernel sources: their A76 cycles as a column")
    ap.add_argument("--gcc", action="store_true", help="our kernels as the board's GCC compiles them, as that column")
    ap.add_argument("--bw", type=float, default=20.0, help="board read bandwidth, GB/s")
    ap.add_argument("--ghz", type=float, default=2.4)
    ap.add_argument("--cores", type=int, default=4)
    ap.add_argument("--no-context", action="store_true", help="without the decode-at-context and vision tables")
    a = ap.parse_args(argv)
    kernels = [k for k in KERNELS if k.func in QUICK] if a.quick else KERNELS
    ggml = None if a.quick else llama_src(a.llama_src)
    res = measure(kernels, ggml, a.ours_src)
    before = None
    if a.before or a.gcc:
        before = measure([k for k in kernels if k.side == "ours"], None, a.before or OURS_SRC, gcc=a.gcc,
                         strict=False)
    label = ("A76 before" if a.before else "A76") + (" (GCC)" if a.gcc else "")
    board = {"bw": a.bw, "ghz": a.ghz, "cores": a.cores}
    print(report(res, board, before, label))
    if not (a.quick or a.no_context):
        import a76_context  # imports this module: only here
        print("\n" + a76_context.context_report(res, board, a76_context.measure(ggml, a.ours_src, a.cores)))
        import a76_vision  # imports this module: only here
        print("\n" + a76_vision.vision_report(res, board))
    return 0


if __name__ == "__main__":
    sys.exit(main())
