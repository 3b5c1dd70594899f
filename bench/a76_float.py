"""The float kernels of bench/a76_model.py's table: F32/F16/BF16 weight products (decode: one column; prefill: the
multi-token tiles) and attention's probability x value tiles over float16 and float32 caches, ours and
llama.cpp's equivalents on a Cortex-A76, through the same llvm-mca machinery (bench/a76_mca.py).

Policy:
- Ours: the dotprod level's float tiles (matmul_float.inc, 4 rows x NCF = 6 columns for F32; F16 and BF16 from 6
  columns on two passes of 2 rows x NCF16H = 8 columns, 4 rows x NCF16 = 5 below that; f32 FMA chains; F16 and
  BF16 widened to f32 in registers: fcvtl, shll #16) and its probability x value tile (matmul_pv.inc, PVR = 6 rows
  x PVC x 4 = 16 values; a float16 V from 7 rows on PVR16 = 8 rows x 8 values, the f16 value rows widened),
  called with the shapes as constants (n = 2048, hd = 128, 256 positions per block as attn_task does).
- llama.cpp on an A76 (fp16 vector arithmetic, no bf16, no SVE; 0.3.36's ggml-cpu): F32 and F16 prefill are
  llamafile's tinyBLAS gemm<4, 6> (sgemm.cpp; F16 as fp16 FMAs, `fmla v.8h`, the activations converted to f16),
  decode ggml_vec_dot_f32 / ggml_vec_dot_f16 (vec.cpp; f16 again in fp16 arithmetic); BF16 has no ARM tinyBLAS and
  no NEON path in ggml_vec_dot_bf16 (widen, fmul, double-precision sum: vec.cpp's generic loop), so it is both its
  decode and its prefill kernel. Attention over an f16 V cache: one query row at a time ggml_vec_mad_f16 (vec.h,
  the accumulator itself f16, decode's flash-attention path) and, for prefill's tiled path, simd_gemm (simd-gemm.h)
  over V converted to f32 first, whose tile on aarch64 is 2 x 2 vectors (GEMM_RM/RN: the header tests
  __ARM_NEON__, which aarch64 compilers do not define, so the 4 x 4 tile meant for NEON is not used); the
  conversion pass is not counted here.
- Compiler: ours are GCC's code here (aarch64-linux-gnu-gcc -O3 -mcpu=cortex-a76, the compiler the library is built
  with), not clang's as for the rest of the table: clang leaves the tiles' accumulator arrays (a[4][NCF],
  a[PVR][PVC]) in memory, a load and a store around every FMA of a loop that does one column at a time (it does not
  honour the `#pragma GCC unroll` of the column loop after inlining), which no build of the library runs.
  llama.cpp's are clang's (C++; the cross g++ is not installed), its loops plain enough for either compiler.
- Unit: cycles per 32 multiply-adds (32 weights x 1 column; 32 value elements x 1 row), from the loop's FMA lanes
  (`fmla v.4s` 4, `fmla v.8h` 8; a loop with no FMA counts its vector fmul lanes: llama.cpp's BF16 loop), checked to
  be a whole number of the tile's rows x columns x k-step. fp16 FMAs do twice the lanes per instruction of
  ours but round every product and sum to 11 bits; ours stay f32 (the twins' tolerance), so the ratio for F16
  is the price of f32 accumulation.
"""
from __future__ import annotations

import re

FLOAT_QTYPES = ("F32", "F16", "BF16", "F16 cache", "F32 cache")
NCF16H = 8  # matmul_neon.inc's columns per pass of the 16-bit weight types' 2-row tiles (F32: 4 rows x 6)
PVR16 = 8  # matmul_neon.inc's rows per float16 p x V tile (8 values wide; float32: 6 rows x 16 values)
N, HD, BLOCK_KV = 2048, 128, 256

_WF = "(const uint8_t *w, size_t rb, const void *a, float *o)"
_PV = "(const float *p, const uint8_t *V, float *o)"
OURS_FLOAT_CALLS = {
    **{f"dec_{t}": (_WF, f"{t}_neondot(w, rb, 0, 4, {N}, a, 0, 1, o, 4)") for t in ("f32", "f16", "bf16")},
    **{f"pre_{t}": (_WF, f"{t}_neondot(w, rb, 0, 4, {N}, a, 0, {6 if t == 'f32' else NCF16H}, o, 4)")
       for t in ("f32", "f16", "bf16")},
    "pv_f16": (_PV, f"pv_f16_neondot(p, {BLOCK_KV}, {PVR16}, V, {BLOCK_KV}, {HD}, o, {HD})"),
    "pv_f32": (_PV, f"pv_f32_neondot(p, {BLOCK_KV}, 6, V, {BLOCK_KV}, {HD}, o, {HD})"),
}

