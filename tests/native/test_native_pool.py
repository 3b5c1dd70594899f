"""The native thread pool under CPU contention: no chunk runs twice and none runs after its job's poster returned.

Regression test of the segfaults in x8_avx2vnni (issue 16): a worker that read a finished job's work word and
then the next job's fields could claim items of the next job against the old word (still "fully claimed", but
below the new job's larger n); they ran twice and over-counted the job's progress, so the poster returned while
the worker still ran a chunk whose context (on the poster's dead stack frame) was garbage. It needs the worker to
be descheduled at one exact point, so the stress runs while busy processes compete for the cores; before the fix
it found ~10 bad jobs in 300,000 on a 2-core machine.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SRC = os.path.join(ROOT, "appliance", "native", "src")


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler (the native build needs one too)")
def test_pool_never_runs_a_chunk_twice_or_after_its_poster_returned(tmp_path):
    exe = str(tmp_path / "pool_stress")
    subprocess.run(["cc", "-O2", "-pthread", "-I", SRC, os.path.join(ROOT, "tests", "support", "pool_stress.c"),
                    os.path.join(SRC, "pool.c"), "-o", exe], check=True)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(3)]
    try:
        out = subprocess.run([exe, "200000"], capture_output=True, text=True, timeout=600)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    assert out.stdout.strip().endswith("bad 0"), out.stdout[-2000:]
    assert out.returncode == 0
