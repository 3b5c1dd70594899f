"""Static cost of an inner loop on the board's cores: compile C/C++ for aarch64 with clang, find a function's
innermost loop in the assembly, and run its body through llvm-mca. The machinery of bench/a76_model.py.

Policy:
- One compiler for both code bases (clang, `--target=aarch64-linux-gnu -mcpu=cortex-a76 -O3`, each with its own
  extra flags), so a difference is the kernels' and not the compilers'. The board's own build is GCC's; the
  figures are for clang's code. Both are compiled with `-mllvm -unroll-threshold=4000`: clang otherwise leaves
  constant-count sub-loops (a K-quant super-block's sub-blocks) rolled where GCC unrolls them, and a loop nest
  is not something llvm-mca can time; the loop over blocks, of unknown count, is left as it is.
- The loop is taken from the real functions' assembly, not from a copy of their source: a function (for our
  kernels, a `flatten` wrapper that calls a tile kernel with the shape of interest as constants, so the paths
  the shape does not take fold away) is cut out of `clang -S`, every backward branch (to a label earlier in the
  function, numeric local labels `1b` of inline assembly included) marks a loop, the loops that contain no other
  loop are the innermost ones, and the one with the most dot-product instructions is the kernel's inner loop.
  The caller states how many of those instructions one iteration must hold, so a loop the compiler unrolled
  or a wrong pick fails loudly instead of giving a figure for the wrong work.
- `.inst 0x...` words (llama.cpp's inline assembly spells sdot that way for old assemblers) are disassembled
  with llvm-mc first; llvm-mca would otherwise drop them and under-count. A call in the loop (a helper of another
  file, say our K-quant scale unpackers in quant.c) is followed by the callee's instructions, so its work counts.
- Cortex-A76: LLVM has no model of its own for it (`-mcpu=cortex-a76` gets the Cortex-A57 model, which does not
  know sdot), so llvm-mca runs with `-mcpu=neoverse-n1`, the server core built on the A76's pipeline (same
  4-wide decode, 2 ASIMD pipes, 2 load pipes and instruction latencies in Arm's optimization guides). That model
  is LLVM 17's or newer: the newest llvm-mca-N on PATH is used. Cortex-A55: LLVM's own in-order A55 model.
- llvm-mca sees registers and pipes only: every load hits L1, there are no branch mispredicts and no memory
  stalls. A figure is the core's compute cost per iteration at steady state; bench/a76_model.py puts the memory
  system back with a bandwidth bound.
"""
from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass

CLANG_FLAGS = ["--target=aarch64-linux-gnu", "-mcpu=cortex-a76", "-O3", "-S", "-fno-asynchronous-unwind-tables",
               "-D_GNU_SOURCE", "-mllvm", "-unroll-threshold=4000"]
MCA_CPU = {"a76": "neoverse-n1", "a55": "cortex-a55"}
ITERATIONS = 300
# instructions that do a kernel's multiply-adds (integer dots, float FMAs): what picks and checks a loop
DOT_RE = re.compile(r"^\s*(sdot|udot|usdot|smmla|fmla)\b")


class ToolMissing(RuntimeError):
    pass


@functools.lru_cache(maxsize=1)
def tools() -> dict[str, str]:
    """clang, clang++, llvm-mca (LLVM >= 17, for the Neoverse N1 model) and llvm-mc of the same version."""
    clang = shutil.which("clang")
    if not clang:
        raise ToolMissing("clang not found (Debian: apt-get install clang)")
    for v in range(30, 16, -1):
        mca, mc = shutil.which(f"llvm-mca-{v}"), shutil.which(f"llvm-mc-{v}")
        if mca and mc:
            return {"clang": clang, "clang++": shutil.which("clang++") or clang, "mca": mca, "mc": mc}
    mca, mc = shutil.which("llvm-mca"), shutil.which("llvm-mc")
    if mca and mc:
        out = subprocess.run([mca, "--version"], capture_output=True, text=True).stdout
        m = re.search(r"LLVM version (\d+)", out)
        if m and int(m.group(1)) >= 17:
            return {"clang": clang, "clang++": shutil.which("clang++") or clang, "mca": mca, "mc": mc}
    raise ToolMissing("llvm-mca of LLVM >= 17 not found (Debian: apt-get install llvm-19)")


