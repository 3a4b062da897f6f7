#!/usr/bin/env bash
# Set everything up and run the demo: real workers, a real fault, and the timeline of detection.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
exec trtllm-liveness demo "$@"
