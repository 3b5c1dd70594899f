#!/usr/bin/env bash
# Make sure foreign-architecture executables run here through qemu user-mode emulation:
# qemu-user-static + binfmt_misc (mounted and the qemu-ARCH handler enabled, with the F flag so it also works
# inside chroots). Idempotent.
#
#   build/qemu_binfmt.sh arm64|aarch64
set -euo pipefail

case "${1:-arm64}" in
    arm64|aarch64) QEMU=aarch64 ;;
    *) echo "qemu_binfmt.sh: unsupported architecture ${1}" >&2; exit 2 ;;
esac

if [ ! -x "/usr/bin/qemu-$QEMU-static" ] || ! command -v debootstrap >/dev/null || ! command -v update-binfmts >/dev/null; then
    apt-get install -y -q qemu-user-static binfmt-support debootstrap >&2 \
        || { apt-get update -q >&2 && apt-get install -y -q qemu-user-static binfmt-support debootstrap >&2; }
fi
if [ ! -e /proc/sys/fs/binfmt_misc/status ]; then
    mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
fi
if [ ! -e "/proc/sys/fs/binfmt_misc/qemu-$QEMU" ]; then
    update-binfmts --enable "qemu-$QEMU" >&2
fi
grep -q '^enabled' "/proc/sys/fs/binfmt_misc/qemu-$QEMU" || {
    echo "qemu_binfmt.sh: binfmt handler qemu-$QEMU is not enabled" >&2; exit 1; }
