#!/usr/bin/env bash
# Build the one-file executable for this machine (x86_64) natively: dist/x86_64/kestrel-appliance.
#
#   build/build_x86_64.sh            (PYTHON=python3.11 by default; needs a shared libpython)
#
# Policy: a build venv of its own under ~/.cache/kestrel-build (runtime dependencies from pyproject.toml
# + PyInstaller only, never the test stack), reused between runs; the native kernels are compiled first (outside
# the source tree) and bundled.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${KESTREL_BUILD_CACHE:-$HOME/.cache/kestrel-build}
PYTHON=${PYTHON:-python3.11}
ARCH=$(uname -m)
VENV=$CACHE/venv-$ARCH
DIST=${KESTREL_DIST:-$REPO/dist/$ARCH}
PYINSTALLER_VERSION=${PYINSTALLER_VERSION:-6.22.3}
START=$(date +%s)

mkdir -p "$CACHE"
exec 9>"$CACHE/build-$ARCH.lock"
flock 9  # one build at a time per cache (the venv and PyInstaller's work directory are shared)
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "pyinstaller==$PYINSTALLER_VERSION" \
    -r <("$VENV/bin/python" "$REPO/build/requirements.py")

KESTREL_NATIVE_LIB=$(bash "$REPO/build/native.sh" "$VENV/bin/python" "$CACHE/native-$ARCH")
export KESTREL_NATIVE_LIB

cd "$REPO"
"$VENV/bin/python" -m PyInstaller --noconfirm --clean --log-level WARN \
    --distpath "$DIST" --workpath "$CACHE/work-$ARCH" build/pyinstaller.spec
echo "built $DIST/kestrel-appliance: $(stat -c %s "$DIST/kestrel-appliance") bytes in $(( $(date +%s) - START )) s" >&2
