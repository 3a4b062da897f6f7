"""End to end on real MPI workers: the field failure, and the liveness extension fixing it.

Each scenario runs in a child process in its own session with an outer timeout
(``run_in_child``), which kills every process left in that session afterwards and reports any
survivor: "no process of the test is left" is asserted on that list.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import pytest

from trtllm_liveness.reference._fuse_stall import fuse_available
from trtllm_liveness.reference._scenario import run_in_child

from ...conftest import MPI_MARKS, WAIT_SCALE, freezer_available

pytestmark = [
    pytest.mark.timeout(120),
    *MPI_MARKS,
]

# Bounds for the scenario's own waits; generous, scaled on slow machines, never asserted on.
OBSERVE_S = 15 * WAIT_SCALE
OUTER_TIMEOUT_S = 60 * WAIT_SCALE


def scenario(outer_timeout_s: float = OUTER_TIMEOUT_S, **options: Any) -> dict[str, Any]:
    options.setdefault("observe_s", OBSERVE_S)
    records, survivors = run_in_child(options, outer_timeout_s)
    assert survivors == [], f"processes left behind: {survivors}"
    results = [r for r in records if "iteration" in r and "phase" in r]
    assert results and records[-1].get("done"), f"scenario failed: {records}"
    return results[0]


def assert_detected(out: dict[str, Any], rank: int) -> None:
    pid = out["victim"]["pid"]
    assert out["victim"]["rank"] == rank
    assert out["in_flight"] > 0
    assert out["health_false_ms"] is not None, "check_health() never turned False"
    assert out["requests_failed_ms"] is not None, "pending requests did not fail"
    assert out["pending_not_done"] == 0
    assert f"rank {rank} (pid {pid})" in out["fatal_error"]
    assert out["new_request_error"] is not None
    assert out["pre_shutdown_calls"] == 1
    assert out["pre_shutdown_runs"] == 1
    assert out["shutdown_ms"] is not None  # shutdown() returned (its bound is the scenario's timeout)
    assert_no_foreign_thread_broken(out)


def assert_no_foreign_thread_broken(out: dict[str, Any]) -> None:
    """Only MPI itself may end mpi4py's manager thread (MPI_ERR_PROC_FAILED under ULFM); a future the
    extension failed must never be completed again by it (InvalidStateError), nor any thread of ours die."""
    broken = [m for m in out["thread_exceptions"] if "MPI_ERR_PROC_FAILED" not in m]
    assert broken == [], broken


@pytest.mark.parametrize(("mode", "rank"), [("main", 1), ("1.2", 0)])
def test_sigkill_with_ft_enabled_is_detected_and_fails_everything(mode: str, rank: int) -> None:
    out = scenario(mode=mode, workers=2, fault="kill", fault_rank=rank)
    assert_detected(out, rank)
    assert out["fatal_error_type"] == "WorkerFailedError"
    assert out["events"][0]["kind"] == "died"
    assert out["fatal_restartable"] is True
    assert out["unkillable"] == []


def test_sigkill_of_subordinate_in_12_mode_with_three_workers() -> None:
    out = scenario(mode="1.2", workers=3, fault="kill", fault_rank=2)
    assert_detected(out, 2)
    assert out["pending_errors"] == ["RequestError"]  # 1.2.x has no EngineDeadError: ErrorResponse


def test_without_the_extension_the_engine_hangs_with_green_health() -> None:
    out = scenario(mode="1.2", liveness=False, fault="kill", observe_s=2.0)
    # The field failure: the parent survived, nothing noticed, every request is still pending.
    assert out["in_flight"] > 0
    assert out["health_false_ms"] is None
    assert out["pending_not_done"] == out["in_flight"]
    assert out["fatal_error"] is None
    assert out["stall_detected_ms"] is not None  # the tokens did stop


@pytest.mark.slow
def test_main_without_the_extension_relies_on_the_5s_poll_loop() -> None:
    out = scenario(mode="main", liveness=False, fault="kill", health_probe="fatal_error", observe_s=12.0,
                   tokens=2000, outer_timeout_s=OUTER_TIMEOUT_S * 1.5)
    assert out["fatal_error"] is not None and "rank 1" in out["fatal_error"]
    assert out["events"] == []
    assert out["pending_errors"] == ["EngineDeadError"]


@pytest.mark.parametrize("mode", ["1.2", "main"])
def test_death_before_ready_fails_construction_naming_the_rank(mode: str) -> None:
    out = scenario(mode=mode, fault="kill", fault_phase="init", init_delay_s=2.0, fault_rank=1)
    assert out["init_hung"] is False
    assert out["init_error"] is not None
    assert f"rank 1 (pid {out['victim']['pid']})" in out["init_error"]


@pytest.mark.parametrize("mode", ["1.2", "main"])
def test_failed_spawn_fails_construction_instead_of_hanging(mode: str) -> None:
    out = scenario(mode=mode, fault="spawn")
    assert out["spawn_failed"] is True  # mpi4py's manager thread died in MPI_Comm_spawn
    assert out["init_hung"] is False
    assert out["init_error_type"] == "PoolManagerDiedError"
    assert out["init_error_ms"] is not None


@pytest.mark.freezer
@pytest.mark.skipif(freezer_available() is not None, reason=str(freezer_available()))
def test_frozen_worker_is_non_restartable_and_reported_unkillable() -> None:
    out = scenario(mode="main", fault="wedge", fault_rank=1, d_state_timeout_s=0.5, scan_interval_s=0.05)
    assert out["events"][0]["kind"] == "wedged"
    assert out["fatal_restartable"] is False
    assert "uninterruptible" in out["fatal_error"]
    assert out["unkillable"] == [out["victim"]["pid"]]
    assert out["restartable"] is False
    assert out["pending_not_done"] == 0
    assert_no_foreign_thread_broken(out)
    assert not os.path.exists(out["freezer_path"]), "freezer cgroup not removed"


@pytest.mark.fuse
@pytest.mark.skipif(fuse_available() is not None, reason=str(fuse_available()))
def test_one_thread_stuck_in_a_fuse_lookup_is_a_wedge_and_unkillable() -> None:
    out = scenario(mode="main", fault="fuse", fault_rank=1, d_state_timeout_s=0.5, scan_interval_s=0.05)
    event = out["events"][0]
    assert event["kind"] == "wedged"
    assert event["tid"] != out["victim"]["pid"]  # a helper thread; the main thread kept serving
    assert "request_wait_answer" in out["fatal_error"]
    assert out["fatal_restartable"] is False
    assert out["unkillable"] == [out["victim"]["pid"]]
    assert out["pending_not_done"] == 0
    assert out["survivors"] == []  # it died of the pending SIGKILL once the stall was released
    assert_no_foreign_thread_broken(out)


def test_sigstop_is_not_a_death_but_shutdown_still_bounded() -> None:
    out = scenario(mode="1.2", fault="stop", fault_rank=1, shutdown_grace_s=0.5)
    assert out["stall_detected_ms"] is not None
    assert out["fatal_error"] is None  # alive and killable: not a liveness event
    assert out["shutdown_report"]["workers"][1]["outcome"] in ("exited-after-term", "exited-after-kill")


def test_healthy_engine_generates_and_shuts_down_cleanly() -> None:
    out = scenario(mode="1.2", fault="none", tokens=5)
    assert out["tokens_ok"] is True
    assert out["pre_shutdown_runs"] == 1
    assert out["pre_shutdown_calls"] == 0
    assert all(w["outcome"] == "already-gone" for w in out["shutdown_report"]["workers"])


def test_prte_found_on_path() -> None:
    from trtllm_liveness.reference import configure_mpi_env

    env: dict[str, str] = {"PATH": "/usr/bin"}
    configure_mpi_env(env)
    assert shutil.which("prte", path=env["PATH"]) is not None
    assert env["OMPI_MCA_mpi_ft_enable"] == "1"
    assert "PRTE_MCA_oob_tcp_if_include" not in env
