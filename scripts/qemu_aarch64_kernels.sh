#!/usr/bin/env bash
# Cross-compile the native kernels for aarch64 and run the kernel tests and the native fuzz tests against them
# under qemu user-mode emulation (functional only: every SIMD level the emulated CPU has — scalar, NEON,
# NEON+dotprod — must equal the numpy twins as on x86: bit for bit where the tests say so). The Python side
# (the wrappers, the twins, hypothesis) runs natively; only the C calls cross to the emulated driver
# (appliance/native/driver/kq_driver.c, tests/support/kernel_driver.py). Needs: apt-get install qemu-user-static
# gcc-aarch64-linux-gnu
#
#   scripts/qemu_aarch64_kernels.sh [PYTHON [PYTEST ARGS...]]   (PYTHON defaults to .venv/bin/python, then python3;
#                                                               the pytest arguments select tests, -k ...)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
CC=${CC_AARCH64:-aarch64-linux-gnu-gcc}
QEMU=${QEMU_AARCH64:-$(command -v qemu-aarch64-static || command -v qemu-aarch64)}
SYSROOT=${AARCH64_SYSROOT:-/usr/aarch64-linux-gnu}
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
# the library's own flags (appliance/native/build.py), statically linked so qemu needs no loader paths
FLAGS=$("$PY" -c 'from appliance.native.build import CFLAGS; print(" ".join(CFLAGS))')
$CC $FLAGS -static -o "$OUT/kq_driver" appliance/native/driver/kq_driver.c appliance/native/src/*.c -lm
file "$OUT/kq_driver" | grep -q aarch64
export KESTREL_KERNEL_DRIVER="$QEMU -L $SYSROOT $OUT/kq_driver"
"$PY" -c 'from tests.support.kernel_driver import kernels_under_test as k; k = k()
print("aarch64 kernels under qemu: best SIMD level", k.simd_max(), k.simd_name())'
# test_native_fuzz_invalid's kq_forward case bends a whole decoder's specs: the driver does not serve kq_forward
# (a model's layers, weights and caches; the fuzzed kernels it calls are served one by one)
"$PY" -m pytest -q -rA -p no:cacheprovider tests/native/test_native_kernels.py tests/native/test_native_fuzz.py \
    tests/native/test_native_fuzz_invalid.py tests/native/test_native_delta.py \
    --deselect tests/native/test_native_fuzz_invalid.py::test_the_c_side_refuses_a_weight_whose_bytes_do_not_match_its_shape \
    "${@:2}"
