#!/usr/bin/env bash
# numpy's BLAS/LAPACK for the aarch64 executable, cut down to the routines numpy calls.
#
#   build/numpy_blas.sh ROOT SITE_PACKAGES OUTDIR      (prints the library path, relative to ROOT)
#
# Why: numpy's aarch64 wheel carries a complete OpenBLAS with LAPACK and kernels for every Arm core
# (libscipy_openblas64_: 28.7 MB, 8.7 MB compressed in the one-file executable, a quarter of it). numpy itself
# calls 57 of its routines (22 cblas ones, the gemm/gemv/dot/axpy/syrk family, for matmul and dot; 35 LAPACK
# drivers and copies for numpy.linalg), and the appliance's hot paths run in our own C kernels. So the executable ships a library
# linked from Debian's static ILP64 OpenBLAS (the same library, 64-bit integers, built for every Arm core with
# run-time dispatch) that holds those routines and what they call, under the names numpy's extension modules
# import (scipy_dgesv_64_, scipy_cblas_sgemm64_, ...; Debian's archive names them dgesv_, cblas_sgemm).
# The archive comes from Debian's mirror, pinned by version and SHA-256. Linked on the host with clang/lld
# against ROOT (as the CPython cross-build is); build/check_numpy_blas.py then checks it numerically in ROOT.
set -euo pipefail
ROOT=${1:?build root} SITE=${2:?site-packages inside the root} OUT=${3:?output directory inside the root}
CACHE=${KESTREL_BUILD_CACHE:-$HOME/.cache/kestrel-build}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
DEB=libopenblas64-pthread-dev_0.3.13+ds-3+deb11u1_arm64.deb
DEB_SHA256=6d46a5fbbe0dbfd030fc40eaec54a3e8763b1921c2b0d7d2c3bbff86e049701a

mkdir -p "$CACHE/src"
if ! echo "$DEB_SHA256  $CACHE/src/$DEB" | sha256sum -c --status 2>/dev/null; then
    curl -fsSL --retry 3 --retry-delay 5 -o "$CACHE/src/$DEB" "$MIRROR/pool/main/o/openblas/$DEB"
    echo "$DEB_SHA256  $CACHE/src/$DEB" | sha256sum -c --status \
        || { echo "numpy_blas.sh: $DEB does not match its SHA-256" >&2; exit 1; }
fi
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
dpkg-deb -x "$CACHE/src/$DEB" "$WORK/deb"
ARCHIVE=$(find "$WORK/deb" -name 'libopenblas64p-r*.a' | head -1)
[ -n "$ARCHIVE" ] || { echo "numpy_blas.sh: no static OpenBLAS in $DEB" >&2; exit 1; }

LIBS=$ROOT$SITE/numpy.libs
BLAS=$(cd "$LIBS" && ls libscipy_openblas64_*.so)
GFORTRAN=$(cd "$LIBS" && ls libgfortran*.so*)
# what numpy imports from its OpenBLAS: undefined scipy_* symbols of its extension modules
find "$ROOT$SITE/numpy" -name '*.so' -exec aarch64-linux-gnu-readelf --dyn-syms -W {} + \
    | awk '$7 == "UND" && $8 ~ /^scipy_/ { sub(/@.*/, "", $8); print $8 }' | sort -u > "$WORK/imports"
[ -s "$WORK/imports" ] || { echo "numpy_blas.sh: numpy imports nothing from $BLAS?" >&2; exit 1; }
aarch64-linux-gnu-nm --defined-only "$ARCHIVE" 2>/dev/null | awk '$2 == "T" { print $3 }' | sort -u > "$WORK/defined"
LINK=() ; { echo "{ global:"; while read -r name; do
    debian=${name#scipy_}; debian=${debian%64_}          # scipy_dgesv_64_ -> dgesv_, scipy_cblas_sgemm64_ -> cblas_sgemm
    grep -qx "$debian" "$WORK/defined" || { echo "numpy_blas.sh: $name ($debian) not in $DEB" >&2; exit 1; }
    LINK+=("-Wl,--undefined=$debian" "-Wl,--defsym=$name=$debian")
    echo "  $name;"
done < "$WORK/imports"; echo "local: *; };"; } > "$WORK/exports"

mkdir -p "$ROOT$OUT"
clang --target=aarch64-linux-gnu --sysroot="$ROOT" -fuse-ld=lld -shared -o "$ROOT$OUT/$BLAS" \
    -Wl,-soname,"$BLAS" -Wl,--gc-sections -Wl,--version-script="$WORK/exports" -Wl,-rpath,'$ORIGIN' \
    "${LINK[@]}" "$ARCHIVE" "$LIBS/$GFORTRAN" -lpthread -lm
aarch64-linux-gnu-strip --strip-unneeded "$ROOT$OUT/$BLAS"
echo "numpy_blas.sh: $BLAS $(stat -c %s "$LIBS/$BLAS") -> $(stat -c %s "$ROOT$OUT/$BLAS") bytes," \
    "$(wc -l < "$WORK/imports") routines" >&2
echo "$OUT/$BLAS"
