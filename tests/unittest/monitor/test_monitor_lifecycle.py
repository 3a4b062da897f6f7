"""Monitor features an engine's lifecycle needs: identities without start time, expected exits,
wedge detection armed only once the model is loaded; and the per-element identity parser."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import pytest

from tests.support.process_tracker import ProcessTracker
from tests.support.stuck_processes import Freezer
from tests.support.waits import wait_until
from trtllm_liveness import EventKind, WorkerEvent, WorkerState
from trtllm_liveness.monitor import WorkerProcessMonitor
from trtllm_liveness.process import InvalidIdentityError, ProcessIdentity, capture_identity, parse_identities

pytestmark = [pytest.mark.real_process, pytest.mark.timeout(90)]


def _state(monitor: WorkerProcessMonitor, rank: int = 0) -> WorkerState:
    return next(s.state for s in monitor.statuses() if s.identity.rank == rank)


def test_identity_without_start_time_is_watched_but_never_a_signal_target(procs: ProcessTracker) -> None:
    child = procs.sleeper()
    full = capture_identity(0, child.pid)
    partial = ProcessIdentity(0, child.pid, None, full.hostname, None)  # what upstream sends on a failed read
    events: list[WorkerEvent] = []
    with WorkerProcessMonitor() as monitor:
        monitor.subscribe(events.append)
        monitor.register([partial])
        monitor.start()
        status = monitor.statuses()[0]
        assert status.state is WorkerState.ALIVE and status.method == "pidfd"
        assert "start time unverified" in status.detail and "PID namespace unknown" in status.detail
        assert monitor.verified_identities() == []
        os.kill(child.pid, signal.SIGKILL)
        assert wait_until(lambda: monitor.find_dead_worker() == partial, 10)
        assert wait_until(lambda: [e.kind for e in events] == [EventKind.DIED], 10)
    child.wait(10)


def test_exits_after_mark_expected_exits_are_not_deaths(procs: ProcessTracker) -> None:
    children = [procs.sleeper() for _ in range(2)]
    identities = [capture_identity(rank, child.pid) for rank, child in enumerate(children)]
    events: list[WorkerEvent] = []
    with WorkerProcessMonitor() as monitor:
        monitor.subscribe(events.append)
        monitor.register(identities)
        monitor.start()
        os.kill(children[0].pid, signal.SIGKILL)
        assert wait_until(lambda: len(events) == 1, 10)
        monitor.mark_expected_exits()
        os.kill(children[1].pid, signal.SIGKILL)
        assert wait_until(lambda: _state(monitor, 1) is WorkerState.EXITED_EXPECTED, 10)
        monitor.check()
        assert [e.identity.rank for e in events] == [0]  # the expected exit raised nothing
        assert monitor.find_dead_worker() == identities[0]
        assert not WorkerState.EXITED_EXPECTED.is_fatal and WorkerState.EXITED_EXPECTED.is_dead
    for child in children:
        child.wait(10)


def test_expected_exits_before_any_death_leave_no_failure(procs: ProcessTracker) -> None:
    child = procs.sleeper()
    with WorkerProcessMonitor() as monitor:
        monitor.register([capture_identity(0, child.pid)])
        monitor.mark_expected_exits()
        os.kill(child.pid, signal.SIGKILL)
        assert wait_until(lambda: (monitor.check(), _state(monitor))[1] is WorkerState.EXITED_EXPECTED, 10)
        assert monitor.failure is None and monitor.find_dead_worker() is None
    child.wait(10)


@pytest.mark.freezer
def test_wedge_verdicts_wait_until_armed(procs: ProcessTracker, freezer: Freezer) -> None:
    """A slow start-up (D while weights load) is not a wedge; the timer starts when armed."""
    child = procs.sleeper()
    freezer.add(child.pid)
    assert freezer.freeze()
    events: list[WorkerEvent] = []
    with WorkerProcessMonitor(d_state_timeout_s=0.1, scan_interval_s=0.02, wedge_armed=False) as monitor:
        monitor.subscribe(events.append)
        monitor.register([capture_identity(0, child.pid)])
        monitor.start()
        assert not monitor.wedge_armed
        time.sleep(0.5)  # five timeouts in D, unarmed: still no verdict (not a timing assertion)
        assert events == [] and _state(monitor) is WorkerState.ALIVE
        monitor.arm_wedge_detection()
        monitor.arm_wedge_detection()  # idempotent
        assert wait_until(lambda: [e.kind for e in events] == [EventKind.WEDGED], 10)
    freezer.thaw()


def test_arming_from_many_threads_while_registering(procs: ProcessTracker) -> None:
    children = [procs.sleeper() for _ in range(4)]
    identities = [capture_identity(rank, child.pid) for rank, child in enumerate(children)]
    with WorkerProcessMonitor(d_state_timeout_s=5, scan_interval_s=0.01, wedge_armed=False) as monitor:
        monitor.start()
        threads = [threading.Thread(target=monitor.arm_wedge_detection) for _ in range(4)]
        threads += [threading.Thread(target=monitor.register, args=([identity],)) for identity in identities]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        assert monitor.wedge_armed and len(monitor.statuses()) == 4
        assert all(s.state is WorkerState.ALIVE for s in monitor.statuses())


def test_parser_per_element_drops_bad_elements_and_excluded_pids(caplog: pytest.LogCaptureFixture) -> None:
    me = capture_identity(0)
    other = ProcessIdentity(1, 4321, 99, "h", 7)
    payload = [
        list(me),                               # the proxy itself: excluded quietly
        list(other),
        [2, True, 1, "h", 1],                   # bool pid: rejected, logged
        [3, 4322, None, "h", None],             # Optional fields: accepted
        [1, 4323, 1, "h", 1],                   # duplicate rank: rejected, logged
        "garbage",
    ]
    with pytest.raises(InvalidIdentityError):
        parse_identities(payload, exclude_pids=[me.pid])
    with caplog.at_level(logging.WARNING):
        parsed = parse_identities(payload, per_element=True, exclude_pids=[me.pid])
    assert [i.rank for i in parsed] == [1, 3]
    assert parsed[1].start_time is None and parsed[1].pid_namespace is None
    rejected = [r.getMessage() for r in caplog.records if "rejected one worker identity" in r.getMessage()]
    assert len(rejected) == 3 and any("duplicate rank 1" in m for m in rejected)
    with pytest.raises(InvalidIdentityError):
        parse_identities("not a list", per_element=True)
    # Without the exclusion the proxy's own pid is still refused, as before.
    assert [i.rank for i in parse_identities([list(me)], per_element=True)] == []


@pytest.mark.freezer
def test_arming_with_a_timeout_turns_wedge_detection_on(procs: ProcessTracker, freezer: Freezer) -> None:
    """From the start-up bound (here: none) to the serving bound, on one monitor."""
    child = procs.sleeper()
    freezer.add(child.pid)
    assert freezer.freeze()
    events: list[WorkerEvent] = []
    with WorkerProcessMonitor(scan_interval_s=0.02) as monitor:
        monitor.subscribe(events.append)
        monitor.register([capture_identity(0, child.pid)])
        monitor.start()
        assert not monitor.wedge_armed
        monitor.arm_wedge_detection(d_state_timeout_s=0.1)
        assert monitor.wedge_armed
        assert wait_until(lambda: [e.kind for e in events] == [EventKind.WEDGED], 10)
    freezer.thaw()
