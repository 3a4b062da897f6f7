#!/bin/sh
# Install trtllm-liveness from the one wheel in WHEEL_DIR into the Python first on PATH, with the
# extras in $TRTLLM_LIVENESS_EXTRAS (default k8s: the node helper's cordon and taint), then its
# autoload (a .pth: every Python of that environment installs the import hook when
# TRTLLM_WORKER_LIVENESS switches liveness on), and check both.
#
#   sh docs/image-install.sh WHEEL_DIR
#
# docs/Dockerfile runs it in TensorRT-LLM's release image; tests/unittest/packaging/test_image_install.py
# runs it in a fresh virtualenv, so both run the same steps.
set -eu
if [ $# -ne 1 ]; then
    echo "usage: image-install.sh WHEEL_DIR" >&2
    exit 2
fi
extras=${TRTLLM_LIVENESS_EXTRAS-k8s}
set -- "$1"/trtllm_liveness-*.whl
if [ $# -ne 1 ] || [ ! -f "$1" ]; then
    echo "image-install.sh: expected one trtllm_liveness wheel, found: $*" >&2
    exit 1
fi
wheel=$1
# The package has no dependencies (the image's mpi4py and pyzmq serve): installed alone, it cannot
# replace anything the image ships. An extra brings its own (k8s: the kubernetes client).
python3 -m pip install --no-cache-dir --no-deps "$wheel"
if [ -n "$extras" ]; then
    python3 -m pip install --no-cache-dir "$wheel[$extras]"
fi
trtllm-liveness autoload install
trtllm-liveness autoload status
trtllm-liveness --version
