"""Bounded shutdown with real processes, real signals and real D state (cgroup v1 freezer and FUSE)."""

from __future__ import annotations

import errno
import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import pytest

from tests.support.facilities import require_facility
from tests.support.process_tracker import SLEEPER, ProcessTracker, state_of
from tests.support.stuck_processes import StuckChild
from tests.support.waits import WAIT_SCALE, wait_until
from trtllm_liveness import EventKind, WorkerEvent
from trtllm_liveness.monitor import WorkerProcessMonitor
from trtllm_liveness.process import _pidfd, _procfs, capture_identity
from trtllm_liveness.stop._bounded_stop import stop_processes
from trtllm_liveness.stop._stop_report import StopOutcome, StopReport

pytestmark = [pytest.mark.real_process, pytest.mark.timeout(60)]

# A generous hang guard, not a speed assertion: the bound itself is measured by
# scripts/bench_shutdown.py. Without the bound a frozen worker would block the call forever.

# Counts every SIGTERM it receives on stdout and keeps running.
TERM_COUNTER = (
    "import os, signal, sys, time\n"
    "signal.signal(signal.SIGTERM, lambda *a: os.write(1, b'TERM\\n'))\n"
    "sys.stdout.write('ready\\n'); sys.stdout.flush()\n"
    "while True: time.sleep(3600)\n"
)


def _gone(pid: int) -> bool:
    return state_of(pid) in (None, "Z")


def _mp_sleeper() -> None:
    time.sleep(3600)


def test_sigterm_ignoring_child_ends_by_sigkill_and_is_reaped(procs: ProcessTracker) -> None:
    stubborn = procs.sleeper(ignore_term=True)
    polite = procs.sleeper()
    report = stop_processes([stubborn, polite], grace_s=0.3, kill_s=5.0)
    by_pid = {worker.pid: worker for worker in report.workers}
    assert by_pid[stubborn.pid].outcome is StopOutcome.EXITED_AFTER_KILL
    assert by_pid[stubborn.pid].signals_sent == ("SIGTERM", "SIGKILL")
    assert by_pid[polite.pid].outcome is StopOutcome.EXITED_AFTER_TERM
    # Reaped by the call: Popen knows the status and no zombie is left.
    assert stubborn.returncode == -9 and by_pid[stubborn.pid].returncode == -9
    assert polite.returncode == -15
    assert state_of(stubborn.pid) is None and state_of(polite.pid) is None
    assert report.restartable and report.all_stopped and not report.unkillable


def test_popen_and_multiprocessing_children_are_reaped(procs: ProcessTracker) -> None:
    children = [procs.sleeper() for _ in range(3)]
    ctx = multiprocessing.get_context("fork")
    process = ctx.Process(target=_mp_sleeper, daemon=True)
    process.start()
    assert process.pid is not None
    procs.track(process.pid)
    report = stop_processes([*children, process], grace_s=5.0, kill_s=5.0)
    assert [w.outcome for w in report.workers] == [StopOutcome.EXITED_AFTER_TERM] * 4
    assert all(child.returncode == -15 for child in children)
    assert process.exitcode == -15
    for pid in [child.pid for child in children] + [process.pid]:
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)  # already reaped: nothing left for us to collect


