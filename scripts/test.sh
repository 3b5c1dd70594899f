#!/usr/bin/env bash
# Install the project with its test extras into .venv and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/pip install -q --disable-pip-version-check -e '.[test]' 2>&1 | { grep -v '^WARNING: Location' || true; }
# nginx (Debian package): tests/test_server_proxy.py starts its own nginx on loopback as a reverse proxy.
if ! command -v nginx >/dev/null && [ ! -x /usr/sbin/nginx ]; then
    sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
    $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq nginx >/dev/null
fi
exec .venv/bin/python -m pytest -q "$@"
