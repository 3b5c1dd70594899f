"""The aarch64 build of the kernels (NEON, NEON+dotprod, scalar) equals the numpy twins, under qemu
user-mode emulation: runs scripts/qemu_aarch64_kernels.sh (cross-compile + the kernel tests, the native fuzz
tests and the delta-rule / conv1d tests through the test driver: every fuzzed entry point, every weight type,
SIMD level and 1-3 pool threads). Needs gcc-aarch64-linux-gnu and qemu-user-static (Debian packages)."""
import os
import re
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FUZZ = os.path.join(ROOT, "tests", "native", "test_native_fuzz.py")
DELTA = os.path.join(ROOT, "tests", "native", "test_native_delta.py")


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
    delta = re.findall(r"^def (test_\w+)", open(DELTA).read(), re.M)  # the delta rule and conv1d kernels too
    ran = set(re.findall(r"^PASSED tests/native/test_native_delta\.py::(test_\w+)", r.stdout, re.M))
    assert delta and set(delta) <= ran, f"delta tests that did not pass under qemu: {sorted(set(delta) - ran)}"


# the generic-C entry points whose policy comments (ops.c, vision.c, quant.c, delta.c) say -O3 makes them NEON on
# aarch64: each must still hold 4-lane float arithmetic in the aarch64 object (a change that stops the
# vectoriser, e.g. a call or an aliasing store in the loop, fails here)
VECTORISED = {"ops": ["kq_rms_norm", "kq_rope", "kq_swiglu", "attn_task"], "vision": ["ln_task", "gelu_range", "sa_task"],
              "quant": ["kq_dequantize_row"], "delta": ["step_task", "chunk_task", "kq_causal_conv1d"]}  # the
# delta rule's entry points hand their heads to the pool: the arithmetic is in its tasks


def test_generic_c_entry_points_are_neon_on_aarch64(tmp_path):
    assert shutil.which("aarch64-linux-gnu-gcc") and shutil.which("aarch64-linux-gnu-objdump"), \
        "aarch64 cross toolchain missing (scripts/test.sh installs gcc-aarch64-linux-gnu)"
    from appliance.native.build import CFLAGS
    for unit, functions in VECTORISED.items():
        obj = tmp_path / f"{unit}.o"
        subprocess.run(["aarch64-linux-gnu-gcc", *CFLAGS, "-fPIC", "-c", os.path.join(ROOT, "appliance", "native",
                        "src", f"{unit}.c"), "-o", str(obj)], check=True)
        dump = subprocess.run(["aarch64-linux-gnu-objdump", "-d", "--no-show-raw-insn", str(obj)], check=True,
                              capture_output=True, text=True).stdout
        bodies = dict(re.findall(r"^[0-9a-f]+ <(\w+)>:\n(.*?)(?=\n\n|\Z)", dump, re.M | re.S))
        for f in functions:
            ops = re.findall(r"\t(f(?:mul|add|sub))\tv\d+\.4s", bodies.get(f, ""))
            assert ops, f"{unit}.c {f}: no 4-lane float arithmetic in the aarch64 build"
