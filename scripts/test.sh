#!/usr/bin/env bash
# Install the project with its test extras into .venv and run the whole test suite (with no arguments: build and
# smoke-test the aarch64 executable first; with arguments: pytest on those only).
set -euo pipefail
cd "$(dirname "$0")/.."
sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/pip install -q --disable-pip-version-check -e '.[test]' 2>&1 | { grep -v '^WARNING: Location' || true; }
# Debian packages the suite drives for real: nginx (tests/system/test_server_proxy.py starts its own reverse proxy),
# the aarch64 cross compiler + qemu-user (tests/system/test_native_qemu_aarch64.py), debootstrap + binfmt + systemd
# (tests/system/test_image_install.py installs into an arm64 root file system and runs systemd-analyze verify),
# chromium (tests/system/test_web_chat.py drives the chat page in it with playwright).
# The aarch64 executable's build (build/build_aarch64.sh, below) cross-compiles CPython with clang/lld here.
# llvm-19 (llvm-mca with a Neoverse N1 = Cortex-A76 model) and the arm64 libstdc++ headers: the board's cost model
# (bench/a76_model.py, tests/native/test_a76_model.py) compiles our kernels and llama.cpp's for the A76 and times them.
packages="nginx gcc-aarch64-linux-gnu qemu-user-static binfmt-support debootstrap systemd chromium
          clang lld binutils-aarch64-linux-gnu pkg-config python3.11 make llvm-19 libstdc++-12-dev-arm64-cross"
missing=$(for p in $packages; do dpkg -s "$p" >/dev/null 2>&1 || echo "$p"; done)
if [ -n "$missing" ]; then
    $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq $missing >/dev/null
fi

# Lint and types first (config in pyproject.toml; the full run only): a finding fails the run here, before the
# build and the tests, with ruff's or mypy's own report of it.
if [ $# -eq 0 ]; then
    t_lint=$(date +%s)
    .venv/bin/python -m ruff check --quiet . \
        || { echo "test.sh: FAILED: ruff (fix the findings above; \`ruff check --fix .\` sorts imports)" >&2; exit 1; }
    .venv/bin/python -m mypy \
        || { echo "test.sh: FAILED: mypy over appliance/ (the errors above)" >&2; exit 1; }
    stages="lint (ruff + mypy) $(( $(date +%s) - t_lint )) s"
    echo "test.sh: $stages"
fi

# The full run (no arguments) first builds and smoke-tests the aarch64 executable boards run: built under qemu
# from a debootstrapped Debian 11 arm64 root (cached in ~/.cache/kestrel-build; from nothing on a fresh machine,
# 18.7 min on two cores at load 6-10), then tests/system/test_frozen_smoke.py runs it under qemu (health, streamed chat, images,
# sd_notify, SIGTERM, one-shot) and build/deb.sh packages it. A failing build is retried (mirrors and PyPI
# flake; cached steps are not repeated); a failure stops here with the log's tail, before the suite.
# KESTREL_AARCH64=0 leaves this stage out of a local full run; CI (.ci/run) always runs it.
if [ $# -eq 0 ] && [ "${KESTREL_AARCH64:-1}" != 0 ]; then
    mkdir -p dist
    log=dist/build-aarch64.log
    t0=$(date +%s)
    for attempt in 1 2 3; do
        if $sudo bash build/build_aarch64.sh >"$log" 2>&1; then
            break
        fi
        echo "test.sh: aarch64 build attempt $attempt failed after $(( $(date +%s) - t0 )) s; last lines of $log:" >&2
        tail -n 25 "$log" >&2
        [ "$attempt" -lt 3 ] || { echo "test.sh: FAILED: aarch64 build (log: $log)" >&2; exit 1; }
        sleep 30
    done
    t1=$(date +%s)
    stages="${stages:+$stages, }aarch64 build $(( t1 - t0 )) s"
    echo "test.sh: aarch64 build $(( t1 - t0 )) s ($(grep -o 'build_aarch64: \[[0-9]*s\] [a-z]*' "$log" | tr '\n' ' '))"
    KESTREL_FROZEN_BINARY=dist/aarch64/kestrel-appliance .venv/bin/python -m pytest -q -p no:cacheprovider \
        tests/system/test_frozen_smoke.py \
        || { echo "test.sh: FAILED: aarch64 smoke test (tests/system/test_frozen_smoke.py under qemu)" >&2; exit 1; }
    t2=$(date +%s)
    deb=$(bash build/deb.sh --arch arm64 2>>"$log") || { echo "test.sh: FAILED: build/deb.sh --arch arm64" >&2; exit 1; }
    stages="$stages, aarch64 smoke $(( t2 - t1 )) s"
    echo "test.sh: aarch64 smoke $(( t2 - t1 )) s; $(stat -c %s dist/aarch64/kestrel-appliance) bytes; $deb"
fi
# The suite (its summary ends with the time per tier, tests/conftest.py), then every stage's time.
t_suite=$(date +%s)
rc=0
.venv/bin/python -m pytest -q "$@" || rc=$?
echo "test.sh: stage times: ${stages:+$stages, }suite $(( $(date +%s) - t_suite )) s (pytest exit $rc)"
exit $rc
