#!/usr/bin/env bash
# Install the Kestrel appliance into a root file system directory (an unpacked or mounted board image):
# the executable, the systemd unit (enabled), the settings file, an API key, the service account and a model.
#
#   image/install.sh --root DIR --binary FILE --model DIR [--model-name NAME]
#                    [--host ADDR] [--port N] [--threads N] [--api-key-file FILE] [--kiosk]
#
# --kiosk also installs and enables kestrel-kiosk.service: the chat page full screen on the board's display
# (cage + Chromium on tty1, as the account kestrel-kiosk; the image needs the packages cage and chromium).
#
# Policy: runs on the build host, never executes anything from the target (the target may be another
# architecture). The account is added with useradd --root (it edits the target's passwd/group/shadow).
# Existing settings and API key are kept: a re-run upgrades binary, unit and model and leaves edits alone
# (the new defaults go to appliance.env.new). Paths inside the target are fixed by the unit file.
set -euo pipefail

usage() { sed -n '4,5p' "$0" | sed 's/^# *//' >&2; exit 2; }
die() { echo "install.sh: $*" >&2; exit 1; }

HERE=$(cd "$(dirname "$0")" && pwd)
ROOT= BINARY= MODEL= MODEL_NAME= HOST=0.0.0.0 PORT=8080 THREADS=4 KEY_FILE= KIOSK=0
while [ $# -gt 0 ]; do
    case "$1" in
        --root) ROOT=${2:?}; shift 2 ;;
        --binary) BINARY=${2:?}; shift 2 ;;
        --model) MODEL=${2:?}; shift 2 ;;
        --model-name) MODEL_NAME=${2:?}; shift 2 ;;
        --host) HOST=${2:?}; shift 2 ;;
        --port) PORT=${2:?}; shift 2 ;;
        --threads) THREADS=${2:?}; shift 2 ;;
        --api-key-file) KEY_FILE=${2:?}; shift 2 ;;
        --kiosk) KIOSK=1; shift ;;
        -h|--help) usage ;;
        *) echo "install.sh: unknown option $1" >&2; usage ;;
    esac
done
[ -n "$ROOT" ] && [ -n "$BINARY" ] && [ -n "$MODEL" ] || usage
[ -d "$ROOT/etc" ] || die "$ROOT does not look like a root file system (no etc/)"
[ -f "$ROOT/etc/passwd" ] || die "$ROOT/etc/passwd is missing"
[ -f "$BINARY" ] || die "binary $BINARY not found"
[ -e "$MODEL" ] || die "model $MODEL not found"
[ -z "$KEY_FILE" ] || [ -s "$KEY_FILE" ] || die "API key file $KEY_FILE is missing or empty"
case "$PORT" in ''|*[!0-9]*) die "--port must be a number" ;; esac
case "$THREADS" in ''|*[!0-9]*) die "--threads must be a number" ;; esac
command -v useradd >/dev/null || die "useradd not found on this host (package passwd / shadow-utils)"
ROOT=$(cd "$ROOT" && pwd)
MODEL_NAME=${MODEL_NAME:-$(basename "$(cd "$(dirname "$MODEL")" && pwd)/$(basename "$MODEL")")}

SVC=kestrel-appliance
BIN_DST=/usr/local/bin/kestrel-appliance
UNIT_DST=/etc/systemd/system/$SVC.service
CONF_DIR=/etc/kestrel-appliance
STATE_DIR=/var/lib/kestrel-appliance
MODEL_DST=$STATE_DIR/models/$MODEL_NAME

# 1. the service account (system user, own group, no login, no home created)
if ! grep -q "^kestrel:" "$ROOT/etc/passwd"; then
    useradd --root "$ROOT" --system --user-group --no-create-home \
        --home-dir "$STATE_DIR" --shell /usr/sbin/nologin --comment "Kestrel appliance" kestrel
fi
GID=$(awk -F: '$1 == "kestrel" { print $3 }' "$ROOT/etc/group")
[ -n "$GID" ] || die "group kestrel missing in $ROOT/etc/group after useradd"
install -D -m 0644 "$HERE/kestrel-appliance.sysusers" "$ROOT/usr/lib/sysusers.d/$SVC.conf"

