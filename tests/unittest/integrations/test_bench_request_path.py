"""``scripts/bench_request_path.py --json`` with small counts runs to its end and reports every figure.

Its keys and types only, never a figure against a bound (speed is the benchmark's, on a quiet machine).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.process_tracker import ProcessTracker
from tests.support.waits import WAIT_SCALE

pytestmark = [pytest.mark.real_process, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "scripts" / "bench_request_path.py"


def test_small_run_reports_every_figure(procs: ProcessTracker) -> None:
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--json", "--rounds", "1", "--batches", "300"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    procs.popens.append(proc)
    procs.track(proc.pid)
    out, err = proc.communicate(timeout=200 * WAIT_SCALE)
    assert proc.returncode in (0, 1), err.decode()[-3000:]  # 1: a check missed on a loaded machine
    result = json.loads(out.decode().strip().splitlines()[-1])
    for step in ("dispatch_busy", "dispatch_idle", "submit"):
        for part in ("upstream", "liveness"):
            assert result[f"{step}_{part}_ns"] > 0
        assert isinstance(result[f"{step}_added_ns"], float)
    for key in ("note_submitted_ns", "output_sample_us", "request_added_us", "extension_cpu_us_per_request"):
        assert isinstance(result[key], float) and result[key] > 0, key
    assert result["extension_calls_per_batch"] == 0  # a count, not a speed: nothing of the package per batch
    for key in ("scan_us", "scan_by_path_us"):
        assert set(result[key]) == {"1", "13", "64"} and all(value > 0 for value in result[key].values())
    assert result["rounds"] == 1