def test_wedged_worker_is_reported_unkillable_and_the_call_returns(
    procs: ProcessTracker, stuck_child: StuckChild, caplog: pytest.LogCaptureFixture
) -> None:
    healthy = procs.sleeper()
    wedged = stuck_child.popen
    identities = [capture_identity(0, healthy.pid), capture_identity(1, wedged.pid)]
    assert wait_until(lambda: state_of(wedged.pid) == "D", 10)
    caplog.set_level(logging.ERROR, logger="trtllm_liveness")

    # It returns (pytest-timeout bounds the test; the deadline is measured by bench_shutdown.py).
    report = stop_processes(identities, grace_s=0.2, kill_s=0.5)

    assert isinstance(report, StopReport)
    assert report.workers[0].outcome is StopOutcome.EXITED_AFTER_TERM
    assert report.workers[1].outcome is StopOutcome.UNKILLABLE
    assert report.workers[1].signals_sent == ("SIGTERM", "SIGKILL")
    assert not report.restartable and not report.all_stopped
    [stuck] = report.unkillable
    assert (stuck.rank, stuck.pid, stuck.signal) == (1, wedged.pid, "SIGKILL")
    assert stuck.state == "D" and stuck.kill_pending and wedged.pid in stuck.d_tids
    assert stuck.hostname == identities[1].hostname
    if stuck_child.source == "fuse":
        assert stuck.d_wchan == "request_wait_answer"
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    mine = [text for text in errors if f"pid {wedged.pid}" in text]
    assert len(mine) == 1
    assert "SIGKILL" in mine[0] and "recycling" in mine[0] and "GPUs/NICs" in mine[0]
    [event] = report.events()
    assert event.kind is EventKind.UNKILLABLE and not event.restartable
    assert event.identity == identities[1]
    data = report.to_dict()
    assert data["restartable"] is False and data["unkillable"][0]["pid"] == wedged.pid

    stuck_child.release()  # the pending fatal signals take effect now (the kernel may report SIGTERM's)
    assert wait_until(lambda: _gone(wedged.pid), 10)
    assert wedged.wait(10) in (-9, -15)
    assert state_of(wedged.pid) is None


def test_wedged_popen_child_is_left_unreaped_until_it_can_die(procs: ProcessTracker, stuck_child: StuckChild) -> None:
    child = stuck_child.popen
    assert wait_until(lambda: state_of(child.pid) == "D", 10)
    report = stop_processes([child], grace_s=0.1, kill_s=0.3)
    assert report.workers[0].outcome is StopOutcome.UNKILLABLE
    assert child.returncode is None  # cannot reap a live task; the caller waits for it later
    assert state_of(child.pid) == "D"
    stuck_child.release()
    assert child.wait(10) in (-9, -15)


def test_wedged_group_member_makes_the_leader_unkillable_and_the_call_returns(
    procs: ProcessTracker, stuck_child: StuckChild
) -> None:
    # The wedged child leads its own group (start_new_session): the group path signals it, and the
    # call still returns within its bound with the leader reported unkillable.
    wedged = stuck_child.popen
    report = stop_processes([wedged], process_group=True, grace_s=0.1, kill_s=0.3)
    [worker] = report.workers
    assert worker.outcome is StopOutcome.UNKILLABLE
    assert worker.signals_sent == (f"SIGTERM (group {wedged.pid})", f"SIGKILL (group {wedged.pid})")
    assert [item.pid for item in report.unkillable] == [wedged.pid]
    stuck_child.release()
    assert wedged.wait(10) in (-9, -15)


def test_wrong_start_time_is_unverified_and_not_signalled(procs: ProcessTracker) -> None:
    child = procs.sleeper()
    real = capture_identity(3, child.pid)
    forged = real._replace(start_time=real.start_time + 1)
    report = stop_processes([forged], grace_s=0.1, kill_s=0.1)
    [worker] = report.workers
    assert worker.outcome is StopOutcome.UNVERIFIED
    assert (worker.rank, worker.pid) == (3, child.pid) and worker.signals_sent == ()
    assert child.poll() is None and state_of(child.pid) in ("S", "R")
    assert not report.all_stopped


