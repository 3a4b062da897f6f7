#!/usr/bin/env bash
# Set up what the demo needs (scripts/setup.sh --demo: the package and its MPI wheels in .venv, no
# system package) and run it: real workers, a real fault, and the timeline of detection.
# Arguments go to `trtllm-liveness demo`, e.g. `scripts/demo.sh --compare` (a fault the default setup
# does not catch, with the extension off, then on) or `scripts/demo.sh --fault wedge`; `--help` lists
# them. With `--hosts N` the multi-host demo runs instead (scripts/demo_hosts.py: test hosts made of
# namespaces on this machine; root).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --demo
export PATH="$PWD/.venv/bin:$PATH"
for arg in "$@"; do
  case "$arg" in
    --hosts|--hosts=*) exec .venv/bin/python scripts/demo_hosts.py "$@" ;;
  esac
done
exec trtllm-liveness demo "$@"
