"""Compile the kernel library without setuptools (PyInstaller builds, cross-compiles for the board):

    python -m appliance.native.build [--cc aarch64-linux-gnu-gcc] [--out path.so]

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


def build(cc: str | None = None, out: str = DEFAULT_OUT) -> str:
    cc_cmd = shlex.split(cc or os.environ.get("CC") or "cc")
    cmd = [*cc_cmd, *CFLAGS, "-fPIC", "-shared", "-o", out, *SOURCES, "-lm", "-pthread"]
    subprocess.run(cmd, check=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m appliance.native.build", description=__doc__.splitlines()[0])
    ap.add_argument("--cc", help="C compiler command (default: $CC or cc)")
    ap.add_argument("--out", default=DEFAULT_OUT, help="output shared library")
    args = ap.parse_args(argv)
    try:
        print(build(args.cc, args.out))
    except (OSError, subprocess.CalledProcessError) as e:
        print(f"native build failed: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