def test_unparsable_stat_is_unverified_not_signalled_and_leaks_no_fd(
    procs: ProcessTracker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    child = procs.sleeper()
    (tmp_path / str(child.pid)).mkdir()
    (tmp_path / str(child.pid) / "stat").write_bytes(b"garbage without a comm")
    monkeypatch.setattr(_procfs, "PROCFS_PATH", str(tmp_path))
    fds_before = len(os.listdir("/proc/self/fd"))
    report = stop_processes([child.pid, child.pid], grace_s=0.1, kill_s=0.1)
    monkeypatch.undo()
    assert len(os.listdir("/proc/self/fd")) == fds_before  # each pidfd opened was closed
    assert [w.outcome for w in report.workers] == [StopOutcome.UNVERIFIED] * 2
    assert all(w.signals_sent == () for w in report.workers)
    assert child.poll() is None and state_of(child.pid) in ("S", "R")


def test_identities_of_other_hosts_and_namespaces_are_never_signalled(procs: ProcessTracker) -> None:
    child = procs.sleeper()
    real = capture_identity(0, child.pid)
    remote = real._replace(rank=1, hostname="some-other-host")
    other_ns = real._replace(rank=2, pid_namespace=real.pid_namespace + 1)
    report = stop_processes([remote, other_ns], grace_s=0.1, kill_s=0.1)
    assert [w.outcome for w in report.workers] == [StopOutcome.NOT_LOCAL, StopOutcome.NOT_LOCAL]
    assert child.poll() is None
    # The host name is the caller's to choose (a container may report another one).
    report = stop_processes([real], host="some-other-host", grace_s=0.1, kill_s=0.1)
    assert report.workers[0].outcome is StopOutcome.NOT_LOCAL
    assert child.poll() is None


def test_identity_without_start_time_or_namespace_is_unverified_and_not_signalled(procs: ProcessTracker) -> None:
    # Upstream sends None for a field the worker could not read: nothing to verify the pid against.
    child = procs.sleeper()
    real = capture_identity(0, child.pid)
    report = stop_processes([real._replace(start_time=None), real._replace(rank=1, pid_namespace=None)],
                            process_group=True, grace_s=0.1, kill_s=0.1)
    assert [w.outcome for w in report.workers] == [StopOutcome.UNVERIFIED] * 2
    assert all(w.signals_sent == () for w in report.workers)
    assert child.poll() is None and state_of(child.pid) in ("S", "R")


def test_bad_input_is_reported_and_never_signalled(procs: ProcessTracker) -> None:
    child = procs.sleeper()
    done = procs.sleeper()
    done.kill()
    done.wait(10)
    targets: list[object] = [1, os.getpid(), True, "123", (1, 2), -5, done]
    report = stop_processes(targets, grace_s=0.1, kill_s=0.1)  # type: ignore[arg-type]
    outcomes = [w.outcome for w in report.workers]
    assert outcomes[:6] == [StopOutcome.UNVERIFIED] * 6
    assert outcomes[6] is StopOutcome.ALREADY_GONE and report.workers[6].returncode == -9
    assert all(w.signals_sent == () for w in report.workers)
    assert child.poll() is None
    with pytest.raises(ValueError):
        stop_processes([child], grace_s=-1)
    with pytest.raises(ValueError):
        stop_processes([child], kill_s=float("inf"))
    with pytest.raises(ValueError):
        stop_processes([child], term_signal=0)
    with pytest.raises(ValueError):
        stop_processes(None)  # type: ignore[arg-type]
    assert child.poll() is None


@dataclass
class GroupSignals:
    """Which path signalled process groups: the leader's pidfd, or killpg by number."""

    path: str
    pidfd_calls: list[tuple[int, int]] = field(default_factory=list)
    killpg_calls: list[tuple[int, int]] = field(default_factory=list)

    def check_path(self) -> None:
        if self.path == "pidfd":
            assert self.pidfd_calls and not self.killpg_calls
        else:
            assert self.killpg_calls and not self.pidfd_calls


@pytest.fixture(params=["pidfd", "killpg"])
def group_signals(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> GroupSignals:
    """Run a test over both group-signal paths; "killpg" forces the probe off (a kernel < 6.9).
    The real calls still happen: the recorders only pass them on."""
    seen = GroupSignals(request.param)
    if request.param == "pidfd":
        require_facility("pidfd-group")
    else:
        monkeypatch.setattr(_pidfd, "group_signal_supported", lambda: False)
    real_send, real_killpg = _pidfd.send_group_signal, os.killpg

    def send(pidfd: int, sig: int) -> bool:
        seen.pidfd_calls.append((pidfd, sig))
        return real_send(pidfd, sig)

    def killpg(pgid: int, sig: int) -> None:
        seen.killpg_calls.append((pgid, sig))
        real_killpg(pgid, sig)

    monkeypatch.setattr(_pidfd, "send_group_signal", send)
    monkeypatch.setattr(os, "killpg", killpg)
    return seen


def test_process_group_signalling_reaches_the_workers_children(
    procs: ProcessTracker, group_signals: GroupSignals
) -> None:
    middle, grandchild = procs.grandchild()
    report = stop_processes([middle], process_group=True, grace_s=5.0, kill_s=5.0)
    [worker] = report.workers
    assert worker.outcome is StopOutcome.EXITED_AFTER_TERM
    assert worker.signals_sent == (f"SIGTERM (group {middle.pid})",)
    assert "1 group member(s) awaited" in worker.detail
    assert middle.returncode == -15
    assert wait_until(lambda: _gone(grandchild), 10)
    group_signals.check_path()


def test_without_process_group_the_children_are_left_alone(procs: ProcessTracker) -> None:
    middle, grandchild = procs.grandchild()
    report = stop_processes([middle], grace_s=5.0, kill_s=5.0)
    assert report.workers[0].outcome is StopOutcome.EXITED_AFTER_TERM
    assert state_of(grandchild) in ("S", "R")  # only the worker itself was signalled


def test_process_group_stubborn_member_gets_sigkill(procs: ProcessTracker, group_signals: GroupSignals) -> None:
    code = (
        "import os, signal, sys, time\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(3600); os._exit(0)\n"
        "sys.stdout.write(f'{pid}\\n'); sys.stdout.flush(); time.sleep(3600)\n"
    )
    leader = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=True)
    procs.popens.append(leader)
    procs.track(leader.pid)
    assert leader.stdout is not None
    member = procs.track(int(leader.stdout.readline()))
    # The member sets SIG_IGN right after fork; wait until it has (SigIgn bit 15 set).
    assert wait_until(lambda: _ignores_term(member), 10)
    report = stop_processes([leader], process_group=True, grace_s=0.3, kill_s=5.0)
    [worker] = report.workers
    # The leader died of SIGTERM; its member needed SIGKILL, which the group still received
    # because the unreaped leader pins the group id.
    assert worker.outcome is StopOutcome.EXITED_AFTER_TERM
    assert worker.signals_sent == (f"SIGTERM (group {leader.pid})", f"SIGKILL (group {leader.pid})")
    assert wait_until(lambda: _gone(member), 10)
    assert leader.returncode == -15
    group_signals.check_path()
    assert [sig for _who, sig in group_signals.pidfd_calls + group_signals.killpg_calls] == [
        signal.SIGTERM, signal.SIGKILL]


# The leader forks a session-leading "leader" of its own that it reaps at once when it exits; that
# leader forks a member that ignores SIGTERM and, when one arrives, forks a late child into the
# group and prints its pid. So by the kill phase the group's leader is reaped and a member exists
# that no scan at the start saw.
LATE_FORKER = """
import os, signal, sys, time
leader = os.fork()
if leader == 0:
    os.setsid()
    member = os.fork()
    if member == 0:
        def on_term(*_):
            late = os.fork()
            if late == 0:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                time.sleep(3600); os._exit(0)
            os.write(1, f"late {late}\\n".encode())
        signal.signal(signal.SIGTERM, on_term)
        os.write(1, f"member {os.getpid()}\\n".encode())
        while True:
            time.sleep(3600)
    os.write(1, f"leader {os.getpid()}\\n".encode())
    time.sleep(3600); os._exit(0)
os.waitpid(leader, 0)  # reap the leader the moment it dies, as an init or a supervisor would
os.write(1, b"reaped\\n")
time.sleep(3600)
"""


def _read_tagged(stream: IO[bytes], tag: bytes, seen: dict[bytes, int]) -> int:
    """The pid on the line tagged ``tag``; lines of other tags read meanwhile (the leader and the
    member write in either order) are kept in ``seen``."""
    while tag not in seen:
        line = stream.readline()
        assert line, f"no {tag!r} line"
        words = line.split()
        if len(words) == 2 and words[1].isdigit():
            seen[words[0]] = int(words[1])
    return seen[tag]


def test_group_signal_goes_through_the_pidfd_and_reaches_members_after_the_leader_is_reaped(
    procs: ProcessTracker,
) -> None:
    """With PIDFD_SIGNAL_PROCESS_GROUP the group stays addressed by the leader's pidfd after the
    leader is reaped: SIGKILL reaches a member forked after the start. The killpg path cannot send
    it (the reaped leader no longer pins the number) and signals only the members it saw."""
    require_facility("pidfd-group")
    top = subprocess.Popen([sys.executable, "-c", LATE_FORKER], stdout=subprocess.PIPE, start_new_session=True)
    procs.popens.append(top)
    procs.track(top.pid)
    assert top.stdout is not None
    seen: dict[bytes, int] = {}
    leader = procs.track(_read_tagged(top.stdout, b"leader", seen))
    member = procs.track(_read_tagged(top.stdout, b"member", seen))
    assert wait_until(lambda: _handles_term(member), 10)  # its SIGTERM handler is installed
    identity = capture_identity(0, leader)
    report = stop_processes([identity], process_group=True, grace_s=1.0 * WAIT_SCALE, kill_s=5.0)
    late = procs.track(_read_tagged(top.stdout, b"late", seen))
    [worker] = report.workers
    assert worker.outcome is StopOutcome.EXITED_AFTER_TERM
    assert worker.signals_sent == (f"SIGTERM (group {leader})", f"SIGKILL (group {leader})")
    assert wait_until(lambda: _gone(member), 10)
    assert wait_until(lambda: _gone(late), 10), "the late member never got the group's SIGKILL"


def _handles_term(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as handle:
            for line in handle:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) & (1 << 14))
    except OSError:
        pass
    return False


