"""WorkerProcessMonitor with real processes: deaths, PID reuse, zombies, namespaces, fallbacks, threads."""

from __future__ import annotations

import json
import logging
import os
import resource
import signal
import subprocess
import sys
import threading

import pytest

from tests.support.facilities import needs, require_or_skip
from tests.support.process_tracker import ProcessTracker, start_time_or_none, state_of
from tests.support.waits import wait_until
from trtllm_liveness import EventKind, MonitorMethod, RankStatus, WorkerEvent, WorkerState
from trtllm_liveness.monitor import WorkerProcessMonitor
from trtllm_liveness.monitor._watcher import WatcherClosed
from trtllm_liveness.process import InvalidIdentityError, ProcessIdentity, capture_identity

pytestmark = [pytest.mark.real_process, pytest.mark.timeout(90)]


class Recorder:
    def __init__(self) -> None:
        self.events: list[WorkerEvent] = []
        self.lock = threading.Lock()

    def __call__(self, event: WorkerEvent) -> None:
        with self.lock:
            self.events.append(event)

    def kinds(self) -> list[EventKind]:
        with self.lock:
            return [e.kind for e in self.events]

    def wait(self, count: int = 1, timeout: float = 10) -> bool:
        return wait_until(lambda: len(self.events) >= count, timeout)


def _state(monitor: WorkerProcessMonitor, rank: int) -> WorkerState:
    return next(s.state for s in monitor.statuses() if s.identity.rank == rank)


def test_sigkill_of_child_is_reported_with_rank_and_pid(procs: ProcessTracker) -> None:
    children = [procs.sleeper() for _ in range(3)]
    identities = [capture_identity(rank, child.pid) for rank, child in enumerate(children)]
    rec = Recorder()
    with WorkerProcessMonitor() as monitor:
        monitor.subscribe(rec)
        monitor.register(identities)
        monitor.start()
        assert monitor.find_dead_worker() is None
        assert {s.method for s in monitor.statuses()} == {"pidfd"}
        os.kill(children[2].pid, signal.SIGKILL)
        assert rec.wait()
        assert rec.events[0].kind is EventKind.DIED and rec.events[0].restartable
        assert rec.events[0].identity == identities[2]
        assert "rank 2" in rec.events[0].message and str(children[2].pid) in rec.events[0].message
        assert monitor.find_dead_worker() == identities[2]
        assert _state(monitor, 0) is WorkerState.ALIVE
        assert _state(monitor, 2) is WorkerState.ZOMBIE  # our child, not yet reaped
        assert "SIGKILL" in next(s.detail for s in monitor.statuses() if s.identity.rank == 2)
        # Sticky: a second death does not change the first answer.
        os.kill(children[0].pid, signal.SIGKILL)
        assert rec.wait(2)
        assert monitor.find_dead_worker() == identities[2]
        assert monitor.failure is not None and monitor.failure.identity == identities[2]


def test_sigkill_of_non_child_is_reported_without_watcher(procs: ProcessTracker) -> None:
    _middle, pid = procs.grandchild()
    identity = capture_identity(7, pid)
    with WorkerProcessMonitor() as monitor:
        monitor.register([identity])
        assert monitor.find_dead_worker() is None
        os.kill(pid, signal.SIGKILL)
        assert wait_until(lambda: monitor.find_dead_worker() is not None, 10)
        dead = monitor.find_dead_worker()
        assert dead is not None and dead.rank == 7 and dead.pid == pid
        assert _state(monitor, 7) in (WorkerState.EXITED, WorkerState.ZOMBIE)


def test_wrong_start_time_is_dead_and_the_process_is_left_alone(procs: ProcessTracker) -> None:
    child = procs.sleeper()
    real = capture_identity(0, child.pid)
    stale = real._replace(start_time=real.start_time - 1)
    rec = Recorder()
    with WorkerProcessMonitor(d_state_timeout_s=5, scan_interval_s=0.05) as monitor:
        monitor.subscribe(rec)
        monitor.register([stale])
        monitor.start()
        assert monitor.find_dead_worker() == stale
        assert rec.kinds() == [EventKind.DIED]
        assert "PID reused" in rec.events[0].cause
    assert child.poll() is None
    assert state_of(child.pid) in ("S", "R")
    assert start_time_or_none(child.pid) == real.start_time


