"""Observe mode (``observe=1``): every verdict is one WARNING ``liveness: would fail: ...`` with its
evidence and snapshot, counted by kind, and nothing else: the engine behaves as with the extension
off, apart from that line.

Each fault runs twice on the upstream-shaped fake (main) with real MPI ranks: the extension off
(``TRTLLM_WORKER_LIVENESS=0``), then on in observe mode; what the engine did (its requests, its
health after a watch long enough for every verdict and for upstream's own checks, its ranks) must
be the same, and the observing run's log must hold the one line. The faults: a rank SIGKILLed, a
rank stopped by SIGSTOP (the stopped-rank verdict), a rank blocked in user space with
``stall_action=fatal`` (a stall verdict). A wedge and an unkillable rank, on real ``D`` state:
``test_observe_mode_on_a_stuck_rank``. A lost host: tests/unittest/multihost/test_agents.py.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import pytest

from tests.support.bare_proxy import BareUpstreamProxy
from tests.support.children import HelperProcess
from tests.support.facilities import needs
from tests.support.process_tracker import ProcessTracker
from tests.support.quarantine import config_for, fresh_quarantine_state  # noqa: F401 - an autouse fixture
from tests.support.stuck_processes import StuckChild
from tests.support.waits import WAIT_SCALE, wait_until
from trtllm_liveness.integrations.trtllm import liveness_proxy_class
from trtllm_liveness.process._identity import capture_identity

SETTINGS = "scan_interval_s=0.25,stopped_timeout_s=2,shutdown_grace_s=0.5,shutdown_term_s=0.5,shutdown_kill_s=1"
FAULTS = {
    "died": ({"die_rank": 1, "die_after_tokens": 3}, ""),
    "stopped": ({"step_acks": True, "stall": {"rank": 1, "kind": "stop", "after_tokens": 3}}, ""),
    "stalled": ({"step_acks": True, "stall": {"rank": 1, "kind": "block", "after_tokens": 3}},
                ",stall_timeout_s=1,stall_action=fatal"),
}
VERDICT = {"died": "died", "stopped": "stalled", "stalled": "stalled"}
_LINE = re.compile(r" (DEBUG|INFO|WARNING|ERROR|CRITICAL) (trtllm_liveness[\w.]*): (.*)")


def run(procs: ProcessTracker, engine: dict[str, Any], value: str) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """The engine with ``engine``'s fault under ``TRTLLM_WORKER_LIVENESS=value``: its record and the
    extension's log lines (level, message)."""
    # diagnosis_s=0: observe mode takes its snapshot for its line itself and never finishes a requested
    # diagnosis, which the child would otherwise wait out (20 s) before the health read; the record's
    # diagnosis is not compared, and both runs read health after the same watch.
    options = {"tree": "main", "engine": engine, "expect": "none", "watch_s": 5, "settle_s": 1, "requests": 2,
               "diagnosis_s": 0, "shutdown": False}
    helper = HelperProcess("stall_child", options, {"TRTLLM_WORKER_LIVENESS": value})
    procs.popens.append(helper.popen)
    procs.track(helper.pid)
    try:
        record = helper.read_record(90 * WAIT_SCALE, "events")
        assert helper.wait_exit(30 * WAIT_SCALE) == 0, helper.stderr_tail(4000)
        log = helper.stderr_tail(10**7)
    finally:
        helper.close()
    lines = [(match.group(1), match.group(3)) for match in map(_LINE.search, log.splitlines()) if match]
    return record, lines


@pytest.mark.timeout(180)
@pytest.mark.parametrize("fault", sorted(FAULTS))
@pytest.mark.mpi
@needs("mpi")
def test_observe_mode_does_what_the_extension_off_does_apart_from_one_line(procs: ProcessTracker, fault: str) -> None:
    engine, settings = FAULTS[fault]
    off, _off_log = run(procs, engine, "0")
    observed, log = run(procs, engine, f"enabled=1,observe=1,{SETTINGS}{settings}")
    for key in ("fatal", "health_end", "errors", "finished", "ranks_alive"):
        assert observed[key] == off[key], (key, observed, off)
    assert observed["events"][0] == VERDICT[fault], observed  # later ones: consequences (a rank ending with it)
    loud = [(level, message) for level, message in log if level in ("WARNING", "ERROR", "CRITICAL")]
    assert len(loud) == 1 and loud[0][0] == "WARNING", loud
    assert loud[0][1].startswith("liveness: would fail: ") and "MPI worker rank " in loud[0][1], loud
    assert "; evidence: " in loud[0][1] and "; snapshot: " in loud[0][1], loud
    assert loud[0][1].endswith("(observe=1: nothing done)"), loud



@pytest.mark.timeout(90)
@pytest.mark.real_process
@pytest.mark.parametrize("kind", ["wedged", "unkillable"])
def test_observe_mode_on_a_stuck_rank(kind: str, stuck_child: StuckChild, procs: ProcessTracker, tmp_path: Path,
                                      caplog: pytest.LogCaptureFixture) -> None:
    """A rank really stuck in ``D`` (and, for ``unkillable``, SIGKILLed first: pending): one
    WARNING with the evidence and the snapshot, counted; health as upstream's own, no fatal error,
    no stop (the sleeper rank still runs), no quarantine marker, no exit status change."""
    import os
    import signal

    from trtllm_liveness.process import _procfs

    marker_dir = tmp_path / "quarantine"
    config = config_for(marker_dir, d_state_timeout_s=0.5, scan_interval_s=0.05, termination_log="",
                        shutdown_grace_s=0.1, shutdown_term_s=0.2, shutdown_kill_s=0.3, observe=True)
    proxy: Any = liveness_proxy_class(BareUpstreamProxy, config=config)({"llm_args": None})
    stuck = stuck_child.popen.pid
    if kind == "unkillable":
        os.kill(stuck, signal.SIGKILL)
        assert wait_until(lambda: _procfs.sigkill_pending(stuck), 10)
    sleeper = procs.sleeper()
    state = proxy.liveness_state
    try:
        with caplog.at_level(logging.INFO, logger="trtllm_liveness"):
            caplog.clear()
            proxy.liveness_monitor.register([capture_identity(0, sleeper.pid), capture_identity(1, stuck)])
            assert wait_until(lambda: any(r.getMessage().startswith("liveness: would fail: ")
                                          for r in caplog.records), 20 * WAIT_SCALE)
            records = [r for r in caplog.records if r.name.startswith("trtllm_liveness")]
        loud = [r.getMessage() for r in records if r.levelno >= logging.WARNING]
        assert len(loud) == 1 and loud[0].startswith(f"liveness: would fail: MPI worker rank 1 (pid {stuck}) on "), loud
        assert " in D" in loud[0] and "; snapshot: " in loud[0], loud
        assert proxy.check_health() is (not BareUpstreamProxy({"llm_args": None}).is_shutdown())  # upstream's
        assert proxy.liveness_fatal_error is None
        events = state.fatal_path.events
        assert state.fatal_path.would_fail == {events[0].kind: 1} and events[0].kind.value == kind
        assert _procfs.read_stat(sleeper.pid).state in ("S", "R")  # nothing stopped
        assert not marker_dir.exists() or not any(marker_dir.iterdir())  # no quarantine
    finally:
        proxy.shutdown()
