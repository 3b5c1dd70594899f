#!/usr/bin/env bash
# Build the one-file executable for aarch64 on this x86_64 machine: dist/aarch64/kestrel-appliance.
#
#   build/build_aarch64.sh           (as root: debootstrap, chroot, binfmt_misc)
#
# How: a Debian arm64 root file system (debootstrap under qemu user-mode emulation, binfmt_misc) is the build
# chroot; PyInstaller runs there under an aarch64 Python, so every bundled library is an aarch64 one taken
# from that root. Portability policy: the chroot is Debian 11 (bullseye, glibc 2.31), so the executable runs
# on Debian 11/12 and Ubuntu 22.04 board images. Bullseye's own Python is 3.9, older than the project's
# floor, so CPython 3.11 (Debian's upstream source tarball) is cross-compiled on the host with clang against
# that root (fast, native speed) and installed into it at /opt/kestrel-python. Everything is cached under
# ~/.cache/kestrel-build: a rerun only repeats the pip check and the PyInstaller step.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${KESTREL_BUILD_CACHE:-$HOME/.cache/kestrel-build}
SUITE=${SUITE:-bullseye}
DIST=${KESTREL_DIST:-$REPO/dist/aarch64}
PY_VERSION=3.11.2   # the python3.11 source Debian's mirror serves (pool/main/p/python3.11)
PY_PREFIX=/opt/kestrel-python
PYINSTALLER_VERSION=${PYINSTALLER_VERSION:-6.22.3}
BUILD_PACKAGES=gcc,libc6-dev,libffi-dev,zlib1g-dev,libssl-dev,libbz2-dev,liblzma-dev,ca-certificates,binutils
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
export QEMU_CPU=cortex-a76  # qemu's default CPU (max) makes OpenBLAS choose SME kernels that spew warnings
START=$(date +%s)
log() { echo "build_aarch64: [$(( $(date +%s) - START ))s] $*" >&2; }

[ "$(id -u)" = 0 ] || { echo "build_aarch64.sh: run as root (debootstrap, chroot, binfmt_misc)" >&2; exit 1; }
bash "$REPO/build/qemu_binfmt.sh" arm64
for tool in clang ld.lld aarch64-linux-gnu-ar pkg-config python3.11 make; do
    command -v "$tool" >/dev/null || MISSING="${MISSING:-} $tool"
done
if [ -n "${MISSING:-}" ]; then
    log "installing host tools for:$MISSING"
    apt-get install -y -q clang lld binutils-aarch64-linux-gnu pkg-config python3.11 make >&2
fi

