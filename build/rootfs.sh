#!/usr/bin/env bash
# A cached Debian root file system for a foreign architecture, made with debootstrap under qemu user-mode
# emulation (binfmt_misc). Used as the aarch64 build chroot and as the target of the image install test.
#
#   build/rootfs.sh ARCH SUITE DEST [EXTRA_PACKAGES_COMMA_SEPARATED]
#
# Policy: DEST is reused when it holds a finished root file system (marker file .kestrel-rootfs-ok with the
# same arguments); otherwise it is built in DEST.tmp and renamed, so an interrupted run never leaves a half
# root file system that looks finished. Needs root, debootstrap and qemu-user-static.
set -euo pipefail

ARCH=${1:?arch (arm64)} SUITE=${2:?suite (bullseye, bookworm)} DEST=${3:?destination directory}
INCLUDE=${4:-}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
HERE=$(cd "$(dirname "$0")" && pwd)
STAMP="$ARCH $SUITE minbase include=$INCLUDE"

mkdir -p "$(dirname "$DEST")"
exec 9>"$DEST.lock"
flock 9  # two test runs (or a test and a build) wanting the same root wait for one debootstrap

if [ -f "$DEST/.kestrel-rootfs-ok" ] && [ "$(cat "$DEST/.kestrel-rootfs-ok")" = "$STAMP" ]; then
    echo "rootfs: reusing $DEST ($STAMP)" >&2
    exit 0
fi

bash "$HERE/qemu_binfmt.sh" "$ARCH"

# an interrupted debootstrap can leave /proc (or a /dev bind mount) mounted inside: never rm -rf through it
awk -v d="$DEST.tmp/" 'index($2 "/", d) == 1 { print $2 }' /proc/mounts | sort -r | while read -r m; do
    umount -l "$m"
done
rm -rf "$DEST.tmp"
mkdir -p "$(dirname "$DEST")"
echo "rootfs: debootstrap $STAMP -> $DEST" >&2
debootstrap --arch="$ARCH" --variant=minbase ${INCLUDE:+--include="$INCLUDE"} "$SUITE" "$DEST.tmp" "$MIRROR" >&2
echo "$STAMP" > "$DEST.tmp/.kestrel-rootfs-ok"
rm -rf "$DEST"
mv "$DEST.tmp" "$DEST"
