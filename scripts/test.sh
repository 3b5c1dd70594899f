#!/usr/bin/env bash
# Install the project with its test extras into .venv and run the whole test suite (with no arguments: build and
# smoke-test the aarch64 executable first; with arguments: pytest on those only).
set -euo pipefail
cd "$(dirname "$0")/.."
t_start=$(date +%s)
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

# The full run (no arguments) also builds and smoke-tests the aarch64 executable boards run: built under qemu
# from a debootstrapped Debian 11 arm64 root (cached in ~/.cache/kestrel-build; from nothing on a fresh machine,
# 19-37 min on two cores, most of it one qemu-emulated process), then tests/system/test_frozen_smoke.py runs it
# under qemu (health, streamed chat, images, sd_notify, SIGTERM, one-shot) and build/deb.sh packages it.
# Policy (CI's time budget): the build runs in the background while the suite runs, since the two are
# independent (the build copies the sources and works in its own chroot; the root file systems it shares with
# tests/system/test_image_install.py are built under a lock) and the build is mostly one emulated process, so
# the second core does the suite's work meanwhile. The smoke test and the package wait for both. A failing build
# is retried (mirrors and PyPI flake; cached steps are not repeated); a build that still fails fails the run with
# its log's tail. KESTREL_AARCH64=0 leaves this stage out of a local full run; CI (.ci/run) always runs it.
build_pid=""
if [ $# -eq 0 ] && [ "${KESTREL_AARCH64:-1}" != 0 ]; then
    mkdir -p dist
    log=dist/build-aarch64.log status=dist/build-aarch64.status
    rm -f "$status" "$log.failures"
    $sudo bash build/qemu_binfmt.sh arm64  # once here: the build and the suite's qemu tests would both enable it
    t0=$(date +%s)
    (
        for attempt in 1 2 3; do
            if $sudo bash build/build_aarch64.sh >"$log" 2>&1; then
                echo "ok $(( $(date +%s) - t0 ))" >"$status"; exit 0
            fi
            { echo "test.sh: aarch64 build attempt $attempt failed after $(( $(date +%s) - t0 )) s; last lines:"
              tail -n 25 "$log"; } >>"$log.failures"
            [ "$attempt" -lt 3 ] || { echo "failed $(( $(date +%s) - t0 ))" >"$status"; exit 1; }
            sleep 30
        done
    ) </dev/null &
    build_pid=$!
    trap '[ -z "$build_pid" ] || kill "$build_pid" 2>/dev/null || true' EXIT
    echo "test.sh: aarch64 build started in the background (log: $log)"
fi
# The suite (its summary ends with the time per tier, tests/conftest.py).
t_suite=$(date +%s)
rc=0
.venv/bin/python -m pytest -q "$@" || rc=$?
t_suite_end=$(date +%s)
stages="${stages:+$stages, }suite $(( t_suite_end - t_suite )) s (pytest exit $rc)"
if [ -n "$build_pid" ]; then
    wait "$build_pid" || true
    build_pid=""
    read -r build_result build_seconds <"$status" || build_result=missing
    [ ! -f "$log.failures" ] || cat "$log.failures" >&2
    if [ "$build_result" != ok ]; then
        echo "test.sh: FAILED: aarch64 build (log: $log)" >&2
        echo "test.sh: stage times: $stages" >&2
        exit 1
    fi
    stages="$stages, aarch64 build ${build_seconds} s (beside the suite; waited $(( $(date +%s) - t_suite_end )) s after it)"
    echo "test.sh: aarch64 build ${build_seconds} s ($(grep -o 'build_aarch64: \[[0-9]*s\] [a-z]*' "$log" | tr '\n' ' '))"
    t1=$(date +%s)
    KESTREL_FROZEN_BINARY=dist/aarch64/kestrel-appliance .venv/bin/python -m pytest -q -p no:cacheprovider \
        tests/system/test_frozen_smoke.py \
        || { echo "test.sh: FAILED: aarch64 smoke test (tests/system/test_frozen_smoke.py under qemu)" >&2; exit 1; }
    t2=$(date +%s)
    deb=$(bash build/deb.sh --arch arm64 2>>"$log") || { echo "test.sh: FAILED: build/deb.sh --arch arm64" >&2; exit 1; }
    stages="$stages, aarch64 smoke $(( t2 - t1 )) s"
    echo "test.sh: aarch64 smoke $(( t2 - t1 )) s; $(stat -c %s dist/aarch64/kestrel-appliance) bytes; $deb"
fi
echo "test.sh: stage times: $stages, total $(( $(date +%s) - t_start )) s"
exit $rc
