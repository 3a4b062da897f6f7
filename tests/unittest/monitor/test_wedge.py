"""Wedge detection with real D state (cgroup v1 freezer, FUSE), per thread, by the kernel's hung-task
rule (in D with no context switch for the timeout); its healthy look-alike (slow reads through FUSE,
in D at every sample while making progress) raises nothing; tracker logic on real and synthetic samples."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.support.fuse_stall import FuseStall
from tests.support.process_tracker import ProcessTracker, state_of
from tests.support.slow_reads import SlowReadResult
from tests.support.stuck_processes import Freezer, StuckChild
from tests.support.waits import WAIT_SCALE, wait_until
from trtllm_liveness import EventKind, WorkerEvent, WorkerState
from trtllm_liveness.monitor import WorkerProcessMonitor
from trtllm_liveness.monitor._wedge import WedgeTracker
from trtllm_liveness.process import _procfs, capture_identity
from trtllm_liveness.process._thread_sampler import DStateSample, ThreadSampler

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
    assert tracker.stuck_tid() == 200 and tracker.stuck_seconds(110.0) == 10.0
    assert tracker.observe(_sample(200), 111.0) is None  # reported once
    assert tracker.observe(None, 112.0) is None and tracker.stuck_since is None


def test_tracker_unkillable_needs_two_consecutive_kill_pending_samples() -> None:
    tracker = WedgeTracker(timeout_s=100)
    assert tracker.observe(_sample(1, kill=True), 0.0) is None  # a normal exit passes through D
    assert tracker.observe(None, 1.0) is None
    assert tracker.observe(_sample(1, kill=True), 2.0) is None
    assert tracker.observe(_sample(1, kill=True), 3.0) is EventKind.UNKILLABLE
    assert tracker.observe(_sample(1, kill=True), 200.0) is None  # nothing more after unkillable


def test_tracker_clock_restarts_when_the_count_moves_is_unreadable_or_the_thread_leaves_d() -> None:
    tracker = WedgeTracker(timeout_s=10)
    # In D at every sample, but it ran between each two (slow I/O that makes progress): never stuck.
    for step in range(30):
        assert tracker.observe(_sample(300, switches=(step,)), float(step)) is None
        assert tracker.stuck_seconds(float(step)) == 0.0
    # The count stops moving: stuck since the sample that first saw it so (t=29), wedged at t=39.
    assert tracker.observe(_sample(300, switches=(29,)), 38.0) is None and tracker.stuck_seconds(38.0) == 9.0
    assert tracker.observe(_sample(300, switches=(29,)), 39.0) is EventKind.WEDGED
    # A count that cannot be read (the thread's status gone) restarts the clock every time.
    tracker = WedgeTracker(timeout_s=10)
    for now in (0.0, 10.0, 20.0, 30.0):
        assert tracker.observe(_sample(400, switches=(None,)), now) is None
    assert tracker.observe(_sample(400, switches=(5,)), 31.0) is None  # readable again: its clock starts here
    assert tracker.observe(_sample(400, switches=(5,)), 40.0) is None
    assert tracker.observe(_sample(400, switches=(5,)), 41.0) is EventKind.WEDGED
    # Leaving D restarts it even when the count is the same when it is next seen in D.
    tracker = WedgeTracker(timeout_s=10)
    assert tracker.observe(_sample(500, 501, switches=(1, 1)), 0.0) is None
    assert tracker.observe(_sample(501, switches=(1,)), 5.0) is None  # 500 left D; 501 stuck since 0
    assert tracker.observe(_sample(500, 501, switches=(1, 2)), 6.0) is None  # 501 ran: both restart
    assert tracker.observe(_sample(500, 501, switches=(1, 2)), 15.0) is None
    assert tracker.observe(_sample(500, 501, switches=(1, 2)), 16.0) is EventKind.WEDGED
    assert tracker.stuck_tid() == 500  # the lower tid of two stuck since the same sample


def test_tracker_unkillable_needs_a_thread_that_did_not_run_across_the_kill_pending_samples() -> None:
    tracker = WedgeTracker(timeout_s=100)
    # SIGKILL pending at every sample, but the thread in D keeps switching: it acts (a slow read
    # completing, an exit under way), so it is not unkillable.
    for step in range(5):
        assert tracker.observe(_sample(1, kill=True, switches=(step,)), float(step)) is None
        assert tracker.unkillable_tid is None
    assert tracker.observe(_sample(1, kill=True, switches=(4,)), 5.0) is EventKind.UNKILLABLE
    assert tracker.unkillable_tid == 1
    # The kill must be pending at both samples that bracket the stuck interval.
    tracker = WedgeTracker(timeout_s=100)
    assert tracker.observe(_sample(2, switches=(9,)), 0.0) is None
    assert tracker.observe(_sample(2, kill=True, switches=(9,)), 1.0) is None
    assert tracker.observe(_sample(2, kill=True, switches=(9,)), 2.0) is EventKind.UNKILLABLE


@pytest.mark.fuse
def test_tracker_rule_on_real_samples_slow_reader_is_never_stuck_a_stuck_child_is(
    procs: ProcessTracker, fuse_stall: FuseStall, stuck_child: StuckChild
) -> None:
    reader, reader_tid = procs.slow_reader(fuse_stall, 60)
    stuck = stuck_child.popen
    assert wait_until(lambda: state_of(stuck.pid) == "D", 10)
    reader_sampler = ThreadSampler(reader.pid, capture_identity(0, reader.pid).start_time)
    stuck_sampler = ThreadSampler(stuck.pid, capture_identity(1, stuck.pid).start_time)
    slow, held = WedgeTracker(timeout_s=10), WedgeTracker(timeout_s=10)
    verdicts: list[EventKind | None] = []
    previous: DStateSample | None = None
    try:
        for index in range(4):
            if index:
                time.sleep(1.0)  # the default scan interval: the slow reader completes reads in each
            reader_sample, stuck_sample = reader_sampler.sample(), stuck_sampler.sample()
            # Fed as if the samples were 10 s apart: "in D at both samples" alone would be a wedge.
            assert slow.observe(reader_sample, index * 10.0) is None, reader_sample
            verdicts.append(held.observe(stuck_sample, index * 10.0))
            assert stuck_sample is not None and stuck.pid in stuck_sample.d_tids
            assert None not in stuck_sample.switches and len(stuck_sample.switches) == len(stuck_sample.d_tids)
            if reader_sample is not None and reader_tid in reader_sample.d_tids:
                assert reader_sample.switches_of(reader_tid) is not None
                if previous is not None:
                    assert reader_tid not in reader_sample.held_since(previous)  # it ran in between
                previous = reader_sample
        assert verdicts == [None, EventKind.WEDGED, None, None]
        assert held.stuck_tid() == stuck.pid
    finally:
        reader_sampler.close()
        stuck_sampler.close()


def _switch_count(pid: int, tid: int) -> int:
    """The thread's voluntary + nonvoluntary context switches, read here by the test itself: the
    witness that the look-alike progressed does not rest on the parsing under test."""
    with open(f"/proc/{pid}/task/{tid}/status") as handle:
        return sum(int(line.split()[1]) for line in handle if "ctxt_switches:" in line)


@pytest.mark.fuse
def test_slow_io_in_d_at_every_sample_is_not_a_wedge_beside_a_real_one(
    procs: ProcessTracker, fuse_stall: FuseStall, stuck_child: StuckChild
) -> None:
    """The healthy look-alike of a wedge: a rank's thread reading through a slow FUSE for three
    times the timeout, in D at nearly every sample yet making progress, raises nothing; a real
    wedge watched by the same monitor at the same time is reported."""
    timeout_s, interval_s = 2.0, 0.25
    # It reads for longer than the test watches, so its thread is still there for the last count
    # of its context switches however late a loaded machine ends the watch.
    reader, reader_tid = procs.slow_reader(fuse_stall, 5 * timeout_s)
    stuck = stuck_child.popen
    events: list[WorkerEvent] = []
    with WorkerProcessMonitor(d_state_timeout_s=timeout_s, scan_interval_s=interval_s) as monitor:
        monitor.subscribe(events.append)
        monitor.register([capture_identity(0, reader.pid), capture_identity(1, stuck.pid)])
        monitor.start()
        switches_before = _switch_count(reader.pid, reader_tid)
        states: list[str | None] = []
        end = time.monotonic() + 3 * timeout_s
        while time.monotonic() < end:  # the test's own samples, at the monitor's interval
            states.append(_tstate(reader.pid, reader_tid))
            time.sleep(interval_s)
        switches_after = _switch_count(reader.pid, reader_tid)
        assert reader.stdout is not None
        result = SlowReadResult.parse(reader.stdout.readline())
        # The look-alike is real: in D at >= 90% of the samples, and its reads completed.
        assert states.count("D") >= 0.9 * len(states), states
        assert result.mismatches == 0 and result.reads >= 3, result
        assert switches_after > switches_before
        # The real wedge beside it is reported (so the scan ran all along); the reader never is.
        assert wait_until(lambda: EventKind.WEDGED in _kinds(events), 10)
        assert [(e.identity.rank, e.kind) for e in events] == [(1, EventKind.WEDGED)]
        assert _state(monitor, 0) is WorkerState.ALIVE
    assert reader.stdin is not None
    reader.stdin.close()
    assert reader.wait(10) == 0


def test_wedge_and_unkillable_verdicts_name_the_missing_context_switch(
    procs: ProcessTracker, stuck_child: StuckChild
) -> None:
    child = stuck_child.popen
    events: list[WorkerEvent] = []
    with WorkerProcessMonitor(d_state_timeout_s=0.3, scan_interval_s=0.05) as monitor:
        monitor.subscribe(events.append)
        monitor.register([capture_identity(0, child.pid)])
        monitor.start()
        assert wait_until(lambda: EventKind.WEDGED in _kinds(events), 10)
        wedged = events[0]
        assert re.fullmatch(rf"thread {child.pid} in D for \d+\.\ds with no context switch \(wchan \S+\)",
                            wedged.cause), wedged.cause
        assert wedged.message.endswith(f"is wedged in uninterruptible sleep (D): {wedged.cause}; the host may "
                                       "need recycling before its GPUs/NICs are reused"), wedged.message
        assert monitor.statuses()[0].detail == wedged.cause
        os.kill(child.pid, signal.SIGKILL)
        assert wait_until(lambda: EventKind.UNKILLABLE in _kinds(events), 10)
        unkillable = next(event for event in events if event.kind is EventKind.UNKILLABLE)
        assert re.fullmatch(rf"thread {child.pid} in D with SIGKILL pending, no context switch for \d+\.\ds "
                            r"\(wchan \S+\)", unkillable.cause), unkillable.cause
        stuck_child.release()