def test_group_signal_probe_and_wrapper_reject_what_is_not_a_group(procs: ProcessTracker) -> None:
    require_facility("pidfd-group")
    assert _pidfd.group_signal_supported() is _pidfd.group_signal_supported() is True  # cached
    child = subprocess.Popen([sys.executable, "-c", SLEEPER], stdout=subprocess.PIPE)  # in our group
    procs.popens.append(child)
    procs.track(child.pid)
    assert child.stdout is not None and child.stdout.readline() == b"ready\n"
    fd = os.pidfd_open(child.pid)
    try:
        # It leads no group: nothing is signalled, not even the process itself, nor our group.
        assert _pidfd.send_group_signal(fd, signal.SIGTERM) is False
        assert child.poll() is None and state_of(child.pid) in ("S", "R")
    finally:
        os.close(fd)
    leader = procs.sleeper()  # leads its own group
    fd = os.pidfd_open(leader.pid)
    try:
        with pytest.raises(OSError) as bad_signal:
            _pidfd.send_group_signal(fd, 4096)
        assert bad_signal.value.errno == errno.EINVAL
        assert leader.poll() is None
    finally:
        os.close(fd)
    with open(os.devnull) as not_a_pidfd:
        with pytest.raises(OSError) as wrong_fd:
            _pidfd.send_group_signal(not_a_pidfd.fileno(), signal.SIGTERM)
    assert wrong_fd.value.errno == errno.EBADF
    assert child.poll() is None


