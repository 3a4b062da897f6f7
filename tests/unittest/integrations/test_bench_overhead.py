"""``scripts/bench_overhead.py --quick --json --control`` runs to its end and reports every figure.

The smoke test of the overhead benchmark: real runs (the fake ``tensorrt_llm`` over real MPI ranks,
the extension off and on), one pair per configuration with small counts. It checks the JSON's keys
and types, and that the extension's threads were found where they run; never a figure against its
target (speed is the benchmark's, on a quiet machine).
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.facilities import needs
from tests.support.process_tracker import ProcessTracker
from tests.support.waits import WAIT_SCALE

pytestmark = [pytest.mark.real_process, pytest.mark.timeout(900), needs("mpi")]

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "scripts" / "bench_overhead.py"
FIGURES = ("throughput_ratio", "proxy_cpu_per_request_ratio", "added_latency_p50_us", "added_latency_p99_us",
           "tick_ns", "tick_mean_ns",
           "proxy_cpu_ms_per_s_idle", "rank_cpu_ms_per_s_idle", "threads_added_proxy", "threads_added_rank",
           "rss_added_kib_proxy", "rss_added_kib_rank", "extension_switches_per_request",
           "added_proxy_cpu_us_per_request", "added_leader_cpu_us_per_request")
CONFIGS = ("ranks2_final", "ranks2_streaming")  # --ranks 2: the 8-rank ones are the same code, longer


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def test_quick_json_reports_every_figure_of_every_configuration(procs: ProcessTracker) -> None:
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--quick", "--json", "--control", "--ranks", "2"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    procs.popens.append(proc)
    procs.track(proc.pid)
    out, err = proc.communicate(timeout=600 * WAIT_SCALE)
    # 1: a target missed (this machine may be loaded); a crash prints no JSON.
    assert proc.returncode in (0, 1), err.decode()[-3000:]
    last = out.decode().strip().splitlines()[-1]
    result = json.loads(last)

    for key in FIGURES:
        assert _number(result[key]), (key, result[key])
        assert result[f"{key}_config"] in CONFIGS
    assert result["survivors"] == 0
    assert result["pairs"] == 1 and result["requests_per_run"] > 0
    assert "hub" in result and isinstance(result["hub"], str)
    assert set(result["configs"]) == set(CONFIGS)
    for name, config in result["configs"].items():
        for key in FIGURES:
            assert _number(config[key]), (name, key, config[key])
            spread = config[f"{key}_spread"]
            assert isinstance(spread, list) and len(spread) == 2 and all(_number(v) for v in spread), (name, key)
            assert spread[0] <= config[key] <= spread[1], (name, key)
        # The extension's threads were found where they run, and none without it.
        threads = config["extension_threads"]
        assert {"trtllm-liveness-watcher", "trtllm-liveness-stall", "trtllm-liveness-progress",
                "trtllm-liveness-agent-hub", "trtllm-liveness-metrics"} <= set(threads["proxy"]), threads
        for names in threads["rank"]:
            assert {"trtllm-liveness-proxy-watch", "trtllm-liveness-iterations"} <= set(names), threads
        assert threads["rank_off"] == [[]], threads
        assert config["threads_added_proxy"] >= 5 and config["threads_added_rank"] >= 2
        by_thread = config["proxy_cpu_ms_per_s_idle_by_thread"]
        assert "trtllm-liveness-watcher" in by_thread and all(_number(v) for v in by_thread.values())
        assert config["proxy_cpu_us_per_request_off"] > 0
        assert config["batches_per_request_off"] > 0 and config["batches_per_request_on"] > 0
        # The off/off control: the same figures for two runs without the extension.
        control = config["control"]
        for key in ("throughput_ratio", "proxy_cpu_per_request_ratio", "added_proxy_cpu_us_per_request"):
            assert _number(control[key]), (name, key, control)
            low, high = control[f"{key}_spread"]
            assert low <= control[key] <= high, (name, key, control)
        assert set(control) == {"throughput_ratio", "throughput_ratio_spread", "proxy_cpu_per_request_ratio",
                                "proxy_cpu_per_request_ratio_spread", "added_proxy_cpu_us_per_request",
                                "added_proxy_cpu_us_per_request_spread"}, control
        # The extension's threads' context switches while serving, by thread: each of its proxy threads.
        switched = config["extension_switches_per_request_by_thread"]
        assert set(threads["proxy"]) <= set(switched), switched
        assert all(_number(v) and v >= 0 for v in switched.values()), switched
        added = config["added_proxy_cpu_us_per_request_by_thread"]
        assert "MainThread" in added and all(_number(v) for v in added.values())


def test_the_control_run_takes_each_place_in_a_pair_as_often_as_the_others() -> None:
    """A drift over a pair's runs must not weigh on the off/off control alone: over six pairs each
    run comes first, second and third twice, and off precedes on in half of them."""
    scripts = str(REPO / "scripts")
    sys.path.insert(0, scripts)
    try:
        bench = importlib.import_module("bench_overhead")
    finally:
        sys.path.remove(scripts)
    orders = [bench.run_order(index, True) for index in range(6)]
    assert len(set(orders)) == 6, orders
    for run in ("off", "on", "control"):
        assert sorted(order.index(run) for order in orders) == [0, 0, 1, 1, 2, 2], (run, orders)
    assert sum(order.index("off") < order.index("on") for order in orders) == 3, orders
    assert [bench.run_order(index, False) for index in range(3)] == [("off", "on"), ("on", "off"), ("off", "on")]
