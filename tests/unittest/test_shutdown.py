"""Bounded shutdown with real processes, real signals and real D state (cgroup v1 freezer)."""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from trtllm_liveness import EventKind, WorkerEvent, WorkerProcessMonitor, _procfs, capture_identity
from trtllm_liveness._shutdown import StopOutcome, StopReport, stop_processes

from ..conftest import Freezer, ProcessTracker, state_of, wait_until

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


def test_frozen_worker_is_reported_unkillable_and_the_call_returns(
    procs: ProcessTracker, freezer: Freezer, caplog: pytest.LogCaptureFixture
) -> None:
    healthy = procs.sleeper()
    wedged = procs.sleeper()
    identities = [capture_identity(0, healthy.pid), capture_identity(1, wedged.pid)]
    freezer.add(wedged.pid)
    freezer.freeze()
    assert wait_until(lambda: state_of(wedged.pid) == "D", 10)
    caplog.set_level(logging.ERROR, logger="trtllm_liveness")

    # It returns (pytest-timeout bounds the test; the deadline is measured by bench_shutdown.py).
    report = stop_processes(identities, grace_s=0.2, kill_s=0.5)

    assert isinstance(report, StopReport)
    assert report.workers[0].outcome is StopOutcome.EXITED_AFTER_TERM
    assert report.workers[1].outcome is StopOutcome.UNKILLABLE
    assert not report.restartable and not report.all_stopped
    [stuck] = report.unkillable
    assert (stuck.rank, stuck.pid, stuck.signal) == (1, wedged.pid, "SIGKILL")
    assert stuck.state == "D" and stuck.kill_pending and stuck.d_tids
    assert stuck.hostname == identities[1].hostname
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    mine = [text for text in errors if f"pid {wedged.pid}" in text]
    assert len(mine) == 1
    assert "SIGKILL" in mine[0] and "recycling" in mine[0] and "GPUs/NICs" in mine[0]
    [event] = report.events()
    assert event.kind is EventKind.UNKILLABLE and not event.restartable
    assert event.identity == identities[1]
    data = report.to_dict()
    assert data["restartable"] is False and data["unkillable"][0]["pid"] == wedged.pid

    freezer.thaw()  # the pending fatal signals take effect now (the kernel may report SIGTERM's)
    assert wait_until(lambda: _gone(wedged.pid), 10)
    assert wedged.wait(10) in (-9, -15)
    assert state_of(wedged.pid) is None


def test_frozen_popen_child_is_left_unreaped_until_it_can_die(procs: ProcessTracker, freezer: Freezer) -> None:
    child = procs.sleeper()
    freezer.add(child.pid)
    freezer.freeze()
    assert wait_until(lambda: state_of(child.pid) == "D", 10)
    report = stop_processes([child], grace_s=0.1, kill_s=0.3)
    assert report.workers[0].outcome is StopOutcome.UNKILLABLE
    assert child.returncode is None  # cannot reap a live task; the caller waits for it later
    freezer.thaw()
    assert child.wait(10) in (-9, -15)


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


def test_process_group_signalling_reaches_the_workers_children(procs: ProcessTracker) -> None:
    middle, grandchild = procs.grandchild()
    report = stop_processes([middle], process_group=True, grace_s=5.0, kill_s=5.0)
    [worker] = report.workers
    assert worker.outcome is StopOutcome.EXITED_AFTER_TERM
    assert worker.signals_sent == (f"SIGTERM (group {middle.pid})",)
    assert "1 group member(s) awaited" in worker.detail
    assert middle.returncode == -15
    assert wait_until(lambda: _gone(grandchild), 10)


def test_without_process_group_the_children_are_left_alone(procs: ProcessTracker) -> None:
    middle, grandchild = procs.grandchild()
    report = stop_processes([middle], grace_s=5.0, kill_s=5.0)
    assert report.workers[0].outcome is StopOutcome.EXITED_AFTER_TERM
    assert state_of(grandchild) in ("S", "R")  # only the worker itself was signalled


def test_process_group_stubborn_member_gets_sigkill(procs: ProcessTracker) -> None:
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