def test_zombie_grandchild_is_dead(procs: ProcessTracker) -> None:
    _middle, pid = procs.grandchild(reap=False)
    identity = capture_identity(1, pid)
    rec = Recorder()
    with WorkerProcessMonitor() as monitor:
        monitor.subscribe(rec)
        monitor.register([identity])
        monitor.start()
        os.kill(pid, signal.SIGKILL)
        assert rec.wait()
        assert wait_until(lambda: state_of(pid) == "Z", 5)
        assert _state(monitor, 1) is WorkerState.ZOMBIE
        assert monitor.find_dead_worker() == identity
    # Registering an existing zombie: dead at once.
    with WorkerProcessMonitor() as monitor:
        monitor.register([identity])
        assert monitor.find_dead_worker() == identity
        assert _state(monitor, 1) is WorkerState.ZOMBIE


def test_process_gone_at_registration_is_dead(procs: ProcessTracker) -> None:
    child = procs.sleeper()
    identity = capture_identity(0, child.pid)
    child.kill()
    child.wait(10)
    with WorkerProcessMonitor() as monitor:
        monitor.register([identity])
        assert monitor.find_dead_worker() == identity
        assert _state(monitor, 0) is WorkerState.EXITED


def test_other_host_is_unmonitored_not_dead(procs: ProcessTracker) -> None:
    child = procs.sleeper()
    remote = capture_identity(0, child.pid)._replace(hostname="other-host.example")
    rec = Recorder()
    with WorkerProcessMonitor() as monitor:
        monitor.subscribe(rec)
        monitor.register([remote])
        monitor.start()
        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)
        assert monitor.find_dead_worker() is None
        status = monitor.statuses()[0]
        assert status.state is WorkerState.UNMONITORED_REMOTE and status.method == "none"
        assert rec.events == []


@needs("unshare")
def test_other_pid_namespace_is_unmonitored_not_dead(procs: ProcessTracker) -> None:
    code = (
        "import json, sys, time\nfrom trtllm_liveness.process import capture_identity\n"
        "print(json.dumps(list(capture_identity(0))), flush=True)\ntime.sleep(3600)\n"
    )
    proc = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", code],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    procs.popens.append(proc)
    procs.track(proc.pid)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        require_or_skip("unshare", f"unshare --pid failed here: {proc.stderr.read().decode() if proc.stderr else ''}")
    inner = ProcessIdentity(*json.loads(line))
    # The worker's own view: pid 1 of its namespace, and that namespace's real inode.
    inner_child = [int(p) for p in open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()]
    assert inner_child, "unshare --fork has no child"
    procs.track(inner_child[0])
    assert inner.pid_namespace == os.stat(f"/proc/{inner_child[0]}/ns/pid").st_ino
    assert inner.pid_namespace != os.stat("/proc/self/ns/pid").st_ino
    rec = Recorder()
    with WorkerProcessMonitor() as monitor:
        monitor.subscribe(rec)
        monitor.register([inner])
        monitor.start()
        assert monitor.find_dead_worker() is None
        status = monitor.statuses()[0]
        assert status.state is WorkerState.UNMONITORED_OTHER_NAMESPACE and status.method == "none"
        assert rec.events == []


RLIMIT_CHILD = """
import json, os, resource, signal, subprocess, sys, threading
from trtllm_liveness.monitor import WorkerProcessMonitor
from trtllm_liveness.process import capture_identity
sleeper = subprocess.Popen([sys.executable, "-c", "import time; print('ok', flush=True); time.sleep(3600)"],
                           stdout=subprocess.PIPE)
sleeper.stdout.readline()
identity = capture_identity(4, sleeper.pid)
monitor = WorkerProcessMonitor(procfs_interval_s=0.05)
got = threading.Event()
events = []
monitor.subscribe(lambda e: (events.append(e), got.set()))
highest = max(int(fd) for fd in os.listdir("/proc/self/fd"))
resource.setrlimit(resource.RLIMIT_NOFILE, (highest + 8, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
fillers = []
try:
    while True:
        fillers.append(os.open("/dev/null", os.O_RDONLY))
except OSError:
    pass
monitor.register([identity])
status = monitor.statuses()[0]
for fd in fillers:
    os.close(fd)
monitor.start()
dead_before = monitor.find_dead_worker()
sleeper.kill()
ok = got.wait(20)
print(json.dumps({"method": status.method, "detail": status.detail, "state": status.state.value, "ok": ok,
                  "dead_before": dead_before, "rank": events[0].identity.rank if events else None,
                  "pid": events[0].identity.pid if events else None, "expected_pid": sleeper.pid}))
sleeper.wait(10)
monitor.close()
"""


