"""Compile the kernel library without setuptools (PyInstaller builds, cross-compiles for the board):

    python -m appliance.native.build [--cc aarch64-linux-gnu-gcc] [--out path.so] [--sanitize address|thread]

setup.py compiles the same sources with the same flags (it reads SOURCES and CFLAGS from here).
Policy: no FMA contraction (-ffp-contract=off), so the C float sums equal their numpy twins bit for bit;
no trapping math (FP exceptions are never inspected; without it GCC leaves loops with a float compare or
rint, like the exp in softmax, SiLU and GELU, scalar), which changes no result;
SIMD levels are chosen at run time, so one build serves every CPU of an architecture.
"""
from __future__ import annotations

import argparse
import glob
import os
import shlex
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = sorted(glob.glob(os.path.join(HERE, "src", "*.c")))
CFLAGS = ["-O3", "-std=gnu11", "-ffp-contract=off", "-fno-trapping-math", "-fvisibility=default", "-pthread"]
DEFAULT_OUT = os.path.join(HERE, "_kestrel_native.so")
# Checked builds for the sanitizer test tier (tests/system/test_native_sanitizers.py). Loaded into an uninstrumented
# Python with LD_PRELOAD of the runtime (sanitizer_runtime); never shipped. "address" includes UBSan.
SANITIZE = {
    "address": ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"],
    "thread": ["-fsanitize=thread", "-DKQ_NO_CLONES"],  # its runtime cannot run IFUNC resolvers (target_clones)
}
SANITIZER_RUNTIME = {"address": "libasan.so", "thread": "libtsan.so"}


def build(cc: str | None = None, out: str = DEFAULT_OUT, sanitize: str | None = None) -> str:
    cc_cmd = shlex.split(cc or os.environ.get("CC") or "cc")
    flags = CFLAGS
    if sanitize:
        flags = [f for f in CFLAGS if not f.startswith("-O")] + ["-O1", "-g", "-fno-omit-frame-pointer",
                                                                  *SANITIZE[sanitize]]
    cmd = [*cc_cmd, *flags, "-fPIC", "-shared", "-o", out, *SOURCES, "-lm", "-pthread"]
    subprocess.run(cmd, check=True)
    return out


def sanitizer_runtime(sanitize: str, cc: str | None = None) -> str:
    """Path of the sanitizer's runtime library (for LD_PRELOAD), as the compiler reports it."""
    cc_cmd = shlex.split(cc or os.environ.get("CC") or "cc")
    return subprocess.run([*cc_cmd, f"-print-file-name={SANITIZER_RUNTIME[sanitize]}"], check=True,
                          capture_output=True, text=True).stdout.strip()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m appliance.native.build", description=__doc__.splitlines()[0])
    ap.add_argument("--cc", help="C compiler command (default: $CC or cc)")
    ap.add_argument("--out", default=DEFAULT_OUT, help="output shared library")
    ap.add_argument("--sanitize", choices=sorted(SANITIZE), help="a checked build (tests only)")
    args = ap.parse_args(argv)
    if args.sanitize and args.out == DEFAULT_OUT:
        ap.error("--sanitize needs --out elsewhere: the package must never load a checked build by accident")
    try:
        print(build(args.cc, args.out, args.sanitize))
    except (OSError, subprocess.CalledProcessError) as e:
        print(f"native build failed: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
