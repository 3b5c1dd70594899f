"""The aarch64 build of the kernels (NEON, NEON+dotprod, scalar) equals the numpy twins, under qemu
user-mode emulation: runs scripts/qemu_aarch64_kernels.sh (cross-compile + the kernel tests and the native
fuzz tests through the test driver: every fuzzed entry point, every weight type, SIMD level and 1-3 pool
threads). Needs gcc-aarch64-linux-gnu and qemu-user-static (Debian packages)."""
import os
import re
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FUZZ = os.path.join(ROOT, "tests", "native", "test_native_fuzz.py")


def test_aarch64_kernels_equal_twins_under_qemu():
    assert shutil.which("aarch64-linux-gnu-gcc") and (shutil.which("qemu-aarch64-static") or shutil.which("qemu-aarch64")), \
        "aarch64 cross toolchain / qemu-user-static missing (scripts/test.sh installs them from Debian's packages)"
    r = subprocess.run(["bash", os.path.join(ROOT, "scripts", "qemu_aarch64_kernels.sh"), sys.executable],
                       cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "neon+dotprod" in r.stdout
    assert " passed" in r.stdout and "failed" not in r.stdout
    # every property of the fuzz file ran (and passed) against the emulated library, not just the kernel tests
    fuzzed = re.findall(r"^def (test_\w+)", open(FUZZ).read(), re.M)
    ran = set(re.findall(r"^PASSED tests/native/test_native_fuzz\.py::(test_\w+)", r.stdout, re.M))
    assert fuzzed and set(fuzzed) <= ran, f"fuzz tests that did not pass under qemu: {sorted(set(fuzzed) - ran)}"