def test_low_rlimit_nofile_forces_procfs_fallback_and_detection_still_works() -> None:
    out = subprocess.run([sys.executable, "-c", RLIMIT_CHILD], capture_output=True, timeout=60,
                         start_new_session=True, check=False)
    assert out.returncode == 0, out.stderr.decode()
    result = json.loads(out.stdout.decode().strip().splitlines()[-1])
    assert result["method"] == "procfs"
    assert "EMFILE" in result["detail"]
    assert result["state"] == "alive" and result["dead_before"] is None
    assert result["ok"] and result["rank"] == 4 and result["pid"] == result["expected_pid"]


def test_pidfds_above_fd_setsize_work(procs: ProcessTracker) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        require_or_skip("nofile-1200", f"RLIMIT_NOFILE hard limit {hard} too low to place fds above 1024")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    fillers: list[int] = []
    try:
        while len(fillers) < 1100:
            fillers.append(os.open("/dev/null", os.O_RDONLY))
        child = procs.sleeper()
        identity = capture_identity(0, child.pid)
        rec = Recorder()
        with WorkerProcessMonitor() as monitor:
            monitor.subscribe(rec)
            monitor.register([identity])
            monitor.start()
            os.kill(child.pid, signal.SIGKILL)
            assert rec.wait()
            assert monitor.watcher_error is None and monitor.find_dead_worker() == identity
    finally:
        for fd in fillers:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_subscribe_start_stop_are_idempotent_and_thread_safe(procs: ProcessTracker) -> None:
    child = procs.sleeper()
    identity = capture_identity(0, child.pid)
    recorders = [Recorder() for _ in range(8)]
    with WorkerProcessMonitor() as monitor:
        monitor.register([identity])
        barrier = threading.Barrier(8)

        def hammer(index: int) -> None:
            barrier.wait(10)
            monitor.subscribe(recorders[index])
            for _ in range(20):
                monitor.start()
                monitor.stop(timeout=5)
            monitor.start()

        threads = [threading.Thread(target=hammer, args=(i,)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert not any(t.is_alive() for t in threads)
        monitor.start()
        monitor.start()
        assert monitor.watcher_alive
        assert sum(1 for t in threading.enumerate() if t.name == "trtllm-liveness-watcher") >= 1
        os.kill(child.pid, signal.SIGKILL)
        assert all(r.wait() for r in recorders)
        assert wait_until(lambda: all(len(r.events) == 1 for r in recorders), 5)
        assert monitor.stop(timeout=5) and monitor.stop(timeout=5)
        assert not monitor.watcher_alive
    monitor.close()  # idempotent
    with pytest.raises(RuntimeError):
        monitor.register([identity])
    with pytest.raises(RuntimeError):
        monitor.start()
    assert all(len(r.events) == 1 for r in recorders)  # exactly once per subscriber


def test_start_after_the_watcher_closed_says_the_monitor_is_closed(procs: ProcessTracker) -> None:
    """The watcher refuses a start after its close with its own type (WatcherClosed), and the monitor
    turns exactly that type into "WorkerProcessMonitor is closed": the window where another thread's
    close() lands between start()'s own check and the watcher's."""
    child = procs.sleeper()
    monitor = WorkerProcessMonitor()
    monitor.register([capture_identity(0, child.pid)])
    monitor._watcher.close(1.0)  # what a concurrent close() does after start() passed its check
    with pytest.raises(WatcherClosed):
        monitor._watcher.start(monitor)
    with pytest.raises(RuntimeError) as refused:
        monitor.start()
    assert type(refused.value) is RuntimeError and str(refused.value) == "WorkerProcessMonitor is closed"
    assert refused.value.__suppress_context__
    assert not monitor.watcher_alive
    monitor.close()


def test_raising_subscriber_is_logged_and_watcher_keeps_going(
    procs: ProcessTracker, caplog: pytest.LogCaptureFixture
) -> None:
    children = [procs.sleeper() for _ in range(2)]
    identities = [capture_identity(rank, child.pid) for rank, child in enumerate(children)]

    def bad(event: WorkerEvent) -> None:
        raise RuntimeError("subscriber bug")

    rec = Recorder()
    caplog.set_level(logging.WARNING, logger="trtllm_liveness")
    with WorkerProcessMonitor() as monitor:
        monitor.subscribe(bad)
        monitor.subscribe(rec)
        monitor.register(identities)
        monitor.start()
        os.kill(children[0].pid, signal.SIGKILL)
        assert rec.wait(1)
        os.kill(children[1].pid, signal.SIGKILL)
        assert rec.wait(2)
        assert monitor.watcher_alive and monitor.watcher_error is None
    assert {e.identity.rank for e in rec.events} == {0, 1}
    assert any("subscriber bug" in (r.exc_text or "") or "raised" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("reports", [False, True])
def test_a_death_is_logged_by_the_monitor_unless_a_subscriber_reports_it(
    procs: ProcessTracker, caplog: pytest.LogCaptureFixture, reports: bool
) -> None:
    """One failure, one line at WARNING or above: the monitor's own, or (``reports=True``) none
    from the monitor, whose subscriber writes the engine's fatal line itself."""
    child = procs.sleeper()
    rec = Recorder()
    caplog.set_level(logging.DEBUG, logger="trtllm_liveness.monitor")
    with WorkerProcessMonitor() as monitor:
        monitor.subscribe(rec, reports=reports)
        monitor.register([capture_identity(0, child.pid)])
        monitor.start()
        os.kill(child.pid, signal.SIGKILL)
        assert rec.wait(1)
    lines = [r for r in caplog.records if "exited unexpectedly" in r.getMessage()]
    assert len(lines) == 1, caplog.text
    assert lines[0].levelno == (logging.DEBUG if reports else logging.WARNING), caplog.text


def test_late_subscriber_gets_the_failure_at_once(procs: ProcessTracker) -> None:
    child = procs.sleeper()
    identity = capture_identity(0, child.pid)
    with WorkerProcessMonitor() as monitor:
        monitor.register([identity])
        os.kill(child.pid, signal.SIGKILL)
        assert wait_until(lambda: monitor.find_dead_worker() is not None, 10)
        rec = Recorder()
        monitor.subscribe(rec)
        assert rec.kinds() == [EventKind.DIED] and rec.events[0].identity == identity
        monitor.unsubscribe(rec)
        monitor.unsubscribe(rec)


def test_monitor_in_forked_child_is_inert(procs: ProcessTracker) -> None:
    child = procs.sleeper()
    identity = capture_identity(0, child.pid)
    rec = Recorder()
    with WorkerProcessMonitor() as monitor:
        monitor.subscribe(rec)
        monitor.register([identity])
        monitor.start()
        read_end, write_end = os.pipe()
        forked = os.fork()
        if forked == 0:  # pragma: no cover - child
            code = 0
            try:
                os.close(read_end)
                os.kill(child.pid, 0)
                if monitor.find_dead_worker() is not None or monitor.statuses() != []:
                    code = 3
                monitor.register([identity])
                monitor.start()
                monitor.stop()
                monitor.close()  # must not unregister anything from the parent's epoll
                os.write(write_end, b"done")
            except BaseException:
                code = 4
            os._exit(code)
        os.close(write_end)
        _, status = os.waitpid(forked, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert os.read(read_end, 16) == b"done"
        os.close(read_end)
        # The parent's watcher still sees the death.
        os.kill(child.pid, signal.SIGKILL)
        assert rec.wait()
        assert monitor.find_dead_worker() == identity


def _fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_no_fd_leak_across_register_close_cycles(procs: ProcessTracker) -> None:
    children = [procs.sleeper() for _ in range(8)]
    identities = [capture_identity(rank, child.pid) for rank, child in enumerate(children)]
    before = _fd_count()
    for cycle in range(15):
        monitor = WorkerProcessMonitor(d_state_timeout_s=10 if cycle % 2 else None, scan_interval_s=0.01)
        monitor.register(identities)
        if cycle % 3:
            monitor.start()
            assert wait_until(lambda m=monitor: m.watcher_alive, 5)  # type: ignore[misc]
        assert monitor.find_dead_worker() is None
        if cycle % 5 == 4:
            del monitor  # dropped without close(): the finalizer must release everything
            assert wait_until(lambda: _fd_count() == before, 5)
        else:
            monitor.close()
            assert _fd_count() == before
    assert wait_until(lambda: _fd_count() == before, 5)


def test_register_validates_and_replaces(procs: ProcessTracker) -> None:
    a, b = procs.sleeper(), procs.sleeper()
    ident_a = capture_identity(0, a.pid)
    with WorkerProcessMonitor() as monitor:
        with pytest.raises(InvalidIdentityError):
            monitor.register([tuple(ident_a), (1, "x", 1, "h", 1)])
        assert monitor.statuses() == []  # nothing registered from a bad batch
        monitor.register([tuple(ident_a)])
        monitor.register([ident_a])  # same identity: no-op
        assert len(monitor.statuses()) == 1
        ident_b = capture_identity(0, b.pid)
        monitor.register([ident_b])  # rank 0 replaced
        assert monitor.identities == [ident_b]
        os.kill(a.pid, signal.SIGKILL)
        a.wait(10)
        assert monitor.find_dead_worker() is None  # the replaced process is no longer watched
        assert monitor.check() is None


def test_the_method_reads_as_its_plain_name_wherever_it_is_written(procs: ProcessTracker) -> None:
    """The method is an enum, but JSON, ``str()``, f-strings, log lines and ``to_dict()`` read the
    same plain names they always did (``str()`` of a str-mixin enum is ``Class.MEMBER`` on 3.11+)."""
    child = procs.sleeper()
    with WorkerProcessMonitor() as monitor:
        monitor.register([capture_identity(0, child.pid)])
        status = monitor.statuses()[0]
    assert status.method is MonitorMethod.PIDFD
    logged = logging.LogRecord("x", logging.INFO, "", 0, "method %s", (status.method,), None).getMessage()
    assert (str(status.method), f"{status.method}", f"{status.method:>6}", logged) == \
        ("pidfd", "pidfd", " pidfd", "method pidfd")
    assert json.dumps(status.method) == '"pidfd"' and json.loads(json.dumps(status.to_dict()))["method"] == "pidfd"
    assert type(status.to_dict()["method"]) is str and status.method == "pidfd"
    assert [m.value for m in MonitorMethod] == ["pidfd", "procfs", "none", "agent"]
    assert RankStatus(status.identity, status.state, 0.0, 0.0, "agent").method is MonitorMethod.AGENT  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        RankStatus(status.identity, status.state, 0.0, 0.0, "ptrace")  # type: ignore[arg-type]


def test_a_remote_report_cannot_make_a_rank_a_signal_target() -> None:
    """A report about another host's rank is hearsay: shown ``via`` a method that observes on this
    host (pidfd, procfs), that rank's pid (another host's number) would be a signal target here."""
    remote = ProcessIdentity(4, os.getpid(), start_time_or_none(os.getpid()), "fakehostB", 1)
    with WorkerProcessMonitor() as monitor:
        for via in ("pidfd", MonitorMethod.PROCFS, "ptrace"):
            with pytest.raises(ValueError):
                monitor.apply_remote_many([(remote, WorkerState.ALIVE, "hearsay")], via=via)
        assert monitor.statuses() == [] and monitor.verified_identities() == []
        assert monitor.apply_remote_many([(remote, WorkerState.ALIVE, "ok")], via="agent") == 1
        assert monitor.statuses()[0].method is MonitorMethod.AGENT and monitor.verified_identities() == []
