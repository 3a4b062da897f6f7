#!/usr/bin/env bash
# Set everything up and run the demo: real workers, a real fault, and the timeline of detection.
# Arguments go to `trtllm-liveness demo`, e.g. `scripts/demo.sh --compare` (the same fault with the
# extension off, then on) or `scripts/demo.sh --fault wedge`; `--help` lists them.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
exec trtllm-liveness demo "$@"
