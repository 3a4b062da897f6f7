"""``scripts/bench_multihost.py --scale-only --quick --json`` runs to its end and reports every figure,
and ``scripts/bench_detection.py --quick --markdown`` prints the growth table the docs show.

The smoke tests of the many-hosts rig (scripts/_host_scale.py): a real hub alone in a process and
18 hosts (UTS namespaces) of real agent code (the JSON test), 4 (real test hosts where the machine
can make them; the Markdown test), each over 3 real sleeper ranks, killed for real. It checks the
JSON's keys and types (the NVL72 shape's figures and the growth table's host columns), that every host stayed connected
and every kill reached the hub; never a figure against its target (speed is the benchmark's, on a
quiet machine). Both run with ``--host-window 1``: 1 s CPU windows, each after 1 s of settle (twice
the hub's heartbeat timeout idle before the kills), the same figures and keys as the longer windows.
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
DETECTION = REPO / "scripts" / "bench_detection.py"
HOSTS = (18,)  # the NVL72 shape; the markdown test below measures 4 (real test hosts)
METRICS = ("detect_p50_us", "detect_p99_us", "exit_p50_us", "exit_p99_us", "check_us", "diagnosis_ms",
           "idle_cpu_ms_per_s", "hub_cpu_ms_per_s_raw", "agent_cpu_ms_per_s", "memory_kib", "fds", "rss_added_kib")
NVL72 = ("nvl72_hub_cpu_ms_per_s", "nvl72_hub_cpu_ms_per_s_raw", "hub_cpu_ms_per_s_no_hosts",
         "nvl72_agent_cpu_ms_per_s", "nvl72_detect_p50_ms", "nvl72_detect_p99_ms", "nvl72_exit_p99_ms",
         "nvl72_diagnosis_ms", "nvl72_diagnosis_shared_cores_ms")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def run(procs: ProcessTracker, argv: list[str]) -> tuple[list[str], dict[str, Any]]:
    """Run a benchmark to its end: (its output's lines, the JSON object it printed last)."""
    proc = subprocess.Popen([sys.executable, *argv], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    procs.popens.append(proc)
    procs.track(proc.pid)
    out, err = proc.communicate(timeout=180 * WAIT_SCALE)
    # 1: a target missed (this machine may be loaded); a crash prints no JSON.
    assert proc.returncode in (0, 1), err.decode()[-3000:]
    lines = out.decode().strip().splitlines()
    return lines, json.loads(lines[-1])


def test_quick_scale_json_reports_the_nvl72_shape_and_every_host_column(procs: ProcessTracker) -> None:
    _lines, result = run(procs, [str(SCRIPT), "--scale-only", "--quick", "--json", "--host-window", "1",
                                 "--scale-hosts", ",".join(map(str, HOSTS))])

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
        # The whole engine's snapshot came back with every rank (the agents' real diagnosis); how many
        # ranks' stacks came within the stacks bound depends on the cores the hosts share here.
        assert result[f"growth_diagnosis_ranks_hosts_{hosts}"] == 4 * hosts, result
        assert 0 <= result[f"growth_diagnosis_ranks_with_stacks_hosts_{hosts}"] <= 4 * hosts, result
        assert 0 <= result[f"growth_diagnosis_wide_ranks_with_stacks_hosts_{hosts}"] <= 4 * hosts, result
        assert _number(result[f"growth_diagnosis_wide_ms_hosts_{hosts}"]), result
        # 4 hosts run on real test hosts where this machine can make them; 18 are always simulated.
        assert result[f"growth_placement_hosts_{hosts}"] in (("test hosts", "simulated") if hosts == 4
                                                             else ("simulated",))
        by_thread = result[f"growth_hub_cpu_ms_per_s_by_thread_hosts_{hosts}"]
        assert by_thread and all(_number(v) for v in by_thread.values()), by_thread
    # 128 hosts were not asked for: their figures are absent, not made up.
    assert result["proxy_cpu_ms_per_s_128_hosts"] is None


def test_quick_markdown_prints_the_growth_table_with_its_command(procs: ProcessTracker) -> None:
    """One ranks column and one hosts column measured: the Markdown table has every column of the
    docs' table (``-`` where not measured), every row, the command that made it, and its figures
    are the JSON's."""
    lines, result = run(procs, [str(DETECTION), "--quick", "--markdown", "--json", "--growth-ranks", "8",
                                "--growth-hosts", "4", "--host-window", "1"])
    command = lines.index("`.venv/bin/python scripts/bench_detection.py --quick --markdown --json --growth-ranks 8 "
                          "--growth-hosts 4 --host-window 1`:")
    table = lines[command + 2:command + 8]
    assert table[0] == "| cost | 8 ranks | 64 | 256 | 1024 | 4 hosts | 18 (NVL72) | 128 |", table
    assert table[1] == "|---|---|---|---|---|---|---|---|"
    rows = {row.split(" | ")[0].lstrip("| "): row.strip("| ").split(" | ")[1:] for row in table[2:]}
    assert list(rows) == ["kill -> event, p50/p99 µs", "one check, µs", "idle CPU, ms/s", "memory, KiB"], rows
    assert all(len(cells) == 7 for cells in rows.values()), rows
    assert lines[command + 8] == "" and lines[command + 9].startswith("Ranks columns:")
    for metric in ("check_us", "idle_cpu_ms_per_s", "memory_kib", "fds"):
        assert _number(result[f"growth_{metric}_8"]) and _number(result[f"growth_{metric}_hosts_4"]), metric
        assert f"growth_{metric}_64" not in result and f"growth_{metric}_hosts_18" not in result, metric
    check = rows["one check, µs"]
    assert check[0] == f"{result['growth_check_us_8']:.1f}" and check[4] == f"{result['growth_check_us_hosts_4']:.1f}"
    assert check[1] == check[5] == "-", check
    assert _number(result["growth_agent_cpu_ms_per_s_hosts_4"])
    # 4 hosts run on real test hosts where this machine can make them; every kill reached the hub.
    assert result["growth_placement_hosts_4"] in ("test hosts", "simulated")
    assert result["growth_hosts_connected_at_end_hosts_4"] == 4 and result["growth_kills_hosts_4"] == 5