# llama.cpp's inline kernels, instantiated by wrappers (C++, over ggml-cpu's headers)
LLAMA_WRAP = f"""#include "vec.h"
#include "simd-gemm.h"
extern "C" void mca_vec_mad_f16(int n, ggml_fp16_t *y, const ggml_fp16_t *x, float v) {{ ggml_vec_mad_f16(n, y, x, v); }}
extern "C" void mca_simd_gemm_pv(float *C, const float *A, const float *B, int K) {{  /* K: positions, not folded */
    simd_gemm_ukernel<GEMM_RM, GEMM_RN>(C, A, B, K, {HD});
}}
"""
TINYBLAS_F32 = "_ZN12_GLOBAL__N_18tinyBLASILi4E13__Float32x4_tS1_fffE4gemmILi4ELi6ELi4EEEvlll"
TINYBLAS_F16 = "_ZN12_GLOBAL__N_18tinyBLASILi8E13__Float16x8_tS1_ttfE4gemmILi4ELi6ELi4EEEvlll"
DISPLAY = {TINYBLAS_F32: "tinyBLAS<4, float32x4_t>::gemm<4, 6>", TINYBLAS_F16: "tinyBLAS<8, float16x8_t>::gemm<4, 6>",
           "mca_vec_mad_f16": "ggml_vec_mad_f16", "mca_simd_gemm_pv": "simd_gemm_ukernel<GEMM_RM, GEMM_RN>"}


def float_kernels(k):
    """The float rows of the kernel table; k is a76_model's Kernel constructor (side, kind, qtype, layout, src, func,
    rows, cols, k-step)."""
    out = []
    for q, t in (("F32", "f32"), ("F16", "f16"), ("BF16", "bf16")):
        out.append(k("ours", "decode", q, "rows in place, f32 FMA, GCC", "ours", f"mca_dec_{t}", 4, 1, 4))
        peer = {"F32": "ggml_vec_dot_f32", "F16": "ggml_vec_dot_f16", "BF16": "ggml_vec_dot_bf16"}[q]
        how = {"F32": "f32 FMA", "F16": "fp16 FMA", "BF16": "widen, fmul, f64 sum"}[q]
        out.append(k("llama.cpp", "decode", q, f"rows in place, {how}", "vec.cpp", peer, 1, 1, 4))
        rows, cols = (4, 6) if q == "F32" else (2, NCF16H)  # matmul_neon.inc: NCF; NCF16H (a pass of 2 rows)
        widened = "" if q == "F32" else ", 2 passes of 2 rows, widened"
        out.append(k("ours", "prefill", q, f"rows in place, {cols} columns{widened}, f32 FMA, GCC", "ours",
                     f"mca_pre_{t}", rows, cols, 4))
        if q == "BF16":
            out.append(k("llama.cpp", "prefill", q, "rows in place, 1 column (no ARM tinyBLAS)", "vec.cpp", peer,
                         1, 1, 4))
        else:
            out.append(k("llama.cpp", "prefill", q, f"tinyBLAS 4x6, {'fp16' if q == 'F16' else 'f32'} FMA",
                         "sgemm.cpp", TINYBLAS_F16 if q == "F16" else TINYBLAS_F32, 4, 6, 4))
    out += [
        k("ours", "attention p x V", "F16 cache", f"{PVR16} rows x 8 values, widened, f32 FMA, GCC", "ours",
          "mca_pv_f16", PVR16, 8, 1),
        k("llama.cpp", "attention p x V", "F16 cache", "1 row (decode), fp16 accumulator", "llama_wrap",
          "mca_vec_mad_f16", 1, 8, 1),
        k("llama.cpp", "attention p x V", "F16 cache", "simd_gemm 2x2 vectors (prefill; V as f32 first)",
          "llama_wrap", "mca_simd_gemm_pv", 2, 8, 1),
        k("ours", "attention p x V", "F32 cache", "6 rows x 16 values, f32 FMA, GCC", "ours", "mca_pv_f32", 6, 16, 1),
        k("llama.cpp", "attention p x V", "F32 cache", "simd_gemm 2x2 vectors", "llama_wrap", "mca_simd_gemm_pv",
          2, 8, 1),
    ]
    return out


_LANES = re.compile(r"\bv\d+\.(\d+)[hsd]\b")


def float_macs(loop: list[str]) -> int:
    """Multiply-adds of one iteration: FMA lanes (fmla, vector or by element; scalar fmadd 1), or, in a loop with no
    FMA at all, its vector fmul lanes."""
    fma = mul = 0
    for ln in loop:
        op = ln.split()[0]
        m = _LANES.search(ln)
        lanes = int(m.group(1)) if m else 1
        if op == "fmla":
            fma += lanes
        elif op == "fmadd":
            fma += 1
        elif op == "fmul" and m:
            mul += lanes
    return fma or mul
