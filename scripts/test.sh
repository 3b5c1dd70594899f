#!/usr/bin/env bash
# Install the project with its test extras into .venv and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/pip install -q --disable-pip-version-check -e '.[test]' 2>&1 | { grep -v '^WARNING: Location' || true; }
# Debian packages the suite drives for real: nginx (tests/test_server_proxy.py starts its own reverse proxy),
# the aarch64 cross compiler + qemu-user (tests/test_native_qemu_aarch64.py), debootstrap + binfmt + systemd
# (tests/test_image_install.py installs into an arm64 root file system and runs systemd-analyze verify),
# chromium (tests/test_web_chat.py drives the chat page in it with playwright).
packages="nginx gcc-aarch64-linux-gnu qemu-user-static binfmt-support debootstrap systemd chromium"
missing=$(for p in $packages; do dpkg -s "$p" >/dev/null 2>&1 || echo "$p"; done)
if [ -n "$missing" ]; then
    sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
    $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq $missing >/dev/null
fi
exec .venv/bin/python -m pytest -q "$@"
