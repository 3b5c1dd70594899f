#!/usr/bin/env bash
# Make the Debian package of the one-file executable: kestrel-appliance_VERSION_ARCH.deb (dpkg-deb).
#
#   build/deb.sh [--arch arm64|amd64] [--binary FILE] [--version V] [--out DIR] [--libc X.Y]
#
# Defaults: arm64, dist/aarch64/kestrel-appliance (amd64: dist/x86_64/...), the version in pyproject.toml,
# dist/. Contents: /usr/bin/kestrel-appliance, the systemd unit (/lib/systemd/system, image/'s unit with the
# /usr/bin path), the sysusers.d entry, /etc/kestrel-appliance/appliance.env (a conffile: dpkg keeps the
# user's edits), maintainer scripts (build/deb/): postinst creates the account and an API key and enables the
# unit, starting it only on a running systemd (never in a chroot / image build); purge removes everything but
# /var/lib/kestrel-appliance/models. Depends on libc6 >= the highest glibc the executable needs
# (build/glibc_needs.py, run by a Python with PyInstaller: $KESTREL_BUILD_PYTHON, the x86_64 build venv or a venv
# of its own in ~/.cache/kestrel-build/venv-tools),
# unless --libc is given.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${KESTREL_BUILD_CACHE:-$HOME/.cache/kestrel-build}
ARCH=arm64 BINARY= VERSION= OUT=$REPO/dist LIBC=
die() { echo "deb.sh: $*" >&2; exit 1; }
while [ $# -gt 0 ]; do
    case "$1" in
        --arch) ARCH=${2:?}; shift 2 ;;
        --binary) BINARY=${2:?}; shift 2 ;;
        --version) VERSION=${2:?}; shift 2 ;;
        --out) OUT=${2:?}; shift 2 ;;
        --libc) LIBC=${2:?}; shift 2 ;;
        -h|--help) sed -n '4,5p' "$0" | sed 's/^# *//' >&2; exit 2 ;;
        *) die "unknown option $1" ;;
    esac
done
case "$ARCH" in
    arm64) ELF=aarch64 ;;
    amd64) ELF=x86_64 ;;
    *) die "--arch must be arm64 or amd64" ;;
esac
BINARY=${BINARY:-$REPO/dist/$ELF/kestrel-appliance}
[ -f "$BINARY" ] || die "executable $BINARY not found (build/build_$ELF.sh makes it)"
machine=$(od -An -tu2 -j18 -N2 "$BINARY" | tr -d ' ')
case "$ELF:$machine" in
    aarch64:183|x86_64:62) ;;
    *) die "$BINARY is not an $ELF executable (ELF machine $machine)" ;;
esac
VERSION=${VERSION:-$(python3 -c 'import sys, tomllib; print(tomllib.load(open(sys.argv[1], "rb"))["project"]["version"])' "$REPO/pyproject.toml")}
if [ -z "$LIBC" ]; then
    PY=${KESTREL_BUILD_PYTHON:-$CACHE/venv-x86_64/bin/python}
    if ! { [ -x "$PY" ] && "$PY" -c "import PyInstaller" 2>/dev/null; }; then  # a small venv of its own
        PY=$CACHE/venv-tools/bin/python
        [ -x "$PY" ] || python3 -m venv "$CACHE/venv-tools"
        "$PY" -m pip install -q --disable-pip-version-check "pyinstaller==${PYINSTALLER_VERSION:-6.22.3}" >&2 \
            || die "cannot install PyInstaller (to read the glibc need); pass --libc X.Y"
    fi
    LIBC=$("$PY" "$REPO/build/glibc_needs.py" "$BINARY" | sed -n 's/^glibc minimum: \([0-9.]*\).*/\1/p')
    [ -n "$LIBC" ] || die "glibc_needs.py found no glibc version in $BINARY"
fi

PKG=kestrel-appliance
STAGE=$(mktemp -d)
chmod 0755 "$STAGE"
trap 'rm -rf "$STAGE"' EXIT
install -D -m 0755 "$BINARY" "$STAGE/usr/bin/$PKG"
install -d "$STAGE/lib/systemd/system"
sed -e "s|/usr/local/bin/$PKG|/usr/bin/$PKG|g" "$REPO/image/$PKG.service" > "$STAGE/lib/systemd/system/$PKG.service"
install -D -m 0644 "$REPO/image/$PKG.sysusers" "$STAGE/usr/lib/sysusers.d/$PKG.conf"
install -d "$STAGE/etc/$PKG"
sed -e "s|@MODEL@|/var/lib/$PKG/models/default|" -e "s|@HOST@|0.0.0.0|" -e "s|@PORT@|8080|" -e "s|@THREADS@|4|" \
    "$REPO/image/appliance.env" > "$STAGE/etc/$PKG/appliance.env"
chmod 0644 "$STAGE/etc/$PKG/appliance.env" "$STAGE/lib/systemd/system/$PKG.service"
install -d "$STAGE/usr/share/doc/$PKG"
cat > "$STAGE/usr/share/doc/$PKG/copyright" <<'TXT'
Kestrel appliance: an OpenAI-compatible LLM inference service. The executable bundles CPython, numpy (with
OpenBLAS), tokenizers, Pillow, trio, h11, jinja2 and gguf under their own licenses.
TXT

install -d "$STAGE/DEBIAN"
for s in postinst prerm postrm; do install -m 0755 "$REPO/build/deb/$s" "$STAGE/DEBIAN/$s"; done
echo "/etc/$PKG/appliance.env" > "$STAGE/DEBIAN/conffiles"
SIZE=$(du -sk --exclude=DEBIAN "$STAGE" | cut -f1)
cat > "$STAGE/DEBIAN/control" <<TXT
Package: $PKG
Version: $VERSION
Architecture: $ARCH
Maintainer: Kestrel appliance developers <kestrel@localhost>
Installed-Size: $SIZE
Depends: libc6 (>= $LIBC), passwd, init-system-helpers (>= 1.50)
Section: net
Priority: optional
Description: OpenAI-compatible LLM inference service for Arm edge boards
 Serves Qwen3 (dense, MoE, VL) and Llama/Qwen2 GGUF models from local files over an
 OpenAI-compatible HTTP API, streaming every token as a Server-Sent Event. One
 self-contained executable, run by kestrel-appliance.service as the unprivileged
 kestrel user; settings in /etc/kestrel-appliance/appliance.env, models under
 /var/lib/kestrel-appliance/models.
TXT
mkdir -p "$OUT"
DEB=$OUT/${PKG}_${VERSION}_${ARCH}.deb
dpkg-deb --root-owner-group -Zxz --build "$STAGE" "$DEB" >/dev/null
echo "$DEB"
