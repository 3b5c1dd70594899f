"""The native library under AddressSanitizer + UndefinedBehaviorSanitizer and under ThreadSanitizer (the
`sanitize` tier: `pytest -m sanitize tests/system/test_native_sanitizers.py`; not in the default run, ~5 min).

Each checked build (appliance.native.build --sanitize) is loaded into the ordinary Python with LD_PRELOAD of
the sanitizer's runtime (Python itself is not instrumented; only our C code is checked). Under each, the native
kernel and decoder tests, the delta-rule / conv1d tests and the entry points' fuzz tests
(tests/native/test_native_fuzz*.py: hypothesis-drawn shapes, layouts and invalid arguments; numpy's arrays come from the sanitizer's malloc, so a read past one is caught) run,
then the decode soak (tests/system/native_soak.py: a real Q4_1 GGUF on the x8
copies built while a second thread runs products and switches SIMD levels, the pool resized between rounds), and
a tenth of the loader's fuzz tier under ASan (tests/system/test_load_fuzz.py: mutated GGUF and safetensors files
loaded and run one token through the C decoder in worker processes that inherit the checked library).
Any sanitizer report fails the test, with the report in the message.
"""
from __future__ import annotations

import glob
import os
import subprocess
import sys

import pytest

from appliance.native import build
from tests.support.gguf_files import fetch_smollm2

pytestmark = pytest.mark.sanitize
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# the interpreter's own libraries are not instrumented: races inside numpy's BLAS threads are not ours
TSAN_SUPPRESSIONS = "race:libscipy_openblas\nrace:libopenblas\n"


def checked_env(kind: str, tmp_path) -> tuple[dict, str]:
    lib = build.build(out=str(tmp_path / f"kq_{kind}.so"), sanitize=kind)
    logs = str(tmp_path / f"{kind}-report")
    env = dict(os.environ, KESTREL_NATIVE_LIB=lib, LD_PRELOAD=build.sanitizer_runtime(kind), PYTHONPATH=ROOT)
    if kind == "address":
        env["ASAN_OPTIONS"] = f"detect_leaks=0:abort_on_error=0:log_path={logs}"
        env["UBSAN_OPTIONS"] = f"print_stacktrace=1:halt_on_error=1:log_path={logs}"
    else:
        supp = tmp_path / "tsan.supp"
        supp.write_text(TSAN_SUPPRESSIONS)
        env["TSAN_OPTIONS"] = f"suppressions={supp}:log_path={logs}:halt_on_error=0"
    return env, logs


def assert_clean(proc: subprocess.CompletedProcess, logs: str) -> None:
    reports = "".join(open(p).read() for p in glob.glob(logs + "*"))
    assert not reports, reports[:6000]
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])


@pytest.mark.parametrize("kind", ["address", "thread"])
def test_native_tests_under_sanitizer(kind, tmp_path):
    env, logs = checked_env(kind, tmp_path)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not sanitize",
                           "tests/native/test_native_kernels.py", "tests/native/test_native_decoder.py",
                           "tests/native/test_native_fuzz.py", "tests/native/test_native_fuzz_invalid.py",
                           "tests/native/test_native_delta.py"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert " passed" in proc.stdout and " failed" not in proc.stdout, proc.stdout[-3000:]
    assert_clean(proc, logs)


@pytest.mark.parametrize("kind,rounds,tokens", [("address", 6, 24), ("thread", 2, 4)])
def test_decode_soak_under_sanitizer(kind, rounds, tokens, tmp_path):
    model = fetch_smollm2()
    env, logs = checked_env(kind, tmp_path)
    proc = subprocess.run([sys.executable, "tests/system/native_soak.py", "--model", model, "--rounds", str(rounds),
                           "--tokens", str(tokens)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.stdout.count("round ") == rounds, proc.stdout + proc.stderr[-3000:]
    assert_clean(proc, logs)


def test_load_fuzz_under_address_sanitizer(tmp_path):
    env, logs = checked_env("address", tmp_path)
    env["KESTREL_LOAD_FUZZ_SCALE"] = "0.1"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not sanitize",
                           "tests/system/test_load_fuzz.py"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=3600)
    assert " passed" in proc.stdout and " failed" not in proc.stdout, proc.stdout[-3000:]
    assert_clean(proc, logs)
