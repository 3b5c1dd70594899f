#!/usr/bin/env bash
# Install into .venv, build a tiny random Qwen3 model (real tokenizer), and serve it on 127.0.0.1:8080.
# Extra arguments go to kestrel-appliance, e.g.: bash scripts/run.sh --prompt "Hello"
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/pip install -q --disable-pip-version-check -e '.[test]'
model=.cache/models/tiny-qwen3
[ -f "$model/config.json" ] || .venv/bin/python -m tests.support.tiny_models "$model" >/dev/null
exec .venv/bin/kestrel-appliance --model "$model" "$@"
