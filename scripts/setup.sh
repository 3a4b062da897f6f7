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
# System packages, installed only where missing and apt-get can run (root on Debian/Ubuntu);
# elsewhere the tests that need them skip (or fail where CI requires the facility).
# prometheus: promtool, which checks docs/alerts.yml (facility "promtool").
apt_packages=()
command -v promtool >/dev/null 2>&1 || apt_packages+=(prometheus)
# slurm-wlm, munge: the one-node Slurm cluster the quarantine tests start (facility "slurm").
# policy-rc.d-free installs may start the packaged daemons; the tests start their own on other
# ports and sockets, so those do not matter.
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
# The checkout's root on the virtualenv's path: scripts/ import the test support (tests.support) as a
# package, as pytest does, whatever directory they are run from.
site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
printf '%s\n' "$PWD" >"$site/trtllm_liveness_checkout.pth"
# Dynamo's TensorRT-LLM engine monitor (the real TrtllmEngineMonitor) for the stock-Dynamo tests:
# the wheel is pure Python and its module imports without its large dependency set.
pip_install --no-deps "ai-dynamo==1.6.1"