def have_tools() -> bool:
    try:
        tools()
        return True
    except ToolMissing:
        return False


def sysroot_flags(cxx: bool) -> list[str]:
    """Headers of the aarch64 sysroot (Debian's gcc-aarch64-linux-gnu; libstdc++-12-dev-arm64-cross for C++)."""
    flags = []
    if os.path.isdir("/usr/aarch64-linux-gnu/include"):
        flags += ["-isystem", "/usr/aarch64-linux-gnu/include"]
    return flags + (["-std=c++17"] if cxx else ["-std=gnu11"])


GCC = "aarch64-linux-gnu-gcc"  # the board's compiler (a cross GCC here), for the --gcc comparison of our kernels
GCC_FLAGS = ["-mcpu=cortex-a76", "-O3", "-S", "-fno-asynchronous-unwind-tables", "-D_GNU_SOURCE"]


def compile_asm(source: str, includes: list[str], cxx: bool = False, flags: list[str] | None = None,
                gcc: bool = False) -> str:
    """The assembly clang (or, gcc=True, the aarch64 GCC) writes for one file (source text), with the include
    directories and the code base's own extra flags (ours: -ffp-contract=off -fno-trapping-math, from
    appliance/native/build.py) given."""
    t = tools()
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.cpp" if cxx else "k.c")
        with open(src, "w") as f:
            f.write(source)
        out = os.path.join(d, "k.s")
        cc = [GCC, *GCC_FLAGS, "-std=gnu11"] if gcc else [t["clang++" if cxx else "clang"], *CLANG_FLAGS,
                                                           *sysroot_flags(cxx)]
        cmd = [*cc, *[f"-I{i}" for i in includes], *(flags or []), src, "-o", out]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"compiler failed: {' '.join(cmd)}\n{r.stderr[-3000:]}")
        with open(out) as f:
            return f.read()


def functions(asm: str) -> dict[str, list[str]]:
    """Function name -> its lines, from `name:` after `.type name,@function` to the next `.Lfunc_end`."""
    out: dict[str, list[str]] = {}
    lines = asm.splitlines()
    typed = {m.group(1) for m in re.finditer(r"\.type\s+([\w.$]+),\s*[@%]function", asm)}
    cur: str | None = None
    for ln in lines:
        m = re.match(r"^([\w.$]+):", ln)
        if m and m.group(1) in typed:
            cur = m.group(1)
            out[cur] = []
            continue
        if cur is not None:
            if ln.startswith(".Lfunc_end"):
                cur = None
                continue
            out[cur].append(ln)
    return out


def find_function(funcs: dict[str, list[str]], name: str) -> list[str]:
    """A function by exact or (C++ mangled) contained name."""
    if name in funcs:
        return funcs[name]
    hits = [k for k in funcs if name in k]
    if len(hits) != 1:
        raise KeyError(f"function {name!r}: {len(hits)} matches")
    return funcs[hits[0]]


_CC_BRANCH = re.compile(r"^b(eq|ne|cs|hs|cc|lo|mi|pl|vs|vc|hi|ls|ge|lt|gt|le)(\s)")  # GCC's `bne` is `b.ne`


def _normalize(body: list[str]) -> list[str]:
    """Comments stripped, `label: insn` (inline assembly writes `1:` and its instruction on one line) split."""
    out = []
    for raw in body:
        ln = raw.split("//")[0].strip()
        m = re.match(r"^([\w.$]+):\s*(.*)$", ln)
        if m:
            out.append(m.group(1) + ":")
            ln = m.group(2).strip()
        out += [_CC_BRANCH.sub(r"b.\1\2", x.strip()) for x in ln.split(";") if x.strip()]
    return out


