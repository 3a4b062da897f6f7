"""``scripts/bench_multihost.py --scale-only --quick --json`` runs to its end and reports every figure.

The smoke test of the many-hosts rig (scripts/_host_scale.py): a real hub alone in a process and
4 and 18 hosts of real agent code in UTS namespaces of their own, each over 3 real sleeper ranks,
killed for real. It checks the JSON's keys and types (the NVL72 shape's figures and the growth
table's host columns), that every host stayed connected and every kill reached the hub; never a
figure against its target (speed is the benchmark's, on a quiet machine).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.facilities import needs
from tests.support.process_tracker import ProcessTracker
from tests.support.waits import WAIT_SCALE

pytestmark = [pytest.mark.real_process, pytest.mark.timeout(240), needs("mpi", "unshare")]

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "scripts" / "bench_multihost.py"
HOSTS = (4, 18)
METRICS = ("detect_p50_us", "detect_p99_us", "exit_p50_us", "exit_p99_us", "check_us", "idle_cpu_ms_per_s",
           "hub_cpu_ms_per_s_raw", "agent_cpu_ms_per_s", "memory_kib", "fds", "rss_added_kib")
NVL72 = ("nvl72_hub_cpu_ms_per_s", "nvl72_hub_cpu_ms_per_s_raw", "hub_cpu_ms_per_s_no_hosts",
         "nvl72_agent_cpu_ms_per_s", "nvl72_detect_p50_ms", "nvl72_detect_p99_ms", "nvl72_exit_p99_ms")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def test_quick_scale_json_reports_the_nvl72_shape_and_every_host_column(procs: ProcessTracker) -> None:
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--scale-only", "--quick", "--json", "--scale-hosts",
                             ",".join(map(str, HOSTS))], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    procs.popens.append(proc)
    procs.track(proc.pid)
    out, err = proc.communicate(timeout=180 * WAIT_SCALE)
    # 1: a target missed (this machine may be loaded); a crash prints no JSON.
    assert proc.returncode in (0, 1), err.decode()[-3000:]
    result = json.loads(out.decode().strip().splitlines()[-1])

    assert result["host_scale_failed_starts"] == {} and result["host_scale_null_reason"] is None, result
    assert result["host_scale_hosts"] == list(HOSTS)
    assert result["nvl72_hosts"] == 18 and result["nvl72_ranks"] == 72
    for key in NVL72:
        assert _number(result[key]), (key, result[key])
    for hosts in HOSTS:
        for metric in METRICS:
            key = f"growth_{metric}_hosts_{hosts}"
            assert _number(result[key]), (key, result[key])
        # The real agents stayed connected through the idle window and the kills, and every kill
        # (5 in --quick) reached the hub as its event.
        assert result[f"growth_hosts_connected_at_end_hosts_{hosts}"] == hosts
        assert result[f"growth_kills_hosts_{hosts}"] == 5
        assert result[f"growth_ranks_hosts_{hosts}"] == 4 * hosts
        by_thread = result[f"growth_hub_cpu_ms_per_s_by_thread_hosts_{hosts}"]
        assert by_thread and all(_number(v) for v in by_thread.values()), by_thread
    # 128 hosts were not asked for: their figures are absent, not made up.
    assert result["proxy_cpu_ms_per_s_128_hosts"] is None
