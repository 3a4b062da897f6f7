"""procfs parsing: hostile comm values (real and fake trees), thread states, pending SIGKILL."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import threading
import traceback
from pathlib import Path

import pytest

from tests.support.process_tracker import ProcessTracker
from tests.support.stuck_processes import StuckChild
from tests.support.waits import wait_until
from trtllm_liveness import EventKind, WorkerEvent
from trtllm_liveness.monitor import WorkerProcessMonitor
from trtllm_liveness.process import _procfs, capture_identity
from trtllm_liveness.process._thread_sampler import ThreadSampler, sample_d_state

pytestmark = [pytest.mark.real_process, pytest.mark.timeout(60)]

HOSTILE_COMM = "a) b (c) d"

# Renames itself through /proc/self/comm (what prctl(PR_SET_NAME) does), then says ready.
RENAMER = f"""
import sys, time
with open("/proc/self/comm", "w") as handle:
    handle.write({HOSTILE_COMM!r})
sys.stdout.write("ready\\n"); sys.stdout.flush()
time.sleep(3600)
"""


def _stat_line(pid: int, comm: str, state: str, start_time: int, threads: int = 1) -> bytes:
    # Fields 3..52 of proc(5); only state (3), num_threads (20) and starttime (22) matter here.
    after = [state, "1", str(pid), str(pid)] + ["0"] * 15 + [str(start_time)] + ["0"] * 30
    after[17] = str(threads)
    return f"{pid} ({comm}) {' '.join(after)}\n".encode()


def test_parse_stat_survives_hostile_comm() -> None:
    info = _procfs.parse_stat(_stat_line(77, HOSTILE_COMM, "S", 987654, threads=3))
    assert info.pid == 77 and info.comm == HOSTILE_COMM and info.state == "S"
    assert info.start_time == 987654
    threads = _stat_line(77, "x) R 1 2 (y", "D", 5, threads=4)
    assert _procfs.parse_state_and(threads, _procfs.NUM_THREADS_INDEX) == ("D", 4)
    assert _procfs.thread_state_of(_stat_line(77, ") ) )", "Z", 5)) == "Z"
    assert _procfs.parse_state_and(_stat_line(77, "x) Z 1 2 (y", "S", 987654), _procfs.STARTTIME_INDEX) == ("S", 987654)


@pytest.mark.parametrize("data", [b"", b"garbage", b"12 (comm", b"12 (comm) S 1 2"])
def test_parse_stat_rejects_malformed_content(data: bytes) -> None:
    with pytest.raises(ValueError):
        _procfs.parse_stat(data)
    with pytest.raises(ValueError):
        _procfs.parse_state_and(data, _procfs.STARTTIME_INDEX)
    assert _procfs.thread_state_of(data) in ("", "S")


def test_real_process_with_hostile_comm_is_parsed_and_monitored(procs: ProcessTracker) -> None:
    proc = subprocess.Popen([sys.executable, "-c", RENAMER], stdout=subprocess.PIPE, start_new_session=True)
    procs.popens.append(proc)
    procs.track(proc.pid)
    assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
    info = _procfs.read_stat(proc.pid)
    assert info.comm == HOSTILE_COMM
    assert info.state in ("S", "R")
    assert info.ppid == os.getpid()
    identity = capture_identity(5, proc.pid)
    assert identity.start_time == info.start_time
    got = threading.Event()
    events: list[WorkerEvent] = []
    with WorkerProcessMonitor(d_state_timeout_s=30, scan_interval_s=0.05) as monitor:
        monitor.subscribe(lambda e: (events.append(e), got.set()))
        monitor.register([identity])
        monitor.start()
        assert monitor.find_dead_worker() is None
        os.kill(proc.pid, signal.SIGKILL)
        assert got.wait(10)
    assert events[0].kind is EventKind.DIED and events[0].identity == identity


def test_thread_states_and_pending_signals_of_a_real_process(procs: ProcessTracker) -> None:
    code = (
        "import threading, time\n"
        "for _ in range(3): threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code + "print('ready', flush=True); time.sleep(3600)"],
                            stdout=subprocess.PIPE, start_new_session=True)
    procs.popens.append(proc)
    procs.track(proc.pid)
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
    states = _procfs.read_thread_states(proc.pid)
    assert proc.pid in states and len(states) == 4
    assert set(states.values()) <= {"S", "R"}
    assert _procfs.parse_state_and(_procfs.read_stat_bytes(proc.pid, proc.pid), _procfs.NUM_THREADS_INDEX)[1] == 4
    assert sample_d_state(proc.pid) is None
    sampler = ThreadSampler(proc.pid, capture_identity(0, proc.pid).start_time)
    assert sampler.sample() is None
    assert sampler.sample() is None  # second call reads through the kept fd and cached thread list
    sampler.close()
    with pytest.raises(ProcessLookupError):
        sampler.sample()
    assert _procfs.sigkill_pending(proc.pid) is False
    assert _procfs.read_wchan(proc.pid) != "0"
    assert _procfs.pid_namespace_inode(proc.pid) == _procfs.pid_namespace_inode("self")


# Keeps about ``n`` short-lived threads alive, each replaced as it ends (the thread list churns
# under the sampler: same count, other tids); "ready" once the first ones run.
CHURNER = """
import random, sys, threading, time
def short():
    time.sleep(random.uniform(0.0005, 0.004))
    threading.Thread(target=short, daemon=True).start()