# 2. executable and unit
install -D -m 0755 "$BINARY" "$ROOT$BIN_DST"
install -D -m 0644 "$HERE/$SVC.service" "$ROOT$UNIT_DST"

# 3. model: root-owned, readable by the service
mkdir -p "$ROOT$STATE_DIR/models"
chmod 0755 "$ROOT$STATE_DIR" "$ROOT$STATE_DIR/models"
rm -rf "$ROOT$MODEL_DST"
cp -R --no-preserve=ownership "$MODEL" "$ROOT$MODEL_DST"
chmod -R u=rwX,go=rX "$ROOT$MODEL_DST"

# 4. settings and API key (kept when present)
install -d -m 0755 "$ROOT$CONF_DIR"
ENV_NEW=$(mktemp)
sed -e "s|@MODEL@|$MODEL_DST|" -e "s|@HOST@|$HOST|" -e "s|@PORT@|$PORT|" -e "s|@THREADS@|$THREADS|" \
    "$HERE/appliance.env" > "$ENV_NEW"
if [ -e "$ROOT$CONF_DIR/appliance.env" ]; then
    install -m 0644 "$ENV_NEW" "$ROOT$CONF_DIR/appliance.env.new"
    echo "install.sh: kept $CONF_DIR/appliance.env; new defaults in appliance.env.new" >&2
else
    install -m 0644 "$ENV_NEW" "$ROOT$CONF_DIR/appliance.env"
fi
rm -f "$ENV_NEW"
if [ -n "$KEY_FILE" ]; then
    install -m 0640 "$KEY_FILE" "$ROOT$CONF_DIR/api-key"
elif [ ! -s "$ROOT$CONF_DIR/api-key" ]; then
    (umask 077; head -c 24 /dev/urandom | base64 | tr '+/' '-_' > "$ROOT$CONF_DIR/api-key")
    echo "install.sh: generated an API key in $CONF_DIR/api-key" >&2
fi
chown "0:$GID" "$ROOT$CONF_DIR/api-key"
chmod 0640 "$ROOT$CONF_DIR/api-key"

# 5. enable: the symlink `systemctl enable` makes for WantedBy=multi-user.target
WANTS=$ROOT/etc/systemd/system/multi-user.target.wants
mkdir -p "$WANTS"
ln -sfn "$UNIT_DST" "$WANTS/$SVC.service"

# 6. optional: the kiosk session (its own account, a writable home for the browser profile, the unit enabled
#    for graphical.target, which becomes the default target)
if [ "$KIOSK" = 1 ]; then
    KIOSK_HOME=/var/lib/kestrel-kiosk
    groups=$(for g in video render input audio; do if grep -q "^$g:" "$ROOT/etc/group"; then echo "$g"; fi; done | paste -sd, -)
    if ! grep -q "^kestrel-kiosk:" "$ROOT/etc/passwd"; then
        useradd --root "$ROOT" --system --user-group --no-create-home ${groups:+--groups "$groups"} \
            --home-dir "$KIOSK_HOME" --shell /usr/sbin/nologin --comment "Kestrel chat kiosk" kestrel-kiosk
    fi
    KUID=$(awk -F: '$1 == "kestrel-kiosk" { print $3 }' "$ROOT/etc/passwd")
    KGID=$(awk -F: '$1 == "kestrel-kiosk" { print $4 }' "$ROOT/etc/passwd")
    install -d -m 0700 -o "$KUID" -g "$KGID" "$ROOT$KIOSK_HOME"
    install -D -m 0644 "$HERE/kestrel-kiosk.service" "$ROOT/etc/systemd/system/kestrel-kiosk.service"
    mkdir -p "$ROOT/etc/systemd/system/graphical.target.wants"
    ln -sfn /etc/systemd/system/kestrel-kiosk.service "$ROOT/etc/systemd/system/graphical.target.wants/kestrel-kiosk.service"
    ln -sfn /lib/systemd/system/graphical.target "$ROOT/etc/systemd/system/default.target"
    for exe in /usr/bin/cage /usr/bin/chromium; do
        [ -x "$ROOT$exe" ] || echo "install.sh: warning: $exe is missing in $ROOT; the kiosk needs the Debian packages cage and chromium" >&2
    done
fi

echo "install.sh: installed $SVC into $ROOT (model $MODEL_DST, port $PORT)" >&2