def _is_insn(ln: str) -> bool:
    return bool(ln) and (ln.startswith(".inst") or not ln.startswith(".")) and not re.match(r"^[\w.$]+:$", ln) and not ln.startswith("#")


_BRANCH = re.compile(r"^(b|b\.\w+|cbn?z|tbn?z|bl)\s+(.*)$")


def loop_spans(body: list[str]) -> tuple[list[str], list[tuple[int, int]]]:
    """A function's normalized lines and its loops as (first, last) line indexes: from the label a backward branch
    goes to, to that branch."""
    lines = _normalize(body)
    named: dict[str, int] = {}
    numeric: list[tuple[str, int]] = []
    loops: list[tuple[int, int]] = []
    for i, ln in enumerate(lines):
        if ln.endswith(":"):
            lab = ln[:-1]
            if lab.isdigit():
                numeric.append((lab, i))
            else:
                named[lab] = i
            continue
        b = _BRANCH.match(ln)
        if not b or b.group(1) == "bl":
            continue
        target = b.group(2).split(",")[-1].strip()
        if re.fullmatch(r"\d+b", target):
            prior = [j for lab, j in numeric if lab == target[:-1] and j < i]
            if prior:
                loops.append((prior[-1], i))
        elif target in named and named[target] < i:
            loops.append((named[target], i))
    return lines, loops


def innermost(loops: list[tuple[int, int]]) -> list[tuple[int, int]]:
    return [lp for lp in loops if not any(o != lp and lp[0] <= o[0] and o[1] <= lp[1] for o in loops)]


def insns(lines: list[str]) -> list[str]:
    """The instructions among normalized lines (labels and directives dropped, `.inst` words disassembled)."""
    return disassemble_inst([ln for ln in lines if _is_insn(ln)])


def innermost_loops(body: list[str]) -> list[list[str]]:
    """The bodies (instruction lines, branch included) of the loops of a function that hold no other loop."""
    lines, loops = loop_spans(body)
    return [insns(lines[a:b + 1]) for a, b in innermost(loops)]


def dots(loop: list[str]) -> int:
    return sum(1 for ln in loop if DOT_RE.match(ln))


def pick_loop(body: list[str], want_dots: int | None = None) -> list[str]:
    """The innermost loop with the most dot-product instructions (checked against want_dots when given)."""
    loops = innermost_loops(body)
    if not loops:
        raise ValueError("no loop found")
    best = max(loops, key=dots)
    if want_dots is not None and dots(best) != want_dots:
        raise ValueError(f"inner loop has {dots(best)} dot instructions, expected {want_dots}:\n" + "\n".join(best))
    return best


def splice_calls(loop: list[str], funcs: dict[str, list[str]], ignore: tuple[str, ...] = ()) -> list[str]:
    """Each `bl f` of a loop followed by f's instructions (its `ret` included), f taken from funcs: a call the build
    leaves out of line (a helper in another file) is work the loop does. A callee with a loop of its own, or one
    not in funcs, is an error: its cost cannot be had this way; unless it is in `ignore` (the caller says so: the
    call then counts as its `bl` alone)."""
    out = []
    for ln in loop:
        out.append(ln)
        m = re.match(r"^bl\s+([\w.$]+)", ln)
        if not m or m.group(1) in ignore:
            continue
        if m.group(1) not in funcs or innermost_loops(funcs[m.group(1)]):
            raise ValueError(f"call to {m.group(1)} in the loop: no straight-line body to time")
        out += [x for x in _normalize(funcs[m.group(1)]) if _is_insn(x)]
    return out


