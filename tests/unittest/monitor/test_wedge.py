"""Wedge detection with real D state (cgroup v1 freezer, FUSE), per thread; tracker logic on synthetic samples."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tests.support.process_tracker import ProcessTracker, state_of
from tests.support.stuck_processes import Freezer, StuckChild
from tests.support.waits import WAIT_SCALE, wait_until
from trtllm_liveness import EventKind, WorkerEvent, WorkerProcessMonitor, WorkerState, capture_identity
from trtllm_liveness.demo._fuse_stall import FuseStall
from trtllm_liveness.monitor._wedge import WedgeTracker
from trtllm_liveness.process import _procfs
from trtllm_liveness.process._thread_sampler import DStateSample

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
        # The fault began when D was first seen; the verdict needs the timeout to have passed since.
        assert wedged.fault_at is not None and wedged.detected_at - wedged.fault_at >= 0.3
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
        died = next(event for event in events if event.kind is EventKind.DIED)
        assert died.fault_at is None  # a death's fault time is its detection (the pidfd)
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


# A FUSE variant of THREADED: the helper thread stats a path in the stall (argv[1]) and sticks in
# D; the main thread waits in join (S), so the process looks healthy from its main thread alone.
THREADED_FUSE = """
import os, sys, threading
def helper():
    try:
        os.stat(sys.argv[1])
    except OSError:
        pass
thread = threading.Thread(target=helper)
thread.start()
sys.stdout.write(f"{thread.native_id}\\n"); sys.stdout.flush()
thread.join()
"""

# Stats a path in the stall (argv[1]), then, once released (ENOTCONN), sleeps on as a healthy process.
RECOVERING_FUSE = """
import os, sys, time
try:
    os.stat(sys.argv[1])
except OSError:
    pass
sys.stdout.write("back\\n"); sys.stdout.flush()
time.sleep(3600)
"""


@pytest.mark.fuse
def test_fuse_d_state_in_a_helper_thread_only_is_caught(procs: ProcessTracker, fuse_stall: FuseStall) -> None:
    proc = subprocess.Popen([sys.executable, "-c", THREADED_FUSE, fuse_stall.new_path()], stdout=subprocess.PIPE,
                            start_new_session=True)
    procs.popens.append(proc)
    procs.track(proc.pid)
    assert proc.stdout is not None
    helper_tid = int(proc.stdout.readline())
    assert fuse_stall.wait_held(helper_tid, 10 * WAIT_SCALE)
    identity = capture_identity(0, proc.pid)
    events: list[WorkerEvent] = []
    with WorkerProcessMonitor(d_state_timeout_s=0.3, scan_interval_s=0.05) as monitor:
        monitor.subscribe(events.append)
        monitor.register([identity])
        monitor.start()
        assert wait_until(lambda: _tstate(proc.pid, helper_tid) == "D", 10)
        assert wait_until(lambda: EventKind.WEDGED in _kinds(events), 10)
        assert events[0].tid == helper_tid and events[0].wchan == "request_wait_answer"
        assert state_of(proc.pid) in ("S", "R")  # the main thread alone would look healthy
        os.kill(proc.pid, signal.SIGKILL)
        assert wait_until(lambda: EventKind.UNKILLABLE in _kinds(events), 10)
        assert monitor.find_dead_worker() is None  # the held helper keeps the thread group alive
        fuse_stall.release()
        assert wait_until(lambda: monitor.find_dead_worker() == identity, 10)
    assert proc.wait(10) == -signal.SIGKILL


@pytest.mark.fuse
def test_fuse_short_d_state_is_not_wedged_and_recovery_shows_alive(
    procs: ProcessTracker, fuse_stall: FuseStall
) -> None:
    children = []
    for _ in range(2):
        child = subprocess.Popen([sys.executable, "-c", RECOVERING_FUSE, fuse_stall.new_path()],
                                 stdout=subprocess.PIPE, start_new_session=True)
        procs.popens.append(child)
        procs.track(child.pid)
        assert fuse_stall.wait_held(child.pid, 10 * WAIT_SCALE)
        children.append(child)
    short, long_ = children
    short_events: list[WorkerEvent] = []
    long_events: list[WorkerEvent] = []
    with WorkerProcessMonitor(d_state_timeout_s=0.4, scan_interval_s=0.05) as short_monitor, \
            WorkerProcessMonitor(d_state_timeout_s=60, scan_interval_s=0.02) as long_monitor:
        short_monitor.subscribe(short_events.append)
        long_monitor.subscribe(long_events.append)
        short_monitor.register([capture_identity(0, short.pid)])
        long_monitor.register([capture_identity(1, long_.pid)])
        short_monitor.start()
        long_monitor.start()
        assert wait_until(lambda: EventKind.WEDGED in _kinds(short_events), 10)
        assert state_of(long_.pid) == "D"
        fuse_stall.release()  # both stats fail with ENOTCONN and the processes carry on
        for child in children:
            assert child.stdout is not None and child.stdout.readline() == b"back\n"
        # Back to ALIVE in the view (it left D), while the failure recorded stays.
        assert wait_until(lambda: _state(short_monitor) is WorkerState.ALIVE, 10)
        assert "was wedged" in short_monitor.statuses()[0].detail
        assert short_monitor.failure is not None and short_monitor.failure.kind is EventKind.WEDGED
        # With a long timeout, a D state that ends quickly raises nothing.
        assert wait_until(lambda: state_of(long_.pid) in ("S", "R"), 10)
        assert long_monitor.check() is None
        assert long_events == [] and _state(long_monitor, 1) is WorkerState.ALIVE
        assert short.poll() is None and long_.poll() is None


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


def test_wedge_detection_off_by_default_costs_nothing(procs: ProcessTracker, stuck_child: StuckChild) -> None:
    child = stuck_child.popen
    with WorkerProcessMonitor(scan_interval_s=0.01) as monitor:
        monitor.register([capture_identity(0, child.pid)])
        monitor.start()
        assert monitor._watch_timeout() is None  # the watcher blocks with no timeout: no scan runs
        assert wait_until(lambda: state_of(child.pid) == "D", 10)
        assert monitor.check() is None and _state(monitor) is WorkerState.ALIVE


def _sample(*tids: int, kill: bool = False, switches: tuple[int | None, ...] | None = None) -> DStateSample:
    # By default every thread's switch count stays the same: it never runs between samples.
    return DStateSample(tuple(tids), kill, "wchan", switches if switches is not None else (7,) * len(tids))


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
