"""The engine under adverse conditions: a dead watcher, concurrent health checks, descriptor leaks.

The executor-level tests run the reference executor on real MPI workers in a child process in
its own session (``run_scenario``, which kills and reports whatever it left behind). The monitor
in a forked child is covered by ``test_monitor.py::test_monitor_in_forked_child_is_inert``.
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Any

import pytest

from tests.support.facilities import needs
from tests.support.process_tracker import ProcessTracker
from tests.support.victims import named_in
from tests.support.waits import WAIT_SCALE, wait_until
from trtllm_liveness.demo._scenario_launcher import run_scenario
from trtllm_liveness.demo._scenario_records import ScenarioResult
from trtllm_liveness.monitor import WorkerProcessMonitor
from trtllm_liveness.process import capture_identity

needs_mpi = needs("mpi")

pytestmark = [pytest.mark.timeout(150), pytest.mark.real_process]

OBSERVE_S = 15 * WAIT_SCALE


def scenario(**options: Any) -> tuple[ScenarioResult, ...]:
    options.setdefault("observe_s", OBSERVE_S)
    options.setdefault("tokens", 300)
    run = run_scenario(options, 60 * WAIT_SCALE + 15 * options.get("iterations", 1))
    assert run.survivors == (), f"processes left behind: {run.survivors}"
    assert run.results and run.done, f"scenario failed: {run.problems()}"
    for result in run.results:
        assert result.survivors == ()
    return run.results


def test_dead_watcher_leaves_synchronous_checks_working(
    procs: ProcessTracker, caplog: pytest.LogCaptureFixture
) -> None:
    child = procs.sleeper()
    identity = capture_identity(0, child.pid)
    with WorkerProcessMonitor(d_state_timeout_s=5, scan_interval_s=0.01) as monitor:
        monitor.register([identity])

        def broken_tick(*args: object) -> None:
            del monitor._watch_handle  # type: ignore[method-assign]  # raise once
            raise RuntimeError("injected watcher failure")

        monitor._watch_handle = broken_tick  # type: ignore[method-assign]
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
    assert out.watcher is not None and out.detection is not None and out.shutdown is not None
    assert out.watcher.alive_at_fault is False
    assert "injected watcher failure" in out.watcher.error
    assert any("watcher thread died" in message for message in out.critical_logs)
    assert out.detection.health_false_ms is not None, "check_health() stayed True with the watcher dead"
    assert out.victim is not None and out.victim.rank == 1 and named_in(out.victim, out.fatal_error)
    assert out.pending_not_done == 0
    assert out.shutdown.pre_shutdown_runs == 1


@needs_mpi
@pytest.mark.mpi
@pytest.mark.parametrize(("mode", "rank"), [("main", 1), ("1.2", 0)])
def test_concurrent_check_health_is_consistent_and_pre_shutdown_runs_once(mode: str, rank: int) -> None:
    for out in scenario(mode=mode, fault="kill", fault_rank=rank, health_threads=16, iterations=2):
        probe, shutdown = out.health_probe, out.shutdown
        assert probe is not None and shutdown is not None
        assert probe.errors == () and probe.threads_alive == 0
        assert probe.false_answers > 0
        assert probe.inconsistent == 0, "a True answer after the first False"
        assert out.victim is not None and out.victim.rank == rank and named_in(out.victim, out.fatal_error)
        assert shutdown.pre_shutdown_runs == 1
        # Entries into upstream's pre_shutdown, counted where upstream would see them (before its own
        # once-flag). On 1.2.x only the extension enters (fatal path, shutdown): sixteen racing
        # check_health() threads must not add one each. On main upstream's own check_health enters
        # it on a fatal error in every calling thread, which its flag absorbs.
        assert shutdown.pre_shutdown_calls is not None and shutdown.pre_shutdown_calls >= 1
        if mode == "1.2":
            assert shutdown.pre_shutdown_calls <= 2


@needs_mpi
@pytest.mark.mpi
def test_no_pidfd_or_fd_leak_across_executor_start_fatal_shutdown_cycles() -> None:
    results = scenario(mode="main", fault="kill", fault_rank=1, iterations=5)
    assert [r.pidfds_open for r in results] == [0] * 5
    fds = [r.fds_open for r in results]
    assert None not in fds, fds
    # The first cycle initialises MPI and ZMQ for good; a leak would grow by >= 1 every cycle after.
    assert fds[-1] - fds[1] < 3, f"descriptors grow per cycle: {fds}"