def disassemble_inst(loop: list[str]) -> list[str]:
    """`.inst 0x...` words -> the instructions they encode (one llvm-mc call), other lines unchanged."""
    words = [int(m.group(1), 16) for ln in loop if (m := re.match(r"^\.inst\s+(0x[0-9a-fA-F]+)", ln))]
    if not words:
        return loop
    r = subprocess.run([tools()["mc"], "--disassemble", "-triple=aarch64", "-mattr=+dotprod,+fullfp16,+i8mm"],
                       input=" ".join(f"0x{(w >> s) & 0xFF:02x}" for w in words for s in (0, 8, 16, 24)),
                       capture_output=True, text=True)
    ins = [x.split("//")[0].strip() for x in r.stdout.splitlines()]
    ins = [x for x in ins if x and not x.startswith(".")]
    if len(ins) != len(words):
        raise RuntimeError(f"llvm-mc decoded {len(ins)} of {len(words)} words: {r.stderr[-500:]}")
    it = iter(ins)
    return [next(it) if ln.startswith(".inst") else ln for ln in loop]


@dataclass
class Cost:
    cycles: float        # per loop iteration at steady state (llvm-mca total cycles / iterations)
    rthroughput: float   # the pipes' bound alone (llvm-mca "Block RThroughput")
    instructions: int


_ST_POST = re.compile(r"^(st\w*)\s+(.*),\s*\[(x\d+|sp)\],\s*#?(-?\w+)$")
_ST_PRE = re.compile(r"^(st\w*)\s+(.*),\s*\[(x\d+|sp),\s*#?(-?\w+)\]!$")


def split_store_writeback(loop: list[str]) -> list[str]:
    """Stores with base-register writeback (`str q0, [x1], #16`, `stp .., [x1, #32]!`) as the store and an `add` of
    the base. LLVM's Neoverse N1 model makes the written-back base wait for the store's data, so a loop whose next
    addresses come from it runs at the latency of the whole data chain (ggml_vec_mad_f16: 15 cycles per 32 fp16
    FMAs, 8.0 split; ops.c's exp loop 76 cycles per 4 scores, 29 split); the cores update the base in the address
    uop. Opt-in (bench/a76_context.py uses it; the kernel table of bench/a76_model.py does not)."""
    out = []
    for ln in loop:
        post, pre = _ST_POST.match(ln), _ST_PRE.match(ln)
        m = post or pre
        if not m:
            out.append(ln)
            continue
        op, regs, base, inc = m.groups()
        neg = inc.startswith("-")
        add = f"{'sub' if neg else 'add'}\t{base}, {base}, " + (f"#{inc.lstrip('-')}" if inc.lstrip("-")[0].isdigit()
                                                                  else inc)
        out += [f"{op}\t{regs}, [{base}]", add] if post else [add, f"{op}\t{regs}, [{base}]"]
    return out


def mca(loop: list[str], core: str, split_wb: bool = False) -> Cost:
    """llvm-mca's steady-state cycles per iteration of a loop body on 'a76' or 'a55' (split_wb: stores' base
    writeback as separate adds, split_store_writeback)."""
    loop = split_store_writeback(loop) if split_wb else loop
    text = "\n".join(ln for ln in loop if _is_insn(ln)) + "\n"
    r = subprocess.run([tools()["mca"], "-mtriple=aarch64", f"-mcpu={MCA_CPU[core]}", f"-iterations={ITERATIONS}",
                        "-skip-unsupported-instructions=lack-sched"],
                       input=text, capture_output=True, text=True)
    if r.returncode != 0:  # older llvm-mca has no -skip-unsupported-instructions
        r = subprocess.run([tools()["mca"], "-mtriple=aarch64", f"-mcpu={MCA_CPU[core]}",
                            f"-iterations={ITERATIONS}"], input=text, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"llvm-mca failed: {r.stderr[-2000:]}")
    total = int(re.search(r"Total Cycles:\s+(\d+)", r.stdout).group(1))  # type: ignore[union-attr]
    rt = float(re.search(r"Block RThroughput:\s+([\d.]+)", r.stdout).group(1))  # type: ignore[union-attr]
    n = int(re.search(r"Instructions:\s+(\d+)", r.stdout).group(1)) // ITERATIONS  # type: ignore[union-attr]
    return Cost(total / ITERATIONS, rt, n)