for _ in range(int(sys.argv[1])):
    threading.Thread(target=short, daemon=True).start()
sys.stdout.write("ready\\n"); sys.stdout.flush()
time.sleep(3600)
"""


def _churner(procs: ProcessTracker, threads: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-c", CHURNER, str(threads)], stdout=subprocess.PIPE,
                            start_new_session=True)
    procs.popens.append(proc)
    procs.track(proc.pid)
    assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
    return proc


def _kept_thread_stat_fds(pid: int) -> set[int]:
    """The tids whose ``/proc/<pid>/task/<tid>/stat`` this process holds open."""
    kept = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        parts = target.split("/")
        if len(parts) == 6 and parts[2] == str(pid) and parts[3] == "task" and parts[5] == "stat":
            kept.add(int(parts[4]))
    return kept


def test_sampler_keeps_one_fd_per_live_thread_within_the_budget(
        procs: ProcessTracker, monkeypatch: pytest.MonkeyPatch) -> None:
    from trtllm_liveness.process import _thread_sampler

    budget = _thread_sampler._FdBudget(3)
    monkeypatch.setattr(_thread_sampler, "_budget", budget)
    code = ("import sys, threading\n"
            "done = threading.Event()\n"
            "threads = [threading.Thread(target=done.wait) for _ in range(5)]\n"
            "for t in threads: t.start()\n"
            "print('ready', flush=True); sys.stdin.readline(); done.set()\n"
            "for t in threads: t.join()\n"
            "print('alone', flush=True); sys.stdin.readline()\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            start_new_session=True)
    procs.popens.append(proc)
    procs.track(proc.pid)
    assert proc.stdin is not None and proc.stdout is not None
    assert proc.stdout.readline().strip() == b"ready"
    fds_before = set(os.listdir("/proc/self/fd"))
    sampler = ThreadSampler(proc.pid, capture_identity(0, proc.pid).start_time)
    others = set(_procfs.list_tids(proc.pid)) - {proc.pid}
    for _ in range(3):
        assert sampler.sample() is None
        kept = _kept_thread_stat_fds(proc.pid)
        assert len(kept) == 3 and kept <= others  # the budget's 3; the other 2 threads read by path
        assert budget.used == 3
    proc.stdin.write(b"go\n")
    proc.stdin.flush()
    assert proc.stdout.readline().strip() == b"alone"
    # join() returns when a thread's Python part is done; the kernel may list it a moment longer.
    assert wait_until(lambda: _procfs.list_tids(proc.pid) == [proc.pid], 10)
    assert sampler.sample() is None  # down to the main thread: the others' fds are given back
    assert _kept_thread_stat_fds(proc.pid) == set() and budget.used == 0
    sampler.close()
    sampler.close()
    assert budget.used == 0 and set(os.listdir("/proc/self/fd")) == fds_before
    proc.stdin.close()


def test_budget_is_an_eighth_of_the_descriptor_limit_at_most(monkeypatch: pytest.MonkeyPatch) -> None:
    import resource

    from trtllm_liveness.process import _thread_sampler

    budget = _thread_sampler._FdBudget(1024)
    monkeypatch.setattr(resource, "getrlimit", lambda which: (256, 4096))
    assert budget.limit() == 32
    assert all(budget.claim() for _ in range(32)) and not budget.claim()
    budget.release(32)
    monkeypatch.setattr(resource, "getrlimit", lambda which: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    assert budget.limit() == 1024 and budget.used == 0


def _sample_while_closing(pid: int, start_time: int, round_no: int) -> int:
    """One sampler: one thread samples until the sampler is closed, three close it at once."""
    from trtllm_liveness.process import _thread_sampler

    used_before = _thread_sampler._budget.used  # the test preloads it: a double release shows
    fds_before = set(os.listdir("/proc/self/fd"))
    sampler = ThreadSampler(pid, start_time)
    errors: list[str] = []
    samples = [0]

    def sample_until_closed() -> None:
        try:
            while True:
                # A thread passes through D as it ends, and may be gone before its wait channel
                # is read: a sample, never an error.
                sample = sampler.sample()
                assert sample is None or pid not in sample.d_tids
                samples[0] += 1
                # Every fd kept is a thread that was listed: none of a thread long gone piles up.
                assert len(_kept_thread_stat_fds(pid)) <= 64
        except ProcessLookupError:
            if not sampler._closed:  # the sampled process is alive: only the close may end this
                errors.append(traceback.format_exc())
        except BaseException:
            errors.append(traceback.format_exc())  # reported by the assertion below

    barrier = threading.Barrier(4, timeout=30)

    def closer() -> None:
        barrier.wait()
        threading.Event().wait(0.001 * (round_no % 7))
        sampler.close()

    sampling = threading.Thread(target=sample_until_closed)
    closers = [threading.Thread(target=closer) for _ in range(3)]
    sampling.start()
    for thread in closers:
        thread.start()
    threading.Event().wait(0.002 * (round_no % 5))
    barrier.wait()
    for thread in [*closers, sampling]:
        thread.join(30)
    assert not any(thread.is_alive() for thread in [*closers, sampling])
    assert not errors, errors[0]
    assert _thread_sampler._budget.used == used_before  # every kept fd given back, once
    assert set(os.listdir("/proc/self/fd")) == fds_before
    return samples[0]


def test_sampler_follows_churning_threads_and_close_races_sample(
        procs: ProcessTracker, monkeypatch: pytest.MonkeyPatch) -> None:
    from trtllm_liveness.process import _thread_sampler

    budget = _thread_sampler._FdBudget(1024)
    budget.used = 5  # other samplers' fds: a release too many would show below
    monkeypatch.setattr(_thread_sampler, "_budget", budget)
    proc = _churner(procs, 6)
    start_time = capture_identity(0, proc.pid).start_time
    # Each round compares this process's fds before and after: an earlier test's object that the
    # cyclic collector finalises during a round (a pipe, a file) would close an fd that is not the
    # sampler's. Collected first, and no collection while the rounds run.
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        total_samples = sum(_sample_while_closing(proc.pid, start_time, round_no) for round_no in range(20))
    finally:
        if was_enabled:
            gc.enable()
    assert total_samples > 0 and proc.poll() is None


def test_sampler_of_reused_pid_reports_gone(procs: ProcessTracker) -> None:
    child = procs.sleeper()
    start = capture_identity(0, child.pid).start_time
    with pytest.raises(ProcessLookupError):
        ThreadSampler(child.pid, start + 1).sample()  # wrong start time: not the registered process


def test_signal_masks_and_wait_status() -> None:
    data = b"Name:\tx\nSigPnd:\t0000000000000000\nShdPnd:\t0000000000000100\nSigBlk:\t0\n"
    status = _procfs.parse_status(data)
    assert (status.pending, status.shared_pending) == (0, 0x100)
    assert _procfs.describe_wait_status(signal.SIGKILL) == "killed by SIGKILL"
    assert _procfs.describe_wait_status(3 << 8) == "exit code 3"


@pytest.fixture
def fake_proc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(_procfs, "PROCFS_PATH", str(tmp_path))
    return tmp_path


def _make_task(root: Path, pid: int, tid: int, comm: str, state: str, threads: int, pending: int = 0) -> None:
    task = root / str(pid) / "task" / str(tid)
    task.mkdir(parents=True, exist_ok=True)
    (task / "stat").write_bytes(_stat_line(tid, comm, state, 4000, threads))
    (task / "status").write_text(f"SigPnd:\t{pending:016x}\nShdPnd:\t0000000000000000\n")
    (task / "wchan").write_text("__refrigerator" if state == "D" else "0")


def _vanish(root: Path, pid: int, tid: int) -> None:
    """A thread leaves the fake tree as it leaves procfs: a ``stat`` fd kept open on it reads
    nothing from then on (procfs fails such a read with ESRCH), and its directory is gone."""
    import shutil

    (root / str(pid) / "task" / str(tid) / "stat").write_bytes(b"")
    shutil.rmtree(root / str(pid) / "task" / str(tid))


def test_fake_tree_d_thread_that_is_not_the_main_thread(fake_proc: Path) -> None:
    pid = 4242
    _make_task(fake_proc, pid, pid, HOSTILE_COMM, "S", 2)
    _make_task(fake_proc, pid, 4243, "nccl) (D", "D", 2, pending=0x100)
    (fake_proc / str(pid) / "stat").write_bytes(_stat_line(pid, HOSTILE_COMM, "S", 4000, 2))
    (fake_proc / str(pid) / "status").write_text("SigPnd:\t0\nShdPnd:\t0\n")
    sample = sample_d_state(pid)
    assert sample is not None
    assert sample.d_tids == (4243,) and sample.kill_pending and sample.wchan == "__refrigerator"
    sampler = ThreadSampler(pid, 4000)
    first = sampler.sample()
    assert first is not None and first.d_tids == (4243,)
    # A thread appears (count changes) and the old helper vanishes: the cache must follow.
    _vanish(fake_proc, pid, 4243)
    _make_task(fake_proc, pid, 4250, "late", "D", 3)
    _make_task(fake_proc, pid, 4251, "late2", "S", 3)
    (fake_proc / str(pid) / "stat").write_bytes(_stat_line(pid, HOSTILE_COMM, "S", 4000, 3))
    second = sampler.sample()
    assert second is not None and second.d_tids == (4250,) and not second.kill_pending
    # Same count, different thread (one vanished, one appeared): a failed read forces a relisting.
    _vanish(fake_proc, pid, 4250)
    _make_task(fake_proc, pid, 4260, "swap", "D", 3)
    third = sampler.sample()
    assert third is not None and third.d_tids == (4260,)
    sampler.close()


def test_fake_tree_d_thread_gone_before_its_wait_channel_is_read(fake_proc: Path) -> None:
    pid = 4270
    _make_task(fake_proc, pid, pid, "w", "S", 3)
    _make_task(fake_proc, pid, 4271, "exiting", "D", 3)
    _make_task(fake_proc, pid, 4272, "nccl", "D", 3)
    (fake_proc / str(pid) / "stat").write_bytes(_stat_line(pid, "w", "S", 4000, 3))
    (fake_proc / str(pid) / "status").write_text("SigPnd:\t0\nShdPnd:\t0\n")
    (fake_proc / str(pid) / "task" / "4271" / "wchan").unlink()  # ended between its stat and wchan reads
    sample = ThreadSampler(pid, 4000).sample()
    assert sample is not None and sample.d_tids == (4271, 4272) and sample.wchan == "__refrigerator"
    (fake_proc / str(pid) / "task" / "4272" / "wchan").unlink()
    sample = sample_d_state(pid)
    assert sample is not None and sample.d_tids == (4271, 4272) and sample.wchan == ""


def test_fake_tree_malformed_stat_raises_value_error_not_crash(fake_proc: Path) -> None:
    (fake_proc / "99" / "task" / "99").mkdir(parents=True)
    (fake_proc / "99" / "stat").write_bytes(b"99 (oops")
    (fake_proc / "99" / "task" / "99" / "stat").write_bytes(b"99 (oops")
    with pytest.raises(ValueError):
        _procfs.read_stat(99)
    fds_before = len(os.listdir("/proc/self/fd"))
    for _ in range(5):
        with pytest.raises(ValueError):
            ThreadSampler(99, 1).sample()
    assert len(os.listdir("/proc/self/fd")) == fds_before  # the stat fd is closed on a bad parse
    assert _procfs.read_thread_states(99) == {}


def test_fake_tree_sampler_without_a_kept_fd_still_checks_start_time(
    fake_proc: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pid = 4300
    _make_task(fake_proc, pid, pid, "w", "D", 1)
    (fake_proc / str(pid) / "stat").write_bytes(_stat_line(pid, "w", "D", 4000, 1))
    (fake_proc / str(pid) / "status").write_text("SigPnd:\t0\nShdPnd:\t0\n")

    def out_of_fds(pid: int) -> int:
        raise OSError(24, "Too many open files")  # EMFILE: the sampler reads without keeping an fd

    monkeypatch.setattr(_procfs, "open_stat", out_of_fds)
    sample = ThreadSampler(pid, 4000).sample()
    assert sample is not None and sample.d_tids == (pid,)
    with pytest.raises(ProcessLookupError):
        ThreadSampler(pid, 3999).sample()  # another process now has this pid: never sampled as ours


def test_parse_status_context_switches() -> None:
    data = (b"Name:\tx\nSigPnd:\t0000000000000000\nShdPnd:\t0000000000000100\n"
            b"voluntary_ctxt_switches:\t40\nnonvoluntary_ctxt_switches:\t2\n")
    info = _procfs.parse_status(data)
    assert info.context_switches == 42 and info.sigkill_pending
    assert _procfs.parse_status(b"SigPnd:\t0\nShdPnd:\t0\n").context_switches is None  # not shown: unknown
    assert not _procfs.parse_status(b"SigPnd:\t0\nShdPnd:\t0\n").sigkill_pending


def test_fake_tree_status_is_read_only_for_threads_in_d(fake_proc: Path) -> None:
    """The healthy path reads no ``status`` at all; a D sample reads each D thread's once, which
    gives both its switch count and its SIGKILL bits."""
    pid = 4400
    _make_task(fake_proc, pid, pid, "w", "S", 3)
    _make_task(fake_proc, pid, 4401, "loader", "S", 3)
    _make_task(fake_proc, pid, 4402, "nccl", "S", 3)
    (fake_proc / str(pid) / "stat").write_bytes(_stat_line(pid, "w", "S", 4000, 3))
    for tid in (pid, 4401, 4402):  # no status file anywhere: reading one would raise
        (fake_proc / str(pid) / "task" / str(tid) / "status").unlink()
    sampler = ThreadSampler(pid, 4000)
    assert sampler.sample() is None and sample_d_state(pid) is None
    (fake_proc / str(pid) / "task" / "4402" / "stat").write_bytes(_stat_line(4402, "nccl", "D", 4000, 3))
    (fake_proc / str(pid) / "task" / "4402" / "status").write_text(
        "SigPnd:\t0000000000000000\nShdPnd:\t0000000000000100\n"
        "voluntary_ctxt_switches:\t7\nnonvoluntary_ctxt_switches:\t3\n")
    for sample in (sampler.sample(), sample_d_state(pid)):
        assert sample is not None and sample.d_tids == (4402,) and sample.switches == (10,)
        assert sample.kill_pending and sample.switches_of(4402) == 10 and sample.switches_of(4401) is None
    # A thread in D whose status is gone by the time it is read (it ended): no count, no error.
    (fake_proc / str(pid) / "task" / "4401" / "stat").write_bytes(_stat_line(4401, "loader", "D", 4000, 3))
    sample = sampler.sample()
    assert sample is not None and sample.d_tids == (4401, 4402) and sample.switches == (None, 10)
    sampler.close()


def test_d_sample_of_a_real_stuck_thread_carries_its_unchanged_switch_count_and_keeps_no_more_fds(
    procs: ProcessTracker, stuck_child: StuckChild
) -> None:
    child = stuck_child.popen
    assert wait_until(lambda: _procfs.read_stat(child.pid).state == "D", 10)
    fds_before = len(os.listdir("/proc/self/fd"))
    sampler = ThreadSampler(child.pid, capture_identity(0, child.pid).start_time)
    try:
        first = sampler.sample()
        second = sampler.sample()
        # The one kept fd is the process's stat (one thread): the status reads are by path.
        assert len(os.listdir("/proc/self/fd")) == fds_before + 1
        assert first is not None and second is not None and first.d_tids == second.d_tids == (child.pid,)
        assert first.switches[0] is not None and first.switches == second.switches
        assert second.held_since(first) == (child.pid,) and not first.kill_pending
        assert first.switches[0] == _procfs.read_status(child.pid, child.pid).context_switches
    finally:
        sampler.close()