def test_group_of_a_forged_identity_is_never_signalled(procs: ProcessTracker, group_signals: GroupSignals) -> None:
    middle, grandchild = procs.grandchild()
    real = capture_identity(0, middle.pid)
    forged = real._replace(start_time=real.start_time + 1)
    report = stop_processes([forged, real._replace(rank=1, hostname="elsewhere")], process_group=True,
                            grace_s=0.1, kill_s=0.1)
    assert [w.outcome for w in report.workers] == [StopOutcome.UNVERIFIED, StopOutcome.NOT_LOCAL]
    assert all(w.signals_sent == () for w in report.workers)
    assert group_signals.pidfd_calls == [] and group_signals.killpg_calls == []
    assert middle.poll() is None and state_of(grandchild) in ("S", "R")


def _ignores_term(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as handle:
            for line in handle:
                if line.startswith("SigIgn:"):
                    return bool(int(line.split()[1], 16) & (1 << 14))
    except OSError:
        pass
    return False


def test_two_concurrent_calls_are_safe_and_send_sigterm_once(procs: ProcessTracker) -> None:
    children = []
    for _ in range(3):
        child = subprocess.Popen([sys.executable, "-c", TERM_COUNTER], stdout=subprocess.PIPE)
        procs.popens.append(child)
        procs.track(child.pid)
        assert child.stdout is not None and child.stdout.readline() == b"ready\n"
        children.append(child)
    identities = [capture_identity(rank, child.pid) for rank, child in enumerate(children)]
    barrier = threading.Barrier(2)
    reports: list[StopReport] = []
    errors: list[BaseException] = []

    def stop(targets: list[object]) -> None:
        try:
            barrier.wait(10)
            reports.append(stop_processes(targets, grace_s=0.5, kill_s=5.0))  # type: ignore[arg-type]
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=stop, args=(list(children),)),
               threading.Thread(target=stop, args=(list(identities),))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not any(thread.is_alive() for thread in threads) and not errors
    assert len(reports) == 2
    for report in reports:
        assert [w.outcome for w in report.workers] == [StopOutcome.EXITED_AFTER_KILL] * 3
        assert report.restartable
    for child in children:
        child.wait(10)
        assert child.returncode == -9
        assert child.stdout is not None
        assert child.stdout.read().count(b"TERM") == 1  # one SIGTERM across both calls


