"""Wedge detection with real D state (cgroup v1 freezer, FUSE), per thread; tracker logic on synthetic samples."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from trtllm_liveness import EventKind, WorkerEvent, WorkerProcessMonitor, WorkerState, _procfs, capture_identity
from trtllm_liveness._wedge import DStateSample, WedgeTracker
from trtllm_liveness.reference._fuse_stall import FuseStall

from ..conftest import Freezer, ProcessTracker, state_of, wait_until

pytestmark = [pytest.mark.real_process, pytest.mark.timeout(90)]

# A process whose helper thread prints its tid, then both threads sleep.
THREADED = """
import sys, threading, time
def helper():
    sys.stdout.write(f"{threading.get_native_id()}\\n"); sys.stdout.flush()
    while True:
        time.sleep(0.05)
threading.Thread(target=helper, daemon=True).start()
time.sleep(3600)
"""


def _state(monitor: WorkerProcessMonitor, rank: int = 0) -> WorkerState:
    return next(s.state for s in monitor.statuses() if s.identity.rank == rank)


def _kinds(events: list[WorkerEvent]) -> list[EventKind]:
    return [e.kind for e in list(events)]


@dataclass
class StuckChild:
    popen: subprocess.Popen[bytes]
    release: Callable[[], None]


@pytest.fixture(params=[pytest.param("freezer", marks=pytest.mark.freezer),
                        pytest.param("fuse", marks=pytest.mark.fuse)])
def stuck_child(request: pytest.FixtureRequest, procs: ProcessTracker) -> StuckChild:
    """A real process in D from either source: frozen by the cgroup v1 freezer, or blocked in a
    FUSE lookup nobody answers (wchan request_wait_answer). Skips where the source is missing."""
    if request.param == "freezer":
        freezer: Freezer = request.getfixturevalue("freezer")
        child = procs.sleeper()
        freezer.add(child.pid)
        freezer.freeze()
        return StuckChild(child, freezer.thaw)
    stall: FuseStall = request.getfixturevalue("fuse_stall")
    return StuckChild(procs.stuck_in_fuse(stall), stall.release)


def test_stuck_process_becomes_wedged_then_unkillable_then_dies_on_release(
    procs: ProcessTracker, stuck_child: StuckChild
) -> None:
    child = stuck_child.popen
    identity = capture_identity(0, child.pid)
    events: list[WorkerEvent] = []
    with WorkerProcessMonitor(d_state_timeout_s=0.3, scan_interval_s=0.05) as monitor:
        monitor.subscribe(events.append)
        monitor.register([identity])
        monitor.start()
        assert wait_until(lambda: state_of(child.pid) == "D", 10)
        assert wait_until(lambda: EventKind.WEDGED in _kinds(events), 10)
        wedged = events[0]
        assert wedged.kind is EventKind.WEDGED and wedged.restartable is False
        assert wedged.tid == child.pid and wedged.identity == identity
        assert "recycling" in wedged.message
        assert _state(monitor) is WorkerState.WEDGED
        assert monitor.find_dead_worker() is None  # wedged is fatal but not dead
        assert monitor.failure == wedged
        os.kill(child.pid, signal.SIGKILL)
        assert wait_until(lambda: EventKind.UNKILLABLE in _kinds(events), 10)
        assert _state(monitor) is WorkerState.UNKILLABLE
        assert state_of(child.pid) == "D"  # still there: SIGKILL cannot end it
        stuck_child.release()
        # The death is seen by the synchronous path too, after a wedge was already the failure.
        assert wait_until(lambda: monitor.find_dead_worker() == identity, 10)
        assert wait_until(lambda: EventKind.DIED in _kinds(events), 10)
        assert monitor.failure == wedged  # the first fatal event stays
        assert _kinds(events).count(EventKind.WEDGED) == 1 and _kinds(events).count(EventKind.UNKILLABLE) == 1
    assert child.wait(10) == -signal.SIGKILL


@pytest.mark.freezer
def test_d_state_in_a_helper_thread_only_is_caught(procs: ProcessTracker, freezer: Freezer) -> None:
    proc = subprocess.Popen([sys.executable, "-c", THREADED], stdout=subprocess.PIPE, start_new_session=True)
    procs.popens.append(proc)
    procs.track(proc.pid)
    assert proc.stdout is not None
    helper_tid = int(proc.stdout.readline())
    identity = capture_identity(0, proc.pid)
    events: list[WorkerEvent] = []
    with WorkerProcessMonitor(d_state_timeout_s=0.3, scan_interval_s=0.05) as monitor:
        monitor.subscribe(events.append)
        monitor.register([identity])
        monitor.start()
        freezer._write("tasks", str(helper_tid))  # only the helper thread
        freezer.freeze()
        assert wait_until(lambda: state_of(proc.pid) in ("S", "R") and _tstate(proc.pid, helper_tid) == "D", 10)
        assert wait_until(lambda: EventKind.WEDGED in _kinds(events), 10)
        assert events[0].tid == helper_tid
        assert state_of(proc.pid) in ("S", "R")  # the main thread alone would look healthy
        os.kill(proc.pid, signal.SIGKILL)
        assert wait_until(lambda: EventKind.UNKILLABLE in _kinds(events), 10)
        assert monitor.find_dead_worker() is None  # the helper keeps the thread group alive
        freezer.thaw()
        assert wait_until(lambda: monitor.find_dead_worker() == identity, 10)


def _tstate(pid: int, tid: int) -> str | None:
    try:
        return _procfs.read_stat(pid, tid).state
    except (OSError, ValueError):
        return None


@pytest.mark.freezer
def test_short_d_state_is_not_wedged_and_recovery_shows_alive(procs: ProcessTracker, freezer: Freezer) -> None:
    child = procs.sleeper()
    identity = capture_identity(0, child.pid)
    events: list[WorkerEvent] = []
    with WorkerProcessMonitor(d_state_timeout_s=0.4, scan_interval_s=0.05) as monitor:
        monitor.subscribe(events.append)
        monitor.register([identity])
        monitor.start()
        freezer.add(child.pid)
        freezer.freeze()
        assert wait_until(lambda: EventKind.WEDGED in _kinds(events), 10)
        freezer.thaw()
        # Back to ALIVE in the view (it left D), while the failure recorded stays.
        assert wait_until(lambda: _state(monitor) is WorkerState.ALIVE, 10)
        assert "was wedged" in monitor.statuses()[0].detail
        assert monitor.failure is not None and monitor.failure.kind is EventKind.WEDGED
        assert child.poll() is None
    # With a long timeout, a freeze that is thawed quickly raises nothing.
    other = procs.sleeper()
    events.clear()
    with WorkerProcessMonitor(d_state_timeout_s=60, scan_interval_s=0.02) as monitor:
        monitor.subscribe(events.append)
        monitor.register([capture_identity(1, other.pid)])
        monitor.start()
        freezer.add(other.pid)
        freezer.freeze()
        assert wait_until(lambda: state_of(other.pid) == "D", 10)
        freezer.thaw()
        assert wait_until(lambda: state_of(other.pid) in ("S", "R"), 10)
        assert monitor.check() is None
        assert events == [] and _state(monitor, 1) is WorkerState.ALIVE


@pytest.mark.freezer
def test_wedge_detection_off_by_default_costs_nothing(procs: ProcessTracker, freezer: Freezer) -> None:
    child = procs.sleeper()
    with WorkerProcessMonitor(scan_interval_s=0.01) as monitor:
        monitor.register([capture_identity(0, child.pid)])
        monitor.start()
        assert monitor._tick_needs() == (False, False)  # the watcher blocks with no timeout
        freezer.add(child.pid)
        freezer.freeze()
        assert wait_until(lambda: state_of(child.pid) == "D", 10)
        assert monitor.check() is None and _state(monitor) is WorkerState.ALIVE


def _sample(*tids: int, kill: bool = False) -> DStateSample:
    return DStateSample(tuple(tids), kill, "wchan")


def test_tracker_tracks_each_thread_separately() -> None:
    tracker = WedgeTracker(timeout_s=10)
    # Threads taking turns in D never accumulate to a wedge.
    for step in range(30):
        assert tracker.observe(_sample(100 + step % 2), float(step)) is None
    # One thread stuck for the whole timeout does.
    assert tracker.observe(_sample(200), 100.0) is None
    assert tracker.observe(_sample(200, 201), 105.0) is None
    assert tracker.observe(_sample(200), 110.0) is EventKind.WEDGED
    assert tracker.stuck_tid() == 200 and tracker.d_seconds(110.0) == 10.0
    assert tracker.observe(_sample(200), 111.0) is None  # reported once
    assert tracker.observe(None, 112.0) is None and tracker.d_since is None


def test_tracker_unkillable_needs_two_consecutive_kill_pending_samples() -> None:
    tracker = WedgeTracker(timeout_s=100)
    assert tracker.observe(_sample(1, kill=True), 0.0) is None  # a normal exit passes through D
    assert tracker.observe(None, 1.0) is None
    assert tracker.observe(_sample(1, kill=True), 2.0) is None
    assert tracker.observe(_sample(1, kill=True), 3.0) is EventKind.UNKILLABLE
    assert tracker.observe(_sample(1, kill=True), 200.0) is None  # nothing more after unkillable
