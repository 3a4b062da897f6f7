#!/usr/bin/env bash
# Set everything up and run the whole test suite, lint and type checks included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
echo "== ruff"; ruff check trtllm_liveness tests scripts
echo "== mypy --strict"; mypy --strict trtllm_liveness
echo "== pytest"; exec pytest "$@"