def test_stop_beside_a_running_monitor(procs: ProcessTracker) -> None:
    children = [procs.sleeper() for _ in range(3)]
    identities = [capture_identity(rank, child.pid) for rank, child in enumerate(children)]
    events: list[WorkerEvent] = []
    with WorkerProcessMonitor(d_state_timeout_s=5.0, scan_interval_s=0.01) as monitor:
        monitor.subscribe(events.append)
        monitor.register(identities)
        monitor.start()
        report = stop_processes(children, grace_s=5.0, kill_s=5.0)
        assert report.all_stopped
        assert wait_until(lambda: len(events) == 3, 10)
        assert {event.kind for event in events} == {EventKind.DIED}
        assert monitor.watcher_alive and monitor.watcher_error is None


def test_called_from_a_signal_handlers_deferred_path(procs: ProcessTracker) -> None:
    # The documented pattern: the handler only sets a flag; a thread does the blocking stop.
    children = [procs.sleeper(), procs.sleeper(ignore_term=True)]
    requested = threading.Event()
    reports: list[StopReport] = []

    def stopper() -> None:
        if requested.wait(20):
            reports.append(stop_processes(children, grace_s=0.2, kill_s=5.0))

    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: requested.set())
    try:
        thread = threading.Thread(target=stopper, name="test-stopper")
        thread.start()
        os.kill(os.getpid(), signal.SIGUSR1)
        thread.join(30)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert not thread.is_alive() and len(reports) == 1
    assert [w.outcome for w in reports[0].workers] == [StopOutcome.EXITED_AFTER_TERM, StopOutcome.EXITED_AFTER_KILL]
    assert all(child.returncode is not None for child in children)
