"""End to end on real MPI workers: the field failure, and the liveness extension fixing it.

Each scenario runs in a child process in its own session with an outer timeout
(``run_scenario``), which kills every process left in that session afterwards and reports any
survivor: "no process of the test is left" is asserted on that list.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import pytest

from tests.support.facilities import MPI_MARKS, needs
from tests.support.victims import named_in
from tests.support.waits import WAIT_SCALE
from trtllm_liveness.demo._scenario_launcher import run_scenario
from trtllm_liveness.demo._scenario_records import ScenarioResult

pytestmark = [
    pytest.mark.timeout(120),
    *MPI_MARKS,
]

# Bounds for the scenario's own waits; generous, scaled on slow machines, never asserted on.
OBSERVE_S = 15 * WAIT_SCALE
OUTER_TIMEOUT_S = 60 * WAIT_SCALE


def scenario(outer_timeout_s: float = OUTER_TIMEOUT_S, **options: Any) -> ScenarioResult:
    options.setdefault("observe_s", OBSERVE_S)
    run = run_scenario(options, outer_timeout_s)
    assert run.survivors == (), f"processes left behind: {run.survivors}"
    assert run.results and run.done, f"scenario failed: {run.problems()}"
    return run.results[0]


def assert_pre_shutdown_entries(out: ScenarioResult) -> None:
    """pre_shutdown's work ran once; entries are counted where upstream sees them (before its own
    once-flag). On 1.2.x only the extension enters it (its fatal path, then shutdown()); on main
    upstream's own health and monitor paths may enter too, which upstream's flag absorbs."""
    assert out.shutdown is not None and out.shutdown.pre_shutdown_calls is not None
    assert out.shutdown.pre_shutdown_runs == 1
    if out.options.mode == "1.2":
        assert 1 <= out.shutdown.pre_shutdown_calls <= 2
    else:
        assert out.shutdown.pre_shutdown_calls >= 1


def assert_detected(out: ScenarioResult, rank: int) -> None:
    assert out.victim is not None and out.victim.rank == rank
    assert out.detection is not None and out.shutdown is not None
    assert out.in_flight is not None and out.in_flight > 0
    assert out.detection.health_false_ms is not None, "check_health() never turned False"
    assert out.detection.requests_failed_ms is not None, "pending requests did not fail"
    assert out.pending_not_done == 0
    assert named_in(out.victim, out.fatal_error)
    assert out.detection.new_request_error is not None
    assert_pre_shutdown_entries(out)
    assert out.shutdown.shutdown_ms is not None  # shutdown() returned (its bound is the scenario's timeout)
    assert_no_foreign_thread_broken(out)


def assert_no_foreign_thread_broken(out: ScenarioResult) -> None:
    """Only MPI itself may end mpi4py's manager thread (MPI_ERR_PROC_FAILED under ULFM); a future the
    extension failed must never be completed again by it (InvalidStateError), nor any thread of ours die."""
    broken = [m for m in out.thread_exceptions if "MPI_ERR_PROC_FAILED" not in m]
    assert broken == [], broken


@pytest.mark.parametrize(("mode", "rank"), [("main", 1), ("1.2", 0)])
def test_sigkill_with_ft_enabled_is_detected_and_fails_everything(mode: str, rank: int) -> None:
    out = scenario(mode=mode, workers=2, fault="kill", fault_rank=rank)
    assert_detected(out, rank)
    assert out.shutdown is not None
    assert out.fatal_error_type == "WorkerFailedError"
    assert out.events[0].kind == "died"
    assert out.shutdown.fatal_restartable is True
    assert out.shutdown.unkillable == ()


def test_sigkill_of_subordinate_in_12_mode_with_three_workers() -> None:
    out = scenario(mode="1.2", workers=3, fault="kill", fault_rank=2)
    assert_detected(out, 2)
    assert out.detection is not None
    assert out.detection.pending_errors == ("RequestError",)  # 1.2.x has no EngineDeadError: ErrorResponse


def test_without_the_extension_the_engine_hangs_with_green_health() -> None:
    out = scenario(mode="1.2", liveness=False, fault="kill", observe_s=2.0)
    # The field failure: the parent survived, nothing noticed, every request is still pending.
    assert out.detection is not None
    assert out.in_flight is not None and out.in_flight > 0
    assert out.detection.health_false_ms is None
    assert out.pending_not_done == out.in_flight
    assert out.fatal_error is None
    assert out.detection.stall_detected_ms is not None  # the tokens did stop


@pytest.mark.slow
def test_main_without_the_extension_relies_on_the_5s_poll_loop() -> None:
    out = scenario(mode="main", liveness=False, fault="kill", health_probe="fatal_error", observe_s=12.0,
                   tokens=2000, outer_timeout_s=OUTER_TIMEOUT_S * 1.5)
    assert out.fatal_error is not None and "rank 1" in out.fatal_error
    assert out.events == ()
    assert out.detection is not None and out.detection.pending_errors == ("EngineDeadError",)


@pytest.mark.parametrize("mode", ["1.2", "main"])
def test_death_before_ready_fails_construction_naming_the_rank(mode: str) -> None:
    out = scenario(mode=mode, fault="kill", fault_phase="init", init_delay_s=2.0, fault_rank=1)
    assert out.init is not None and out.victim is not None
    assert out.init.hung is False
    assert out.init.error is not None
    assert out.victim.rank == 1 and named_in(out.victim, out.init.error)


@pytest.mark.parametrize("mode", ["1.2", "main"])
def test_failed_spawn_fails_construction_instead_of_hanging(mode: str) -> None:
    out = scenario(mode=mode, fault="spawn")
    assert out.init is not None
    assert out.init.spawn_failed is True  # mpi4py's manager thread died in MPI_Comm_spawn
    assert out.init.hung is False
    assert out.init.error_type == "PoolManagerDiedError"
    assert out.init.error_ms is not None


@pytest.mark.freezer
@needs("freezer")
def test_frozen_worker_is_non_restartable_and_reported_unkillable() -> None:
    out = scenario(mode="main", fault="wedge", fault_rank=1, d_state_timeout_s=0.5, scan_interval_s=0.05)
    assert out.shutdown is not None and out.victim is not None and out.freezer_path is not None
    assert out.events[0].kind == "wedged"
    assert out.shutdown.fatal_restartable is False
    assert "uninterruptible" in str(out.fatal_error)
    assert out.shutdown.unkillable == (out.victim.pid,)
    assert out.shutdown.restartable is False
    assert out.pending_not_done == 0
    assert_no_foreign_thread_broken(out)
    assert not os.path.exists(out.freezer_path), "freezer cgroup not removed"


@pytest.mark.fuse
@needs("fuse")
def test_one_thread_stuck_in_a_fuse_lookup_is_a_wedge_and_unkillable() -> None:
    out = scenario(mode="main", fault="fuse", fault_rank=1, d_state_timeout_s=0.5, scan_interval_s=0.05)
    assert out.shutdown is not None and out.victim is not None
    event = out.events[0]
    assert event.kind == "wedged"
    assert event.tid != out.victim.pid  # a helper thread; the main thread kept serving
    assert "request_wait_answer" in str(out.fatal_error)
    assert out.shutdown.fatal_restartable is False
    assert out.shutdown.unkillable == (out.victim.pid,)
    assert out.pending_not_done == 0
    assert out.survivors == ()  # it died of the pending SIGKILL once the stall was released
    assert_no_foreign_thread_broken(out)


def test_sigstop_is_not_a_death_but_shutdown_still_bounded() -> None:
    out = scenario(mode="1.2", fault="stop", fault_rank=1, shutdown_grace_s=0.5)
    assert out.detection is not None and out.shutdown is not None and out.shutdown.report is not None
    assert out.detection.stall_detected_ms is not None
    assert out.fatal_error is None  # alive and killable: not a liveness event
    assert out.shutdown.report.workers[1].outcome in ("exited-after-term", "exited-after-kill")


def test_healthy_engine_generates_and_shuts_down_cleanly() -> None:
    out = scenario(mode="1.2", fault="none", tokens=5)
    assert out.shutdown is not None and out.shutdown.report is not None
    assert out.tokens_ok is True
    assert out.shutdown.pre_shutdown_runs == 1
    # Upstream sees exactly one entry into pre_shutdown: shutdown()'s own (no fatal path ran).
    assert out.shutdown.pre_shutdown_calls == 1
    assert all(w.outcome == "already-gone" for w in out.shutdown.report.workers)


def test_prte_found_on_path() -> None:
    from trtllm_liveness.demo import configure_mpi_env

    env: dict[str, str] = {"PATH": "/usr/bin"}
    configure_mpi_env(env)
    assert shutil.which("prte", path=env["PATH"]) is not None
    assert env["OMPI_MCA_mpi_ft_enable"] == "1"
    assert "PRTE_MCA_oob_tcp_if_include" not in env
