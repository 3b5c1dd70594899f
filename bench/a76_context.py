"""Decode at context on the board (issue 26): bench/a76_model.py's weight products plus attention over an f16 KV
cache at position P, ours against llama.cpp's two decode paths (flash attention: llama-server's `-fa auto` turns it
on for CPU; without: llama-cpp-python's default), in Cortex-A76 cycles of the code each side runs, bus-bounded.

    python bench/a76_context.py [--llama-src DIR] [--bw 20] [--ghz 2.4] [--cores 4]
    (bench/a76_model.py prints the same tables after its own unless --no-context)

Policy:
- Per layer, token at position P (P cached positions): K and V once, 2 x n_kv x head_dim x P x 2 bytes, are the
  bandwidth limit's share (kv_bytes); attention = max(compute as each side splits it over the cores, DRAM bytes /
  bandwidth), added to a76_model.predict's weight time (both on one bus).
- Ours (ops.c attn_task as kq_attention splits decode): a task is a KV head and g of its query heads (the group,
  split into the fewest equal parts that give every thread a task: SmolLM2's 3 on 4 cores become 1), keys in blocks
  of 256; tasks whole on a core, so ceil(tasks / cores) of them in a row. Per key: the scores, f16_neondot with the
  keys as weight rows and the g query rows as columns (ft_cols at g up to 5; from 6 two passes of 2 keys x g,
  ft_cols_h), its k loop(s) x hd/4 plus the rest of a 4-key iteration (zeroing, lane sums, stores); p x V,
  pv_f16_neondot at g rows (up to 6: 16-value slices; 7 and 8: one tile of 8-value slices), its loop over
  positions x the slices (a slice's accumulator loads and stores, per 256 keys, not counted); per score attn_task's
  exp loop (4 lanes) and kq_max's loop (as a function of its own: attn_task unrolls it for a block's 256); its sums
  and per-block bookkeeping not counted.
  GCC's code (bench/a76_float.py says why); the tiles called with the shape as constants, as a76_float's are.
- llama.cpp 0.3.36, f16 K and V, one token. FA (ggml-cpu/ops.cpp ggml_compute_forward_flash_attn_ext_f16): the
  split-KV path from n_kv >= 512, each thread ceil(n_kv / threads) cache cells for every query head in turn (masked
  cells skipped); per cell and head ggml_vec_dot_f16 (q as f16, fp16 FMAs), one glibc expf, ggml_vec_mad_f16 into
  the f16 accumulator VKQ16. No FA: mul_mat(K, q) (F16: tinyBLAS declines n < 2, the tiled path is K-quants only,
  so ggml_vec_dot_f16 per cell and head), soft_max (its exp pass ggml_vec_soft_max_f32 counted; the scale/mask, max
  and normalise passes not), mul_mat(V^T, p) (V stored transposed: ggml_vec_dot_f16 over n_kv per value row and
  head); three ops in a row, each max(compute, bytes / bandwidth), all n_kv cells (the used ones padded to 256,
  llama_kv_cache::get_n_kv) computed. Clang's code (-DNDEBUG as released; lengths at run time as ggml passes them),
  timed as a loop over calls: inner loop x trips + the rest of a call. Not counted: FA's other scalar work per
  score (mask, scale, compare, sum: about 10 instructions), the rescale when the max grows, the indirect call, q and
  p converted to f16, the partials' reduction.
- llvm-mca with stores' base writeback split off (a76_mca.split_store_writeback: the N1 model makes it wait for
  the store's data, serialising ggml_vec_mad_f16 and ops.c's exp loop).
- DRAM: K and V once, unless a side reads rows again after more distinct bytes than the A76 cluster's caches hold
  went by (CACHE_BYTES, 4 x 512 KiB L2 + 3 MiB L3; a rule of thumb): FA walks its chunk once per query head, cached
  while all threads' chunks of a KV head (P x hd x 4 bytes) fit, else `group` reads; no FA re-reads 16 value rows a
  thread per head (threads x 16 x n_kv x 2 bytes); ours reads a block once for its g rows, and a split group's tasks
  in later rounds (equal tasks claimed in order) read it again when a round's distinct KV heads do not fit.
- Board as a76_model's (4 A76, 2.4 GHz, 20 GB/s assumed); the A76 only.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import a76_float  # noqa: E402  (siblings; bench/ is not a package)
import a76_mca as mca  # noqa: E402
import a76_model  # noqa: E402

CONTEXTS = (0, 1024, 8192, 32768)
KV_BLOCK = 256          # ops.c's positions per key/value block
LLAMA_KV_PAD = 256      # llama_kv_cache::get_n_kv pads the cells in use to a multiple of 256
FA_SPLIT_MIN = 512      # ops.cpp: the split-KV decode path from n_kv >= 512
CACHE_BYTES = 4 * 512 * 1024 + 3 * 1024 * 1024  # RK3588: A76 L2 512 KiB each, 3 MiB L3
SIDES = ("ours", "llama.cpp FA", "llama.cpp no FA")
LIBM = "/usr/aarch64-linux-gnu/lib/libm.so.6"  # Debian's arm64 glibc (libc6-arm64-cross): the board's expf


def shapes() -> list[tuple[a76_model.Shape, str]]:
    """(shape, weight-cost flavour) of the table: MoE experts read in place ("moe"), dense x8 ("dense")."""
    return [(a76_model.SMOLLM2_135M, "dense"), (a76_model.QWEN3_1_7B, "dense"), (a76_model.QWEN3_4B, "dense"),
            (a76_model.QWEN3_30B_A3B, "moe")]


def kv_bytes(shape: a76_model.Shape, pos: int) -> int:
    """K and V bytes (f16) one decoded token reads at position pos, all layers."""
    return shape.layers * 2 * shape.kv_heads * shape.head_dim * pos * 2


ATT_WIDEN = 2  # ops.c: a task's widening of a block in query rows' work


def ours_group(heads: int, kv_heads: int, cores: int) -> int:
    """Query heads per task as kq_attention picks them for one token (ops.c: the largest divisor of the group with
    the least ceil(tasks / cores) x (ATT_WIDEN + group))."""
    rep = heads // kv_heads
    cost = {g: -(-kv_heads * (rep // g) // cores) * (ATT_WIDEN + g) for g in range(rep, 0, -1) if rep % g == 0}
    return min(cost, key=lambda g: (cost[g], -g))


def ours_reads(kv_heads: int, ngroups: int, cores: int, head_bytes: int) -> float:
    """DRAM reads of the cache per token, in units of the cache: task j (KV head j // ngroups) runs in round
    j // cores (equal tasks claimed in order); a KV head whose tasks span rounds r < r' is read again in r' when
    round r's distinct KV heads (head_bytes each) exceed the caches."""
    n = kv_heads * ngroups
    kv_in = [{j // ngroups for j in range(n) if j // cores == r} for r in range(_cdiv(n, cores))]
    reads = 0
    for kv in range(kv_heads):
        rs = sorted({j // cores for j in range(kv * ngroups, (kv + 1) * ngroups)})
        reads += 1 + sum(1 for r in rs[:-1] if len(kv_in[r]) * head_bytes > CACHE_BYTES)
    return reads / kv_heads


# ---- kernel costs ----

def _wrappers_ours(geoms) -> str:
    lines = ['#include "matmul_neon.c"']
    for hd, g in sorted(geoms):
        lines += [
            # one block's scores: rows (keys) 4 at a time, the g query rows as columns, as kq_f16_tiles calls it
            f"__attribute__((flatten)) void ctx_kq_{hd}_{g}(const uint8_t *K, const float *x, float *o) {{\n"
            f"    for (int64_t r0 = 0; r0 < {KV_BLOCK}; r0 += 4) f16_neondot(K, {2 * hd}, r0, 4, {hd}, x, 0, {g}, o, "
            f"{KV_BLOCK}); }}",
            f"__attribute__((flatten)) void ctx_pv_{hd}_{g}(const float *p, const uint8_t *V, float *o) {{\n"
            f"    pv_f16_neondot(p, {KV_BLOCK}, {g}, V, {KV_BLOCK}, {hd}, o, {hd}); }}"]
    # the softmax's max as attn_task calls it (inlined there, and unrolled where the block's bound is known)
    lines.append("float ctx_max(const float *p, int64_t n) { return kq_max(p, n); }")
    return "\n".join(lines) + "\n"


LLAMA_CTX_WRAP = """#include "vec.cpp"
/* calls as ggml makes them, per cache cell (FA, KQ) or value row (KQV), the length d at run time but a multiple
 * of the loops' 32 (head_dim and n_kv are), so the leftover loops fold away as they do not run */
extern "C" __attribute__((flatten)) void ctx_dot(const ggml_fp16_t *K, const ggml_fp16_t *q, float *s, int d32, int n) {
    const int d = 32 * d32;
    for (int i = 0; i < n; i++)
        ggml_vec_dot_f16(d, s + i, 0, (ggml_fp16_t *)K + (size_t)i * d, 0, (ggml_fp16_t *)q, 0, 1);
}
extern "C" __attribute__((flatten)) void ctx_mad(ggml_fp16_t *y, const ggml_fp16_t *V, const float *p, int d32, int n) {
    const int d = 32 * d32;
    for (int i = 0; i < n; i++) ggml_vec_mad_f16(d, y, V + (size_t)i * d, p[i]);
}
extern "C" __attribute__((flatten)) double ctx_soft_max(float *y, const float *x, float mx, int n) {
    return ggml_vec_soft_max_f32(n, y, x, mx);
}
"""


def lanes(loop: list[str]) -> int:
    """FMA lanes (multiply-adds) of instructions: a76_float's count without its fmul fallback."""
    return sum(a76_float.float_macs([ln]) for ln in loop if ln.split()[0] in ("fmla", "fmadd"))


def _mca(loop: list[str]) -> float:
    return mca.mca(loop, "a76", split_wb=True).cycles


def nest(body: list[str]) -> tuple[list[tuple[float, int]], float]:
    """A wrapper's loop over calls (the outermost loop around the inner loop with the most FMA lanes): ([(cycles,
    FMA lanes) per iteration of each inner loop with FMAs], cycles of the rest of one outer iteration, everything
    in no inner loop timed as one block; inner loops without FMAs, tails that do not run here, left out)."""
    lines, spans = mca.loop_spans(body)
    inner_all = mca.innermost(spans)
    best = max(inner_all, key=lambda s: lanes(mca.insns(lines[s[0]:s[1] + 1])), default=None)
    outer = [s for s in spans if best and s[0] <= best[0] and best[1] <= s[1] and s != best]
    if not outer:
        raise ValueError("no loop over calls around an inner loop")
    a, b = min(s[0] for s in outer), max(s[1] for s in outer)
    out, skip = [], set()
    for lo, hi in (s for s in inner_all if a <= s[0] and s[1] <= b):
        skip.update(range(lo, hi + 1))
        loop = mca.insns(lines[lo:hi + 1])
        if lanes(loop):
            out.append((_mca(loop), lanes(loop)))
    rest = mca.insns([ln for i, ln in enumerate(lines[a:b + 1], a) if i not in skip])
    if lanes(rest):
        raise ValueError(f"{lanes(rest)} FMA lanes outside the inner loops: a loop was unrolled")
    return out, _mca(rest)


def hot_path(raw: list[str]) -> list[str]:
    """Clang's loop with the most FMAs as it runs when only its own branch leaves it: from a loop header (clang's
    `Inner Loop Header` comment) through fall-throughs and unconditional jumps back to the header."""
    best: list[str] = []
    lines = mca._normalize(raw)
    at = {ln[:-1]: i for i, ln in enumerate(lines) if ln.endswith(":")}
    for h in (ln.split(":")[0].strip() for ln in raw if "Inner Loop Header" in ln):
        i, path = at[h] + 1, []
        while i < len(lines) and len(path) < 400 and lines[i] != h + ":":
            ln = lines[i]
            i += 1
            if ln.endswith(":"):
                continue
            path.append(ln)
            op, arg = (ln.split(None, 1) + [""])[:2]
            if op == "ret" or arg.split(",")[-1].strip() == h:  # leaves the function / the back edge
                break
            if op == "b":
                i = at[arg.strip()] + 1
        if path and path[-1] != "ret" and lanes(mca.insns(path)) > lanes(best):
            best = mca.insns(path)
    if not best:
        raise ValueError("no loop header with FMAs")
    return best


def expf_cost(lib: str = LIBM) -> float | None:
    """A76 cycles of glibc's expf as it returns for an ordinary argument (its code up to the first `ret`, the slow
    path's branch not taken), disassembled from the aarch64 libm; None without it."""
    tool = mca.tools()["mca"].replace("llvm-mca", "llvm-{}")
    if not (os.path.exists(lib) and shutil.which(tool.format("nm")) and shutil.which(tool.format("objdump"))):
        return None
    syms = subprocess.run([tool.format("nm"), "-D", "--defined-only", lib], capture_output=True, text=True).stdout
    addr = [int(s.split()[0], 16) for s in syms.splitlines() if s.split()[-1] in ("expf@@GLIBC_2.27", "expf")]
    if not addr:
        return None
    dis = subprocess.run([tool.format("objdump"), "-d", "--no-show-raw-insn", "--triple=aarch64",
                          f"--start-address={addr[0]}", f"--stop-address={addr[0] + 512}", lib],
                         capture_output=True, text=True).stdout
    # the argument from elsewhere (a score), not the last call's result; no `bl` (llvm-mca gives a call 100 cycles
    # of latency, which the `ret` then waits for)
    body = ["fmov\ts0, w9"]
    for m in re.finditer(r"^\s*[0-9a-f]+:\s+(\S+)[ \t]*(.*)$", dis, re.M):
        body.append(f"{m.group(1)}\t" + re.sub(r"\b(0x)?[0-9a-f]+ <[^>]*>", ".Lslow", m.group(2).split("//")[0]))
        if m.group(1) == "ret":
            return _mca(body)
    return None


def measure(ggml: str | None, ours_src: str = a76_model.OURS_SRC, cores: int = 4) -> dict:
    """A76 cycles of the attention kernels. Ours: ('score', hd, g) / ('pv', hd, g) per key for g rows (the group
    kq_attention picks on `cores` threads, and the whole group), 'softmax' per score. llama.cpp: 'dot' / 'mad' =
    (cycles per inner iteration, its multiply-adds, cycles of the rest of a call), 'soft_max' per score, 'expf' per
    call (None if not found)."""
    geoms = {(s.head_dim, g) for s, _ in shapes() for g in (ours_group(s.heads, s.kv_heads, cores),
                                                            s.heads // s.kv_heads)}
    out: dict = {}
    funcs = mca.functions(mca.compile_asm(_wrappers_ours(geoms), [ours_src], flags=a76_model.OURS_FLAGS, gcc=True))
    for hd, g in geoms:
        loops, rest = nest(funcs[f"ctx_kq_{hd}_{g}"])
        if sum(n for _, n in loops) != 4 * g * 4:  # each pass (a 4-row tile, or each 2-row half) a k-step of 4
            raise ValueError(f"scores {hd}/{g}: {[n for _, n in loops]} lanes per step, not {4 * g * 4}")
        out[("score", hd, g)] = (hd / 4 * sum(c for c, _ in loops) + rest) / 4
        pv = [(_mca(lp), lanes(lp)) for lp in mca.innermost_loops(funcs[f"ctx_pv_{hd}_{g}"]) if lanes(lp)]
        # one position of a column slice for each of the g rows, in passes of rows as tall as the tile: the slice
        # (16 values, or 8 in the 8-row float16 tile) is lanes / g wide, and hd / that many slices make a key
        width = sum(n for _, n in pv) // g
        if sum(n for _, n in pv) % g or width not in (8, 16) or hd % width:
            raise ValueError(f"p x V {hd}/{g}: {[n for _, n in pv]} lanes per position, not a slice of 8 or 16")
        out[("pv", hd, g)] = hd / width * sum(c for c, _ in pv)
    ops = mca.functions(mca.compile_asm('#include "ops.c"\n', [ours_src], flags=a76_model.OURS_FLAGS, gcc=True))
    loops = mca.innermost_loops(mca.find_function(ops, "attn_task"))
    def exp_scores(lp: list[str]) -> int:  # the vector exp: one 2^k per 4 scores, built by a shift of 23
        return 4 * sum(bool(re.match(r"shl\s+v\d+\.4s, v\d+\.4s, 23", ln)) for ln in lp)
    exp = [lp for lp in loops if exp_scores(lp)]

    def max_lanes(lp: list[str]) -> int:  # a compare per score (scalar) or fmaxnm's lanes
        return sum(ln.startswith("fcmpe") or bool(re.match(r"fmaxnm\s+s", ln)) for ln in lp) + 4 * sum(
            bool(re.match(r"fmaxnm\s+v\d+\.4s", ln)) for ln in lp)
    mx = [lp for lp in mca.innermost_loops(funcs["ctx_max"]) if max_lanes(lp) >= 8]
    mx = [min(mx, key=lambda lp: _mca(lp) / max_lanes(lp))] if mx else []  # branchy C: the path without a new max
    if len(exp) != 1 or len(mx) != 1:
        raise ValueError(f"attn_task: {len(exp)} vector exp loops, {len(mx)} max loops (expected one each)")
    out["softmax"] = _mca(exp[0]) / exp_scores(exp[0]) + _mca(mx[0]) / max_lanes(mx[0])
    if ggml:
        inc = [os.path.join(ggml, "src", "ggml-cpu"), os.path.join(ggml, "src"), os.path.join(ggml, "include")]
        lf = mca.functions(mca.compile_asm(LLAMA_CTX_WRAP, inc, cxx=True, flags=["-DNDEBUG"]))
        for name in ("dot", "mad"):
            loops, rest = nest(lf[f"ctx_{name}"])
            if len(loops) != 1 or loops[0][1] != 32:  # GGML_F16_STEP: 4 vectors of 8 halves
                raise ValueError(f"ggml_vec_{name}_f16: inner loops {loops}, expected one of 32 multiply-adds")
            out[name] = (loops[0][0], 32, rest)
        sm = hot_path(mca.find_function(lf, "ctx_soft_max"))
        stores = sum(1 for ln in sm if re.match(r"(str\s+q|st1\s)", ln))
        if stores != 1:
            raise ValueError(f"ggml_vec_soft_max_f32: {stores} vector stores per iteration, expected 1 (4 scores)")
        out["soft_max"] = _mca(sm) / 4
        out["expf"] = expf_cost()
    return out


# ---- the board model ----

def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _call(cost: tuple[float, int, float], n: int) -> float:
    """Cycles of one ggml_vec_*_f16 call over n elements: n / (elements per inner iteration) iterations + the rest."""
    cyc, macs, rest = cost
    return n / macs * cyc + rest


def attention(c: dict, shape: a76_model.Shape, pos: int, side: str, board: dict, group: int | None = None,
              cached: bool = False) -> dict:
    """One layer's attention for a token at position pos: seconds (compute and bus parts combined as the side runs
    them), compute seconds alone, DRAM bytes and those in units of one read of the cache (reads). group: ours with
    another group than kq_attention's; cached: every re-read hits the caches."""
    if pos <= 0:
        return {"s": 0.0, "compute_s": 0.0, "bytes": 0.0, "reads": 0.0}
    hz, bw = board["ghz"] * 1e9, board["bw"] * 1e9
    cores, hd, heads, kvh = board["cores"], shape.head_dim, shape.heads, shape.kv_heads
    rep = heads // kvh
    once = 2 * kvh * hd * pos * 2
    if side == "ours":
        g = group or ours_group(heads, kvh, cores)
        tasks = kvh * rep // g
        per_key = c[("score", hd, g)] + c[("pv", hd, g)] + g * c["softmax"]
        comp = _cdiv(tasks, cores) * pos * per_key / hz
        reads = 1 if cached else ours_reads(kvh, rep // g, cores, pos * hd * 4)
        return {"s": max(comp, once * reads / bw), "compute_s": comp, "bytes": once * reads, "reads": reads}
    n_kv = _cdiv(pos + 1, LLAMA_KV_PAD) * LLAMA_KV_PAD
    if side == "llama.cpp FA":
        per = _call(c["dot"], hd) + _call(c["mad"], hd) + (c["expf"] or 0.0)
        if n_kv >= FA_SPLIT_MIN:  # each thread a chunk of cells, every head; masked cells skipped
            comp = min(pos, _cdiv(n_kv, cores)) * heads * per / hz
        else:  # rows (heads) over the threads
            comp = _cdiv(heads, cores) * pos * per / hz
        reads = rep if pos * hd * 4 > CACHE_BYTES and not cached else 1
        return {"s": max(comp, once * reads / bw), "compute_s": comp, "bytes": once * reads, "reads": reads}
    # no FA: three ops, each bounded on its own; all n_kv cells computed and read
    nc0, nc1 = _cdiv(n_kv, 16), _cdiv(heads, 16)  # mul_mat's chunks of 16 x 16, or one per thread when too few
    dots = _cdiv(n_kv, cores) * heads if nc0 * nc1 < 4 * cores else _cdiv(nc0 * nc1, cores) * 16 * _cdiv(heads, nc1)
    kq = dots * _call(c["dot"], hd) / hz
    sm = _cdiv(heads, cores) * n_kv * c["soft_max"] / hz              # rows (heads) per thread
    kqv = _cdiv(hd, cores) * heads * _call(c["dot"], n_kv) / hz       # value rows per thread, all heads
    k_b = kvh * hd * n_kv * 2
    v_b = k_b * (rep if cores * 16 * n_kv * 2 > CACHE_BYTES and not cached else 1)
    return {"s": max(kq, k_b / bw) + sm + max(kqv, v_b / bw), "compute_s": kq + sm + kqv, "bytes": k_b + v_b,
            "reads": (k_b + v_b) / once}


def decode_at(c: dict, wcosts: dict, shape: a76_model.Shape, ftype: str, side: str, pos: int, board: dict,
              **kw) -> dict:
    """Decode tok/s at position pos: a76_model.predict's weight time plus every layer's attention; the bandwidth
    limit at pos (weights + K and V once) and the share of it reached."""
    w = a76_model.predict(wcosts, shape, ftype, "ours" if side == "ours" else "llama.cpp", board)
    if not w:
        return {}
    a = attention(c, shape, pos, side, board, **kw)
    t = 1 / w["decode"] + shape.layers * a["s"]
    limit = board["bw"] * 1e9 / (w["gb"] * 1e9 + kv_bytes(shape, pos))
    return {"decode": 1 / t, "limit": limit, "share": (1 / t) / limit, "attn": a}


def _k_ok(shape: a76_model.Shape) -> bool:  # K-quant rows need a multiple of 256 weights
    return all(n % 256 == 0 for _, _, n in shape.mats) and shape.head[1] % 256 == 0


def _k(p: int) -> str:
    return f"{p // 1024}K" if p else "0"


def context_report(res: dict, board: dict, c: dict) -> str:
    """The decode-at-context tables (res: a76_model.measure's kernels, for the weights; c: measure's)."""
    dense, moe = a76_model.board_costs(res), a76_model.moe_costs(res)
    geoms = sorted(k[1:] for k in c if isinstance(k, tuple) and k[0] == "score")
    sides = [sd for sd in SIDES if sd == "ours" or "dot" in c]
    ctx = [p for p in CONTEXTS if p]
    out = ["Attention kernels, A76 cycles per key of one task (g query rows; scores + p x V): " + "; ".join(
        f"hd {hd} g {g}: {c[('score', hd, g)]:.1f} + {c[('pv', hd, g)]:.1f}" for hd, g in geoms) +
        f"; softmax {c['softmax']:.2f} per score."]
    if "dot" in c:
        out.append("llama.cpp per call: " + ", ".join(
            f"ggml_vec_dot_f16 / ggml_vec_mad_f16 at {d}: {_call(c['dot'], d):.1f} / {_call(c['mad'], d):.1f}"
            for d in sorted({s.head_dim for s, _ in shapes()})) +
            f"; ggml_vec_dot_f16 {c['dot'][0]:.2f} per 32 MACs in its loop (+{c['dot'][2]:.1f} a call); soft_max"
            f" exp pass {c['soft_max']:.2f} per score; glibc expf " +
            (f"{c['expf']:.1f}" if c["expf"] else "not found (not counted)") + ".")
    out += ["", f"Board: {board['cores']} A76 at {board['ghz']} GHz, {board['bw']} GB/s; f16 KV cache. Decode tok/s "
            "at position P (P = 0: the weight products alone), the share of the bandwidth limit at P (weights + K and "
            "V once), that limit, and the cache's DRAM reads per token.", "",
            "| shape | file | code | " + " | ".join(f"P={_k(p)}" for p in CONTEXTS) + " | " +
            " | ".join(f"of limit {_k(p)}" for p in ctx) + " | limit tok/s " + "/".join(_k(p) for p in ctx) +
            " | KV reads " + "/".join(_k(p) for p in ctx) + " |",
            "| --- | --- | --- |" + " ---: |" * (len(CONTEXTS) + len(ctx)) + " --- | --- |"]
    for shape, flavour in shapes():
        for ftype in ("Q4_0", "Q8_0", "Q4_K_M"):
            if ftype == "Q4_K_M" and not _k_ok(shape):
                continue
            for side in sides:
                r = {p: decode_at(c, moe if flavour == "moe" else dense, shape, ftype, side, p, board)
                     for p in CONTEXTS}
                if r[0]:
                    out.append(f"| {shape.name} | {ftype} | {side} | " +
                               " | ".join(f"{r[p]['decode']:.1f}" for p in CONTEXTS) + " | " +
                               " | ".join(f"{r[p]['share']:.0%}" for p in ctx) + " | " +
                               "/".join(f"{r[p]['limit']:.1f}" for p in ctx) + " | " +
                               "/".join(f"{r[p]['attn']['reads']:.3g}" for p in ctx) + " |")
    p = ctx[-1]
    out += ["", f"Attention per token at P = {_k(p)}, all layers, ms: compute on {board['cores']} cores, reading its "
            "DRAM bytes, the two combined as the side runs them, and that if every re-read hit the caches:", "",
            "| shape | code | group | compute | KV read | attention | attention, re-reads cached |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for shape, _ in shapes():
        rep = shape.heads // shape.kv_heads
        for side in sides:
            groups = [None] if side != "ours" else [None] + ([rep] if ours_group(
                shape.heads, shape.kv_heads, board["cores"]) != rep else [])
            for g in groups:
                a = attention(c, shape, p, side, board, group=g)
                b = attention(c, shape, p, side, board, group=g, cached=True)
                gs = (g or ours_group(shape.heads, shape.kv_heads, board["cores"])) if side == "ours" else rep
                out.append(f"| {shape.name} | {side}{' (group unsplit)' if g else ''} | {gs} | "
                           f"{shape.layers * a['compute_s'] * 1e3:.1f} | "
                           f"{shape.layers * a['bytes'] / (board['bw'] * 1e9) * 1e3:.1f} | "
                           f"{shape.layers * a['s'] * 1e3:.1f} | {shape.layers * b['s'] * 1e3:.1f} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-src", help="llama.cpp's ggml/ directory (default: the peer's sdist, fetched once)")
    ap.add_argument("--bw", type=float, default=20.0, help="board read bandwidth, GB/s")
    ap.add_argument("--ghz", type=float, default=2.4)
    ap.add_argument("--cores", type=int, default=4)
    a = ap.parse_args(argv)
    ggml = a76_model.llama_src(a.llama_src)
    board = {"bw": a.bw, "ghz": a.ghz, "cores": a.cores}
    res = a76_model.measure([k for k in a76_model.KERNELS if k.qtype not in a76_float.FLOAT_QTYPES], ggml)
    print(context_report(res, board, measure(ggml, cores=a.cores)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
