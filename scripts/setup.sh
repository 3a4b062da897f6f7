#!/usr/bin/env bash
# Create or refresh the project's virtualenv (.venv) with everything the demo and tests need.
# Idempotent: a second run only checks that the packages are installed. pip's output goes to
# .venv/setup.log and is shown only when something fails.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
log=.venv/setup.log
pip_install() {
  if ! .venv/bin/python -m pip install -q --disable-pip-version-check "$@" >>"$log" 2>&1; then
    cat "$log" >&2
    echo "setup: pip install $* failed (log above, also in $log)" >&2
    exit 1
  fi
}
: >"$log"
pip_install --upgrade pip
pip_install -e ".[mpi,test,dev,metrics,dynamo]"
# Dynamo's TensorRT-LLM engine monitor (the real TrtllmEngineMonitor) for the stock-Dynamo tests:
# the wheel is pure Python and its module imports without its large dependency set.
pip_install --no-deps "ai-dynamo==1.6.1"
