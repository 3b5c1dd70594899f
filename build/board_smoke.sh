#!/usr/bin/env bash
# Board rehearsal under qemu: install the aarch64 executable and a model into a copy of a pristine Debian 11
# arm64 root file system (no Python, nothing else added) with image/install.sh, then run it the way the unit
# does: chrooted, as the unprivileged `kestrel` user, with the settings from the installed appliance.env and
# a private TMPDIR. Checks /health, a streamed chat ending in [DONE] (with the installed API key) and a clean
# exit 0 on SIGTERM; prints the cold-start time (process start to /health 200).
#
#   build/board_smoke.sh BINARY MODEL_DIR [ROOTFS]      (as root; ROOTFS defaults to the cached bullseye one)
set -euo pipefail

BINARY=$(realpath "${1:?aarch64 kestrel-appliance}") MODEL=$(realpath "${2:?model directory}")
REPO=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${KESTREL_BUILD_CACHE:-$HOME/.cache/kestrel-build}
PRISTINE=${3:-$CACHE/rootfs-arm64-bullseye-systemd}
PORT=${PORT:-18080}
export QEMU_CPU=cortex-a76

[ -d "$PRISTINE" ] || bash "$REPO/build/rootfs.sh" arm64 bullseye "$PRISTINE" systemd,systemd-sysv
WORK=$(mktemp -d)
ROOT=$WORK/root
PID=
cleanup() {
    [ -z "$PID" ] || kill -9 "$PID" 2>/dev/null || true
    umount -l "$ROOT/proc" "$ROOT/dev" 2>/dev/null || true
    rm -rf "$WORK"
}
trap cleanup EXIT
cp -a "$PRISTINE" "$ROOT"
bash "$REPO/image/install.sh" --root "$ROOT" --binary "$BINARY" --model "$MODEL" --model-name smoke \
    --host 127.0.0.1 --port "$PORT" --threads 2
mount -t proc proc "$ROOT/proc"
mount --bind /dev "$ROOT/dev"
UIDGID=$(awk -F: '$1=="kestrel"{print $3":"$4}' "$ROOT/etc/passwd")
mkdir -p "$ROOT/run/kestrel-appliance"  # what RuntimeDirectory= makes
chown "$UIDGID" "$ROOT/run/kestrel-appliance"
chmod 0700 "$ROOT/run/kestrel-appliance"

# the unit's ExecStart, with the installed settings
set -a; . "$ROOT/etc/kestrel-appliance/appliance.env"; set +a
KEY=$(cat "$ROOT$KESTREL_API_KEY_FILE")
START=$(date +%s.%N)
env -i PATH=/usr/bin:/bin TMPDIR=/run/kestrel-appliance QEMU_CPU=$QEMU_CPU \
    "$(command -v chroot)" --userspec="$UIDGID" "$ROOT" /usr/local/bin/kestrel-appliance --model "$KESTREL_MODEL" \
    --host "$KESTREL_HOST" --port "$KESTREL_PORT" --threads "$KESTREL_THREADS" \
    --api-key-file "$KESTREL_API_KEY_FILE" --log-level warning &
PID=$!
until curl -sf -o /dev/null "http://127.0.0.1:$PORT/health"; do
    kill -0 "$PID" 2>/dev/null || { echo "board_smoke: the appliance exited before /health turned 200" >&2; exit 1; }
    sleep 0.2
done
COLD=$(echo "$(date +%s.%N) - $START" | bc)
echo "board_smoke: /health 200 after ${COLD}s (cold start under qemu)" >&2
STREAM=$(curl -sfN "http://127.0.0.1:$PORT/v1/chat/completions" -H "Authorization: Bearer $KEY" \
    -H 'Content-Type: application/json' \
    -d '{"model":"smoke","stream":true,"max_tokens":8,"messages":[{"role":"user","content":"Hello"}]}')
echo "$STREAM" | grep -c '^data: {' | sed 's/^/board_smoke: chunks: /' >&2
[ "$(echo "$STREAM" | grep '^data: ' | tail -1)" = "data: [DONE]" ] || { echo "board_smoke: no [DONE]" >&2; exit 1; }
kill -TERM "$PID"
STATUS=0; wait "$PID" || STATUS=$?
PID=
[ "$STATUS" = 0 ] || { echo "board_smoke: exit status $STATUS after SIGTERM" >&2; exit 1; }
[ -z "$(ls -A "$ROOT/run/kestrel-appliance")" ] || { echo "board_smoke: unpack directory left behind" >&2; exit 1; }
echo "board_smoke: OK (Debian $(cat "$ROOT/etc/debian_version"), glibc $(ls "$ROOT"/usr/lib/aarch64-linux-gnu/libc-*.so | sed 's/.*libc-\(.*\)\.so/\1/'), cold start ${COLD}s, binary $(stat -c %s "$BINARY") bytes)"
