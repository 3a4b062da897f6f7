#!/usr/bin/env bash
# Create or refresh the project's virtualenv (.venv) with everything the demo and tests need.
# Idempotent: a second run only checks that the packages are installed.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[mpi,test,dev,metrics,dynamo]"
# Dynamo's TensorRT-LLM engine monitor (the real TrtllmEngineMonitor) for the stock-Dynamo tests:
# the wheel is pure Python and its module imports without its large dependency set.
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps "ai-dynamo==1.6.1"
