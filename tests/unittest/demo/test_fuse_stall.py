"""Real unkillable ``D`` from a raw FUSE server (no cgroup v1): the helper, the monitor, bounded shutdown;
and its slow-read file, every READ answered late (the healthy look-alike of a wedge).

Every stuck process is a real child that stats a path in a :class:`FuseStall` mount. The
``fuse_stall`` fixture releases the mount before the ``procs`` fixture ends the children (it
depends on ``procs``, so it is torn down first), and checks that no mount, directory or
``/dev/fuse`` descriptor is left, also on failure.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys

import pytest

from tests.support.facilities import require_or_skip
from tests.support.fuse_stall import FuseStall
from tests.support.process_tracker import ProcessTracker, state_of
from tests.support.slow_reads import SlowReadResult, slow_reader_cmd
from tests.support.waits import WAIT_SCALE, wait_until
from trtllm_liveness import EventKind, WorkerEvent, WorkerState
from trtllm_liveness.demo._fuse_stall import (
    MOUNT_PREFIX,
    fuse_available,
    fuse_mounts,
    remove_leftover_mounts,
)
from trtllm_liveness.monitor import WorkerProcessMonitor
from trtllm_liveness.process import _procfs, capture_identity
from trtllm_liveness.stop._bounded_stop import stop_processes
from trtllm_liveness.stop._stop_report import StopOutcome

pytestmark = [pytest.mark.real_process, pytest.mark.fuse, pytest.mark.timeout(60)]

# Makes a FuseStall, prints its mountpoint and waits; killed by the test to leave a leftover.
OWNER = (
    "import sys\n"
    "from trtllm_liveness.demo._fuse_stall import FuseStall\n"
    "stall = FuseStall().__enter__()\n"
    "sys.stdout.write(stall.mountpoint + '\\n'); sys.stdout.flush()\n"
    "sys.stdin.read()\n"
)

# One thread stats the path given; the main thread prints both thread ids and waits for it.
THREADED_STAT = (
    "import os, sys, threading\n"
    "def stat():\n"
    "    try:\n"
    "        os.stat(sys.argv[1])\n"
    "    except OSError:\n"
    "        pass\n"
    "helper = threading.Thread(target=stat)\n"
    "helper.start()\n"
    "sys.stdout.write(f'{threading.get_native_id()} {helper.native_id}\\n'); sys.stdout.flush()\n"
    "helper.join()\n"
)


def _dev_fuse_fds() -> list[int]:
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") == "/dev/fuse":
                found.append(int(name))
        except OSError:
            continue
    return found


def _assert_cleaned_up(stall: FuseStall) -> None:
    assert stall.mountpoint not in fuse_mounts()
    assert not os.path.exists(stall.mountpoint)  # safe: unmounted, so nothing can block
    assert _dev_fuse_fds() == []


def _kill_pending(pid: int, tid: int | None = None) -> bool:
    try:
        return _procfs.sigkill_pending(pid, tid)
    except OSError:
        return False


def _thread_state(pid: int, tid: int) -> str | None:
    try:
        return _procfs.read_stat(pid, tid).state
    except (OSError, ValueError):
        return None


def _gone(pid: int) -> bool:
    return state_of(pid) in (None, "Z")


def _kinds(events: list[WorkerEvent]) -> list[EventKind]:
    return [e.kind for e in list(events)]


def _state(monitor: WorkerProcessMonitor) -> WorkerState:
    return monitor.statuses()[0].state


def test_fuse_available_trial_leaves_nothing_behind() -> None:
    reason = fuse_available()
    if reason is not None:
        require_or_skip("fuse", reason)
    assert fuse_available() is None
    assert not [m for m in fuse_mounts() if os.path.basename(m).startswith(f"{MOUNT_PREFIX}-{os.getpid()}-")]
    assert _dev_fuse_fds() == []


def test_stat_is_d_then_unkillable_until_release(procs: ProcessTracker, fuse_stall: FuseStall) -> None:
    assert fuse_stall.mountpoint in fuse_mounts()
    child = procs.stuck_in_fuse(fuse_stall)
    # D before any signal (the connection is primed: no interruptible first wait).
    assert wait_until(lambda: state_of(child.pid) == "D", 10)
    assert _procfs.read_wchan(child.pid) != ""
    assert not _kill_pending(child.pid)
    os.kill(child.pid, signal.SIGKILL)
    # The kill wakes it from the killable wait (briefly R) into the uninterruptible one (D) ...
    assert wait_until(lambda: _kill_pending(child.pid) and state_of(child.pid) == "D", 10)
    # ... where it stays with SIGKILL pending: a bounded wait for it to leave D fails.
    assert not wait_until(lambda: state_of(child.pid) != "D", 0.5)
    assert _kill_pending(child.pid) and child.poll() is None
    fuse_stall.release()
    assert child.wait(10 * WAIT_SCALE) == -signal.SIGKILL
    _assert_cleaned_up(fuse_stall)
    fuse_stall.release()  # idempotent


def test_each_caller_and_thread_is_held_on_its_own(procs: ProcessTracker, fuse_stall: FuseStall) -> None:
    first, second = procs.stuck_in_fuse(fuse_stall), procs.stuck_in_fuse(fuse_stall)
    threaded = subprocess.Popen(
        [sys.executable, "-c", THREADED_STAT, fuse_stall.new_path()], stdout=subprocess.PIPE, start_new_session=True
    )
    procs.popens.append(threaded)
    procs.track(threaded.pid)
    assert threaded.stdout is not None
    main_tid, helper_tid = map(int, threaded.stdout.readline().split())
    assert main_tid == threaded.pid
    assert fuse_stall.wait_held(helper_tid, 10 * WAIT_SCALE)
    assert {first.pid, second.pid, helper_tid} <= fuse_stall.held_tids()
    assert wait_until(lambda: state_of(first.pid) == "D" and state_of(second.pid) == "D", 10)
    # Only the helper thread is stuck; the main thread sleeps in join().
    assert wait_until(lambda: _thread_state(threaded.pid, helper_tid) == "D", 10)
    assert wait_until(lambda: _thread_state(threaded.pid, main_tid) == "S", 10)
    os.kill(threaded.pid, signal.SIGKILL)
    assert wait_until(
        lambda: _kill_pending(threaded.pid, helper_tid) and _thread_state(threaded.pid, helper_tid) == "D", 10
    )
    assert not wait_until(lambda: _thread_state(threaded.pid, helper_tid) != "D", 0.3)
    fuse_stall.release()
    # Not killed: the stat fails with ENOTCONN and the child exits with status 3.
    assert first.wait(10 * WAIT_SCALE) == 3 and second.wait(10 * WAIT_SCALE) == 3
    assert threaded.wait(10 * WAIT_SCALE) == -signal.SIGKILL


def test_the_owner_process_is_never_stalled(fuse_stall: FuseStall) -> None:
    # Requests from the owner's own threads are answered EIO at once (else a stray access would
    # hang the test runner beyond what a SIGALRM-based timeout can end).
    assert not os.path.exists(fuse_stall.new_path())
    with pytest.raises(OSError) as caught:
        os.stat(fuse_stall.new_path())
    assert caught.value.errno == errno.EIO
    assert os.getpid() not in fuse_stall.held_tids()


def test_stop_processes_reports_the_stuck_worker_unkillable_and_returns(
    procs: ProcessTracker, fuse_stall: FuseStall
) -> None:
    healthy = procs.sleeper()
    stuck = procs.stuck_in_fuse(fuse_stall)
    identities = [capture_identity(0, healthy.pid), capture_identity(1, stuck.pid)]
    report = stop_processes(identities, grace_s=0.2, kill_s=0.5)  # returns: pytest-timeout bounds it
    assert report.workers[0].outcome is StopOutcome.EXITED_AFTER_TERM
    assert report.workers[1].outcome is StopOutcome.UNKILLABLE
    assert not report.restartable and not report.all_stopped
    [item] = report.unkillable
    assert (item.rank, item.pid, item.signal) == (1, stuck.pid, "SIGKILL")
    assert item.state == "D" and item.kill_pending and item.d_tids == (stuck.pid,)
    # A Popen target the call cannot reap is left to its owner.
    again = stop_processes([stuck], grace_s=0.1, kill_s=0.2)
    assert again.workers[0].outcome is StopOutcome.UNKILLABLE and stuck.returncode is None
    fuse_stall.release()
    # The fatal signal pending since SIGTERM (converted to a group kill) takes effect now.
    assert stuck.wait(10 * WAIT_SCALE) in (-signal.SIGKILL, -signal.SIGTERM)
    assert wait_until(lambda: _gone(stuck.pid), 10)


def test_remove_leftover_mounts_takes_only_dead_owners(procs: ProcessTracker) -> None:
    reason = fuse_available()
    if reason is not None:
        require_or_skip("fuse", reason)
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True
    )
    procs.popens.append(owner)
    procs.track(owner.pid)
    assert owner.stdout is not None and owner.stdin is not None
    mountpoint = owner.stdout.readline().decode().strip()
    try:
        assert mountpoint in fuse_mounts()
        assert mountpoint not in remove_leftover_mounts()  # its owner lives
        assert mountpoint in fuse_mounts()
        owner.kill()
        assert owner.wait(10 * WAIT_SCALE) == -signal.SIGKILL
        assert mountpoint in fuse_mounts()  # a dead owner's mount stays ...
        assert mountpoint in remove_leftover_mounts()  # ... until cleaned up
        assert mountpoint not in fuse_mounts() and not os.path.lexists(mountpoint)
    finally:
        owner.stdin.close()
        if owner.poll() is None:
            owner.kill()
            owner.wait(10)
        remove_leftover_mounts()


def _switches(pid: int, tid: int) -> int | None:
    try:
        return _procfs.read_status(pid, tid).context_switches
    except OSError:
        return None


def test_slow_reads_are_answered_late_with_the_files_bytes(procs: ProcessTracker, fuse_stall: FuseStall) -> None:
    reader, tid = procs.slow_reader(fuse_stall, 4.0)  # outlasts the two waits below on a loaded machine
    # Waiting for an answer: in D in the FUSE request, and each answer wakes it (a context switch).
    assert wait_until(lambda: _thread_state(reader.pid, tid) == "D", 10)
    assert _procfs.read_wchan(reader.pid, tid) == "request_wait_answer"
    first = _switches(reader.pid, tid)
    assert first is not None and wait_until(lambda: (_switches(reader.pid, tid) or 0) > first, 10)
    assert reader.stdout is not None and reader.stdin is not None
    result = SlowReadResult.parse(reader.stdout.readline())
    assert result.reads >= 1 and result.mismatches == 0 and result.nbytes == 4096 * result.reads, result
    assert result.longest_read_s >= 0.1, result  # a lower bound: load only adds
    assert fuse_stall.slow_reads_answered() >= result.reads
    reader.stdin.close()
    assert reader.wait(10 * WAIT_SCALE) == 0


def test_release_during_a_slow_read_ends_it_and_leaves_nothing(procs: ProcessTracker, fuse_stall: FuseStall) -> None:
    reader, _ = procs.slow_reader(fuse_stall, 600.0)
    assert wait_until(lambda: fuse_stall.slow_reads_answered() >= 2, 10)
    fuse_stall.release()  # a read under way gets ENOTCONN; its answer, not yet due, is dropped
    assert reader.stdout is not None and reader.stdin is not None
    result = SlowReadResult.parse(reader.stdout.readline())
    assert result.reads >= 2 and result.mismatches == 0, result
    reader.stdin.close()
    assert reader.wait(10 * WAIT_SCALE) == 0
    _assert_cleaned_up(fuse_stall)
    # Killed while waiting for a late answer: dies once it comes (or at release), like any reader.
    with FuseStall(read_delay_s=(0.5, 0.5)) as stall:
        killed = subprocess.Popen(slow_reader_cmd(stall, 600.0), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  start_new_session=True)
        procs.popens.append(killed)
        procs.track(killed.pid)
        assert killed.stdout is not None and killed.stdout.readline().strip().isdigit()
        os.kill(killed.pid, signal.SIGKILL)
        assert killed.wait(10 * WAIT_SCALE) == -signal.SIGKILL
    _assert_cleaned_up(stall)


def test_slow_read_settings_are_checked() -> None:
    for bad in ((0.3, 0.1), (-0.1, 0.2), (0.1, 11.0)):
        with pytest.raises(ValueError, match="read_delay_s"):
            FuseStall(read_delay_s=bad)
    with pytest.raises(ValueError, match="positive"):
        slow_reader_cmd(FuseStall(), 0)
    for line in (b"", b"1 2 3", b"a b c d"):
        with pytest.raises(ValueError):
            SlowReadResult.parse(line)
    assert SlowReadResult.parse(b"3 12288 0 0.250\n") == SlowReadResult(3, 12288, 0, 0.25)