BASE=$CACHE/rootfs-arm64-$SUITE-minbase
ROOT=$CACHE/buildroot-arm64-$SUITE
MOUNTS=()
PIP_CERT_ENV=
cleanup() {
    local i
    for (( i=${#MOUNTS[@]}-1; i>=0; i-- )); do umount -l "${MOUNTS[$i]}" 2>/dev/null || true; done
}
trap cleanup EXIT
mount_chroot() {  # /proc, /dev, /sys and a pip cache inside the build root, once
    [ ${#MOUNTS[@]} -eq 0 ] || return 0
    mkdir -p "$CACHE/pip-arm64" "$ROOT/root/.cache/pip"
    mount -t proc proc "$ROOT/proc" && MOUNTS+=("$ROOT/proc")
    mount --rbind /dev "$ROOT/dev" && MOUNTS+=("$ROOT/dev")
    mount -t sysfs sysfs "$ROOT/sys" && MOUNTS+=("$ROOT/sys")
    mount --bind "$CACHE/pip-arm64" "$ROOT/root/.cache/pip" && MOUNTS+=("$ROOT/root/.cache/pip")
    cp -L /etc/resolv.conf "$ROOT/etc/resolv.conf"
    # pip in the chroot trusts what the host trusts (a proxy in front of PyPI may bring its own CA)
    if [ -f /etc/ssl/certs/ca-certificates.crt ]; then
        cp -L /etc/ssl/certs/ca-certificates.crt "$ROOT/etc/kestrel-build-host-ca.crt"
        PIP_CERT_ENV=PIP_CERT=/etc/kestrel-build-host-ca.crt
    fi
}
in_chroot() { mount_chroot; chroot "$ROOT" /usr/bin/env -i HOME=/root LANG=C.UTF-8 QEMU_CPU="$QEMU_CPU" \
    DEBIAN_FRONTEND=noninteractive ${PIP_CERT_ENV:-} \
    PATH=$PY_PREFIX/bin:/usr/local/bin:/usr/bin:/bin "$@"; }

# 1. Debian root file system with the build packages (headers and libraries to link against, gcc for the
#    native kernels, binutils for PyInstaller).
bash "$REPO/build/rootfs.sh" arm64 "$SUITE" "$BASE"
PKG_STAMP="$SUITE $BUILD_PACKAGES"
if [ ! -f "$ROOT/.kestrel-build-packages" ] || [ "$(cat "$ROOT/.kestrel-build-packages")" != "$PKG_STAMP" ]; then
    log "build root: $BASE + $BUILD_PACKAGES"
    for m in proc dev sys root/.cache/pip; do
        ! mountpoint -q "$ROOT/$m" 2>/dev/null || { echo "build_aarch64.sh: $ROOT/$m is mounted" >&2; exit 1; }
    done
    rm -rf "$ROOT"
    cp -a "$BASE" "$ROOT"
    in_chroot apt-get update -q >&2
    in_chroot apt-get install -y -q --no-install-recommends ${BUILD_PACKAGES//,/ } >&2
    in_chroot apt-get clean
    echo "$PKG_STAMP" > "$ROOT/.kestrel-build-packages"
fi

# 2. CPython, cross-compiled with clang against the root's glibc and libraries, installed into the root.
if [ ! -f "$ROOT$PY_PREFIX/.kestrel-python-$PY_VERSION" ]; then
    SRC=$CACHE/src/Python-$PY_VERSION
    if [ ! -d "$SRC" ]; then
        mkdir -p "$CACHE/src"
        curl -fsSL -o "$CACHE/src/python3.11_$PY_VERSION.orig.tar.gz" \
            "$MIRROR/pool/main/p/python3.11/python3.11_$PY_VERSION.orig.tar.gz"
        tar -C "$CACHE/src" -xzf "$CACHE/src/python3.11_$PY_VERSION.orig.tar.gz"
    fi
    OBJ=$CACHE/pybuild-arm64-$SUITE
    rm -rf "$OBJ" && mkdir -p "$OBJ"
    log "cross-compiling CPython $PY_VERSION (clang --target=aarch64-linux-gnu --sysroot=$ROOT)"
    # Debian's dev symlinks are absolute (libm.so -> /lib/aarch64-linux-gnu/libm.so.6): seen from the host
    # they point at nothing and the linker falls back to static archives. Make them relative (same targets
    # inside the root).
    python3.11 - "$ROOT" <<'PY'
import os, sys
root = sys.argv[1]
for d in ("usr/lib/aarch64-linux-gnu", "usr/lib"):
    for name in os.listdir(os.path.join(root, d)):
        link = os.path.join(root, d, name)
        if os.path.islink(link) and os.readlink(link).startswith("/"):
            target = root + os.readlink(link)
            os.remove(link)
            os.symlink(os.path.relpath(target, os.path.dirname(link)), link)
PY
    (
        cd "$OBJ"
        export CC="clang --target=aarch64-linux-gnu --sysroot=$ROOT"
        export AR=aarch64-linux-gnu-ar READELF=aarch64-linux-gnu-readelf
        export PKG_CONFIG_LIBDIR=$ROOT/usr/lib/aarch64-linux-gnu/pkgconfig:$ROOT/usr/share/pkgconfig
        export PKG_CONFIG_SYSROOT_DIR=$ROOT
        "$SRC/configure" -q --host=aarch64-linux-gnu --build=x86_64-linux-gnu --prefix=$PY_PREFIX \
            --enable-shared --with-ensurepip=no --with-build-python="$(command -v python3.11)" \
            LDFLAGS="-fuse-ld=lld -L$ROOT/usr/lib/aarch64-linux-gnu -Wl,-rpath,$PY_PREFIX/lib" ac_cv_file__dev_ptmx=yes ac_cv_file__dev_ptc=no ac_cv_buggy_getaddrinfo=no >&2
        # pkg-config names usr/include for libffi, but Debian keeps ffi.h in the multiarch include directory;
        # setup.py would then link _ctypes without -lffi
        sed -i "s|^LIBFFI_INCLUDEDIR=.*|LIBFFI_INCLUDEDIR=$ROOT/usr/include/aarch64-linux-gnu|" Makefile
        make -s -j"$(nproc)" >&2
        make -s install DESTDIR="$ROOT" >&2
    )
    in_chroot python3.11 -c "import ssl, ctypes, zlib, bz2, lzma, _decimal, sqlite3" 2>/dev/null \
        || in_chroot python3.11 -c "import ssl, ctypes, zlib, bz2, lzma, _decimal"
    in_chroot python3.11 -m ensurepip >&2
    touch "$ROOT$PY_PREFIX/.kestrel-python-$PY_VERSION"
    rm -rf "$OBJ"
fi

# 3. Build venv inside the root: runtime dependencies + PyInstaller (aarch64 wheels, bootloader included).
log "venv: runtime dependencies + pyinstaller $PYINSTALLER_VERSION"
[ -x "$ROOT/opt/kestrel-venv/bin/python" ] || in_chroot python3.11 -m venv /opt/kestrel-venv
python3.11 "$REPO/build/requirements.py" > "$ROOT/tmp/requirements.txt"
in_chroot /opt/kestrel-venv/bin/python -m pip install -q --disable-pip-version-check \
    "pyinstaller==$PYINSTALLER_VERSION" -r /tmp/requirements.txt >&2

# 3b. numpy's OpenBLAS cut down to the routines numpy calls (build/numpy_blas.sh: -17 MB, -5.6 MB compressed),
#     checked against the wheel's numpy inside the root before it replaces the wheel's library in the executable.
log "numpy BLAS: Debian's static OpenBLAS, cut to numpy's imports"
NUMPY_BLAS=$(bash "$REPO/build/numpy_blas.sh" "$ROOT" /opt/kestrel-venv/lib/python3.11/site-packages /tmp/numpy-blas)
cp "$REPO/build/check_numpy_blas.py" "$ROOT/tmp/check_numpy_blas.py"
in_chroot /opt/kestrel-venv/bin/python /tmp/check_numpy_blas.py "$NUMPY_BLAS" >&2

# 4. The sources (working tree: package, build files, pyproject), native kernels, PyInstaller.
log "pyinstaller under qemu"
rm -rf "$ROOT/src" && mkdir -p "$ROOT/src"
cp -R "$REPO/appliance" "$REPO/build" "$REPO/pyproject.toml" "$REPO/README.md" "$ROOT/src/"
find "$ROOT/src" -name __pycache__ -prune -exec rm -rf {} + -o -name '*.so' -exec rm -f {} +
in_chroot /bin/sh -c "cd /src && \
    export KESTREL_NATIVE_LIB=\$(bash build/native.sh /opt/kestrel-venv/bin/python /tmp/native) && \
    export KESTREL_NUMPY_BLAS=$NUMPY_BLAS && \
    /opt/kestrel-venv/bin/python -m PyInstaller --noconfirm --clean --log-level WARN \
        --distpath /src/dist --workpath /tmp/pyinstaller-work build/pyinstaller.spec >&2"
mkdir -p "$DIST"
install -m 0755 "$ROOT/src/dist/kestrel-appliance" "$DIST/kestrel-appliance"
log "built $DIST/kestrel-appliance: $(stat -c %s "$DIST/kestrel-appliance") bytes"
echo "$ROOT" > "$DIST/sysroot"  # QEMU_LD_PREFIX for running the executable outside the chroot
