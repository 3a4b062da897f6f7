"""Stalled engines on the upstream-shaped fakes: real MPI ranks that stop making progress.

Each test runs ``tests/programs/stall_child.py`` in a child of its own session (tracked by the
``procs`` fixture) and asserts on the JSON record it prints. The stalls are real: a rank whose step
loop blocks forever on an event (user space), a subordinate that stops answering (the leader then
waits in its MPI receive), a busy-spinning rank, a SIGSTOPped rank. Never a stall: an idle engine
for three timeouts, and a non-streaming request that runs for three timeouts while the executor
iterates (main's ``HangDetector.checkpoint()``, counted by the rank entry). Timing is not asserted:
the child watches within a bound; the benchmarks measure how late a stall is seen.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.children import HelperProcess
from tests.support.facilities import MPI_MARKS, facility_unavailable
from tests.support.process_tracker import ProcessTracker
from tests.support.waits import WAIT_SCALE

pytestmark = [pytest.mark.timeout(120), *MPI_MARKS]

COMMON = "enabled=1,scan_interval_s=0.05,shutdown_grace_s=0.5,shutdown_term_s=0.5,shutdown_kill_s=1"
FUNCTIONS = {"block": "_block_forever", "silent": "_stop_answering", "spin": "_spin_forever", "stop": "_maybe_stall"}


def run_child(procs: ProcessTracker, options: dict[str, Any], config: str) -> dict[str, Any]:
    helper = HelperProcess("stall_child", options, {"TRTLLM_WORKER_LIVENESS": f"{COMMON},{config}"})
    procs.popens.append(helper.popen)
    procs.track(helper.pid)
    try:
        helper.read_record(60 * WAIT_SCALE, "identities")
        record = helper.read_record(90 * WAIT_SCALE, "events")
        status = helper.wait_exit(30 * WAIT_SCALE)
        assert status == 0, helper.stderr_tail(4000)
        return record
    finally:
        helper.close()


def stacks_expected() -> bool:
    return facility_unavailable("py-spy") is None


@pytest.mark.parametrize("kind", ["block", "silent", "spin", "stop"])
def test_stalled_subordinate_is_reported_and_named(procs: ProcessTracker, kind: str) -> None:
    out = run_child(procs, {"tree": "main", "engine": {"step_acks": True, "stall": {"rank": 1, "kind": kind,
                                                                                   "after_tokens": 3}}},
                    "stall_timeout_s=1")
    assert out["stall"] is not None, out
    assert out["stall"]["pending"] == 2 and out["stall_quiet_s"] >= 1.0
    assert out["statuses"] == [[0, "stalled"], [1, "stalled"]]
    assert out["health"] is True and out["fatal"] is None and out["events"] == []  # report: keeps serving
    ranks = {rank: (activity, function, stacks) for rank, activity, function, stacks in out["diagnosis"]["ranks"]}
    if kind == "stop":
        assert ranks[1][0] == "stopped"
    elif kind == "spin":
        assert ranks[1][0] == "spinning"
    else:
        assert ranks[1][0] == "sleeping"
    if stacks_expected() and kind in FUNCTIONS:
        assert ranks[1][1] == FUNCTIONS[kind], out["diagnosis"]


def test_leader_blocked_in_user_space_is_a_stall(procs: ProcessTracker) -> None:
    out = run_child(procs, {"tree": "v12", "engine": {"stall": {"rank": 0, "kind": "block", "after_tokens": 3}}},
                    "stall_timeout_s=1")
    assert out["stall"] is not None and out["statuses"] == [[0, "stalled"], [1, "stalled"]], out
    assert out["health"] is True and out["fatal"] is None
    if stacks_expected():  # the leader's engine thread (not its main thread) is the stuck one
        assert "_block_forever" in out["diagnosis"]["threads_in"]["0"], out["diagnosis"]


@pytest.mark.parametrize("tree", ["main", "v12"])
def test_fatal_stall_takes_the_fatal_path(procs: ProcessTracker, tree: str) -> None:
    out = run_child(procs, {"tree": tree, "fatal": True,
                            "engine": {"step_acks": True, "stall": {"rank": 1, "kind": "silent", "after_tokens": 3}}},
                    "stall_timeout_s=1,stall_action=fatal")
    assert out["fatal_kind"] == "stalled" and out["events"] == ["stalled"], out
    assert "no progress for" in out["fatal"]
    assert out["health"] is False
    assert out["errors"] == 2 and out["finished"] == 0  # every pending request failed


def test_idle_engine_never_stalls(procs: ProcessTracker) -> None:
    # No request for three timeouts (watched all along), then one short request: it finishes, and
    # no stall ever.
    out = run_child(procs, {"tree": "main", "idle_first_s": 3.0, "requests": 1, "max_tokens": 4,
                            "expect": "none", "watch_s": 10.0}, "stall_timeout_s=1")
    assert out["stall"] is None and out["finished"] == 1 and out["events"] == [], out


def test_long_non_streaming_request_with_iterations_is_no_stall(procs: ProcessTracker) -> None:
    # 300 steps of 10 ms: about three timeouts with no output until the end; main's executor loop
    # checkpoints every iteration, which the ranks report.
    out = run_child(procs, {"tree": "main", "engine": {"token_delay_s": 0.01}, "streaming": False,
                            "max_tokens": 300, "requests": 1, "expect": "none", "watch_s": 60.0},
                    "stall_timeout_s=1")
    assert out["stall"] is None and out["finished"] == 1 and out["events"] == [], out


def test_without_iteration_reports_a_long_non_streaming_request_is_reported(procs: ProcessTracker) -> None:
    # 1.2.x has no HangDetector (as read): only output is progress, so the same request is reported
    # stalled (report mode: it still finishes). What the README's advice on stall_timeout_s is for.
    out = run_child(procs, {"tree": "v12", "engine": {"token_delay_s": 0.01}, "streaming": False,
                            "max_tokens": 300, "requests": 1, "expect": "stall", "watch_s": 60.0},
                    "stall_timeout_s=1")
    assert out["stall"] is not None and out["fatal"] is None, out


def test_a_fatal_stall_names_the_stopped_rank_not_the_leader(procs: ProcessTracker) -> None:
    # Rank 1 is SIGSTOPped; the leader then waits on it. The evidence (a stopped rank) names rank 1.
    out = run_child(procs, {"tree": "main", "engine": {"step_acks": True, "stall": {"rank": 1, "kind": "stop",
                                                                                  "after_tokens": 3}}},
                    "stall_timeout_s=3,stall_action=fatal")
    assert out["fatal_kind"] == "stalled", out
    assert "(named: MPI worker rank 1 " in out["fatal"] and "rank 1 is stopped" in out["fatal"], out["fatal"]
