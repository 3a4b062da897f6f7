"""A rank stopped by a signal under the default settings (no stall timer): real MPI ranks on the
upstream-shaped fakes, a real SIGSTOP.

A stopped rank (``T``) while requests are pending and the engine makes no progress is a fatal
verdict after ``stopped_timeout_s`` (the state and the engine's progress: two signals that do not
fail together), whatever ``stall_timeout_s`` says. Its healthy look-alikes give none: a rank
stopped for less than the bound and continued (an operator's or py-spy's pause), and a rank
stopped while the engine is idle. Timing is not asserted: the child watches within a bound.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest

from tests.support.children import HelperProcess
from tests.support.facilities import MPI_MARKS
from tests.support.process_tracker import ProcessTracker
from tests.support.waits import WAIT_SCALE

pytestmark = [pytest.mark.timeout(120), *MPI_MARKS]

# The defaults but for the bounds a test can wait for: no stall timer (stall_timeout_s=0).
SETTINGS = ("enabled=1,stopped_timeout_s=2,scan_interval_s=0.25,shutdown_grace_s=0.5,shutdown_term_s=0.5,"
            "shutdown_kill_s=1")


def start(procs: ProcessTracker, options: dict[str, Any],
          settings: str = SETTINGS) -> tuple[HelperProcess, dict[int, int]]:
    helper = HelperProcess("stall_child", options, {"TRTLLM_WORKER_LIVENESS": settings})
    procs.popens.append(helper.popen)
    procs.track(helper.pid)
    ranks = {int(rank): int(pid) for rank, pid in helper.read_record(60 * WAIT_SCALE, "identities")["identities"]}
    return helper, ranks


def finish(helper: HelperProcess) -> dict[str, Any]:
    try:
        record = helper.read_record(90 * WAIT_SCALE, "events")
        status = helper.wait_exit(30 * WAIT_SCALE)
        assert status == 0, helper.stderr_tail(4000)
        return record
    finally:
        helper.close()


@pytest.mark.parametrize("tree", ["main", "v12"])
def test_a_rank_stopped_with_requests_pending_is_a_fatal_verdict_under_the_defaults(procs: ProcessTracker,
                                                                                    tree: str) -> None:
    """Rank 1 SIGSTOPs itself after 3 steps while 2 requests stream, every step waiting for it
    (``step_acks``): after stopped_timeout_s the engine fails with a ``stalled`` verdict naming rank 1
    and both signals; the requests fail, health turns False. (Before this rule: every request hung
    and health stayed True until ``shutdown()``.)"""
    stop = {"rank": 1, "kind": "stop", "after_tokens": 3}
    helper, _ranks = start(procs, {"tree": tree, "fatal": True, "watch_s": 60,
                                   "engine": {"step_acks": True, "stall": stop}})
    out = finish(helper)
    assert out["fatal_kind"] == "stalled", out
    assert "MPI worker rank 1 " in out["fatal"] and "stopped by a signal (state T)" in out["fatal"], out
    assert "while the engine made no progress" in out["fatal"] and "2 request(s) pending" in out["fatal"], out
    assert out["errors"] == 2 and out["health"] is False, out


def test_a_short_stop_then_continue_is_no_verdict(procs: ProcessTracker) -> None:
    """The look-alike: rank 1 stopped for half the bound, then continued (a debugger's or py-spy's
    pause, a Ctrl-Z and fg): the requests finish and nothing fails."""
    helper, ranks = start(procs, {"tree": "main", "expect": "none", "watch_s": 60, "requests": 2, "max_tokens": 200,
                                  "engine": {"step_acks": True, "token_delay_s": 0.01}})
    os.kill(ranks[1], signal.SIGSTOP)
    try:
        time.sleep(1.0)  # half of stopped_timeout_s: the engine makes no progress meanwhile
    finally:
        os.kill(ranks[1], signal.SIGCONT)
    out = finish(helper)
    assert out["fatal"] is None and out["events"] == [], out
    assert out["finished"] == 2 and out["errors"] == 0, out


def test_a_rank_stopped_while_the_engine_is_idle_is_no_verdict(procs: ProcessTracker) -> None:
    """The look-alike: rank 1 stopped for three bounds while nothing is pending (an idle engine makes
    no progress either): no verdict; continued, the engine serves its requests."""
    # stopped_timeout_s=1 (the others' 2): three bounds take 3 s.
    helper, ranks = start(procs, {"tree": "main", "expect": "none", "idle_first_s": 3.5, "watch_s": 60,
                                  "requests": 2, "max_tokens": 50, "engine": {"step_acks": True}},
                          SETTINGS.replace("stopped_timeout_s=2,", "stopped_timeout_s=1,"))
    os.kill(ranks[1], signal.SIGSTOP)
    try:
        time.sleep(3.0)  # three times stopped_timeout_s, within the child's idle time
    finally:
        os.kill(ranks[1], signal.SIGCONT)
    out = finish(helper)
    assert out["fatal"] is None and out["events"] == [], out
    assert out["finished"] == 2, out
