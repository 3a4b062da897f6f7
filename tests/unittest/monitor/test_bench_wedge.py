"""``scripts/bench_wedge.py --json`` with a few short wedges runs to its end, reports every figure and
leaves nothing behind.

Its keys, the wedges it saw and the slow reader's silence only, never a figure against a bound
(speed is the benchmark's, on a quiet machine).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.process_tracker import ProcessTracker
from tests.support.waits import WAIT_SCALE
from trtllm_liveness.demo._fuse_stall import fuse_mounts

pytestmark = [pytest.mark.real_process, pytest.mark.freezer, pytest.mark.fuse, pytest.mark.timeout(180)]

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "scripts" / "bench_wedge.py"
KEYS = {"wedges", "detected", "sources", "timeout_s", "scan_interval_s", "floor_overshoot_ms",
        "wedge_overshoot_p50_ms", "wedge_overshoot_p99_ms", "wedge_overshoot_max_ms",
        "wedge_overshoot_after_first_sample_p99_ms", "bare_sampler_overshoot_p50_ms",
        "bare_sampler_overshoot_p99_ms", "wedge_overshoot_freezer_p99_ms", "wedge_overshoot_fuse_p99_ms",
        "false_wedges_slow_io", "slow_reads_answered", "seed", "wall_s"}


def _bench_groups() -> list[str]:
    return [name for name in os.listdir("/sys/fs/cgroup/freezer") if name.startswith("trtllm-liveness-bench")]


def test_small_run_reports_every_figure_and_leaves_nothing(procs: ProcessTracker) -> None:
    mounts_before = set(fuse_mounts())
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--json", "--wedges", "2", "--timeout-s", "0.5",
                             "--interval-s", "0.2"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    procs.popens.append(proc)
    procs.track(proc.pid)
    out, err = proc.communicate(timeout=120 * WAIT_SCALE)
    assert proc.returncode == 1, err.decode()[-3000:]  # 1: fewer than 10 wedges misses that target
    result = json.loads(out.decode().strip().splitlines()[-1])
    assert set(result) == KEYS
    assert result["wedges"] == result["detected"] == 2 and result["sources"] == ["freezer", "fuse"]
    assert result["false_wedges_slow_io"] == 0 and result["slow_reads_answered"] > 0
    assert isinstance(result["wedge_overshoot_p99_ms"], float) and result["wedge_overshoot_p99_ms"] >= 0
    assert "FAIL  wedges >= 10 (2)" in out.decode()
    assert _bench_groups() == [] and set(fuse_mounts()) <= mounts_before
