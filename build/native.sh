#!/usr/bin/env bash
# Compile the native kernels (appliance/native/src) for the Python given, into OUTDIR.
#
#   build/native.sh PYTHON OUTDIR       (CC may name the compiler; prints the library path)
#
# Policy: the library is built outside the source tree and handed to the spec by path (KESTREL_NATIVE_LIB),
# so a stray .so in the working tree never ends up in the executable. A failing native build fails the
# build: shipping the numpy path by accident would hide a regression.
set -euo pipefail
PY=${1:?python} OUT=${2:?output directory}
REPO=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT"
cd "$REPO"
"$PY" -m appliance.native.build --out "$OUT/_kestrel_native.so" >&2
echo "$OUT/_kestrel_native.so"
