"""Stacks without ptrace (trtllm_liveness.diagnose._faulthandler_stacks): a rank registers its own
faulthandler dump; the snapshot signals it through a verified pidfd and reads the dump. py-spy is
made to really fail (not installed; a non-dumpable rank read without CAP_SYS_PTRACE) and the stacks
still come back, with their source; stopped and frozen ranks are reported, never waited on."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.facilities import needs
from tests.support.fuse_stall import FuseStall
from tests.support.leftovers import remove_gone_dump_files
from tests.support.process_tracker import ProcessTracker
from tests.support.stuck_processes import Freezer, StuckChild
from tests.support.waits import WAIT_SCALE, wait_until
from trtllm_liveness.diagnose import _diagnosis
from trtllm_liveness.diagnose._faulthandler_stacks import (
    dump_directory,
    parse_faulthandler_dump,
    take_faulthandler_stacks,
)
from trtllm_liveness.diagnose._stack_records import StackSource, StackStatus
from trtllm_liveness.process import _procfs
from trtllm_liveness.process._identity import capture_identity

pytestmark = [pytest.mark.timeout(120), pytest.mark.real_process]

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(autouse=True)
def _dump_files_of_killed_ranks_removed(procs: ProcessTracker) -> Iterator[None]:
    """After ``procs`` ended this test's ranks (by SIGKILL: their exit handlers never ran)."""
    yield
    procs.cleanup()
    for proc in procs.popens:
        if proc.stdin is not None:
            proc.stdin.close()
    remove_gone_dump_files()
NO_PTRACE = ["setpriv", "--bounding-set", "-sys_ptrace", "--inh-caps", "-sys_ptrace"]


def _rank(procs: ProcessTracker, *flags: str, prefix: tuple[str, ...] = ()) -> tuple[subprocess.Popen[bytes], str]:
    proc = subprocess.Popen([*prefix, sys.executable, "-m", "tests.programs.stack_dump_rank", *flags], cwd=REPO,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
    procs.popens.append(proc)
    procs.track(proc.pid)
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    assert line.startswith("ready "), line
    # After "ready" the main thread's only sleep is the stdin read.
    assert wait_until(lambda: _procfs.read_stat(proc.pid).state == "S", 10)
    return proc, line.split(" ", 1)[1].strip()


def _order(proc: subprocess.Popen[bytes], order: str) -> None:
    assert proc.stdin is not None
    proc.stdin.write(order.encode() + b"\n")
    proc.stdin.flush()


def _start(pid: int) -> int:
    return _procfs.read_start_time(pid)


def _dump_signal(path: str) -> int:
    header = Path(path).read_bytes().split(b"\n", 1)[0].decode()
    return int(header.split("signal=")[1].split()[0])


def _pending(pid: int, signum: int) -> bool:
    status = _procfs.read_status(pid)
    return bool((status.pending | status.shared_pending) & _procfs.signal_bit(signum))


def test_the_dump_names_every_thread_and_the_main_thread_by_its_pid(procs: ProcessTracker) -> None:
    proc, path = _rank(procs)
    st = os.stat(path)
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    assert os.path.dirname(path) == dump_directory()

    result = take_faulthandler_stacks([(proc.pid, _start(proc.pid))], timeout_s=10 * WAIT_SCALE)[proc.pid]
    assert result.status is StackStatus.TAKEN and result.source is StackSource.FAULTHANDLER, result
    main = result.main_thread(proc.pid)
    assert main is not None and main.tid == proc.pid and main.name == "MainThread"
    assert main.stuck_in is not None and main.stuck_in.function == "wait_for_a_peer_that_never_comes"
    helpers = [thread for thread in result.threads if thread is not main]
    assert [thread.stuck_in.function for thread in helpers if thread.stuck_in] == ["helper_waits_for_work"]
    # The handler ran inside the rank and returned: it is still there, waiting where it was.
    assert proc.poll() is None and _procfs.read_stat(proc.pid).state == "S"
    again = take_faulthandler_stacks([(proc.pid, _start(proc.pid))], timeout_s=10 * WAIT_SCALE)[proc.pid]
    assert again.status is StackStatus.TAKEN and len(again.threads) == len(result.threads)


def test_a_rank_without_the_hook_is_never_signalled(procs: ProcessTracker) -> None:
    # An unhandled real-time signal would end it: no registration, no signal.
    proc, path = _rank(procs, "--no-register")
    assert path == "-"
    result = take_faulthandler_stacks([(proc.pid, _start(proc.pid))], timeout_s=10 * WAIT_SCALE)[proc.pid]
    assert result.status is StackStatus.NOT_REGISTERED, result
    assert proc.poll() is None


def test_a_wrong_start_time_finds_no_dump_and_sends_nothing(procs: ProcessTracker) -> None:
    proc, path = _rank(procs)
    size = os.path.getsize(path)
    result = take_faulthandler_stacks([(proc.pid, _start(proc.pid) + 1)], timeout_s=10 * WAIT_SCALE)[proc.pid]
    assert result.status is StackStatus.NOT_REGISTERED, result
    assert os.path.getsize(path) == size and not _pending(proc.pid, _dump_signal(path))


def _snapshot_in_child(procs: ProcessTracker, pid: int, *, argv_prefix: list[str], interpreter: str,
                       env: dict[str, str]) -> dict[str, object]:
    child = subprocess.Popen([*argv_prefix, interpreter, "-m", "tests.programs.stacks_snapshot", str(pid),
                              str(_start(pid))], cwd=REPO, env=env, stdout=subprocess.PIPE, start_new_session=True)
    procs.popens.append(child)
    procs.track(child.pid)
    out, _ = child.communicate(timeout=60 * WAIT_SCALE)
    assert child.returncode == 0, out
    data: dict[str, object] = json.loads(out)
    return data


@needs("py-spy")
def test_without_py_spy_installed_the_stacks_come_from_the_rank_and_say_so(procs: ProcessTracker) -> None:
    proc, _path = _rank(procs)
    # The base interpreter (py-spy lives only in the venv) and a PATH without it: find_py_spy finds nothing.
    env = {**os.environ, "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    base = getattr(sys, "_base_executable", sys.executable)
    data = _snapshot_in_child(procs, proc.pid, argv_prefix=[], interpreter=base, env=env)
    assert data["py_spy"] is None and data["py_spy_direct"] is None, data
    stacks = data["diagnosis"]
    assert isinstance(stacks, dict)
    assert stacks["status"] == "taken" and stacks["source"] == "faulthandler", stacks
    assert stacks["other_source"] == "py-spy is not installed"
    assert data["stuck_in"] == "wait_for_a_peer_that_never_comes"


@needs("py-spy")
def test_a_non_dumpable_rank_read_without_cap_sys_ptrace_gets_stacks_from_its_dump(procs: ProcessTracker) -> None:
    # Both the rank and the snapshot run without CAP_SYS_PTRACE (a Kubernetes pod's default); the
    # rank is non-dumpable, so the kernel refuses py-spy even to the same user (root here).
    proc, _path = _rank(procs, "--not-dumpable", prefix=tuple(NO_PTRACE))
    assert not _procfs.read_status(proc.pid).cap_effective & (1 << 19)  # CAP_SYS_PTRACE
    data = _snapshot_in_child(procs, proc.pid, argv_prefix=NO_PTRACE, interpreter=sys.executable,
                              env=dict(os.environ))
    direct = data["py_spy_direct"]
    assert isinstance(direct, dict) and direct["status"] == "failed", data  # py-spy really ran and failed
    stacks = data["diagnosis"]
    assert isinstance(stacks, dict)
    assert stacks["status"] == "taken" and stacks["source"] == "faulthandler", stacks
    assert str(stacks["other_source"]).startswith("py-spy failed: "), stacks
    assert data["stuck_in"] == "wait_for_a_peer_that_never_comes"


def test_a_rank_with_capabilities_the_reader_lacks_is_not_given_to_py_spy(procs: ProcessTracker) -> None:
    proc, _path = _rank(procs)  # full capabilities
    data = _snapshot_in_child(procs, proc.pid, argv_prefix=NO_PTRACE, interpreter=sys.executable,
                              env=dict(os.environ))
    permitted, why = data["ptrace_access"]  # type: ignore[misc]
    assert permitted is False and "capabilities" in why
    stacks = data["diagnosis"]
    assert isinstance(stacks, dict) and stacks["status"] == "taken" and stacks["source"] == "faulthandler"
    assert "py-spy not permitted" in str(stacks["other_source"])


@pytest.mark.timeout(30)
def test_a_stopped_rank_is_reported_and_never_signalled(procs: ProcessTracker) -> None:
    proc, path = _rank(procs)
    size = os.path.getsize(path)
    proc.send_signal(signal.SIGSTOP)  # our own unreaped child
    assert wait_until(lambda: _procfs.read_stat(proc.pid).state == "T", 10)
    # A deadline past this test's own timeout: waiting on the stopped rank would fail the test.
    result = take_faulthandler_stacks([(proc.pid, _start(proc.pid))], timeout_s=600)[proc.pid]
    assert result.status is StackStatus.SKIPPED_STOPPED and "not signalled" in result.detail, result
    assert not _pending(proc.pid, _dump_signal(path))
    proc.send_signal(signal.SIGCONT)
    assert wait_until(lambda: _procfs.read_stat(proc.pid).state == "S", 10)
    assert os.path.getsize(path) == size  # nothing was queued for it to dump once continued


@pytest.mark.timeout(60)
@pytest.mark.freezer
def test_a_frozen_registered_rank_is_reported_in_d_and_never_signalled(
        procs: ProcessTracker, freezer: Freezer) -> None:
    proc, path = _rank(procs)
    freezer.add(proc.pid)
    assert freezer.freeze()
    try:
        result = take_faulthandler_stacks([(proc.pid, _start(proc.pid))], timeout_s=600)[proc.pid]
        assert result.status is StackStatus.SKIPPED_TASK_IN_D and "not signalled" in result.detail, result
        assert not _pending(proc.pid, _dump_signal(path))
    finally:
        freezer.thaw()


@pytest.mark.timeout(60)
def test_a_stuck_rank_of_either_d_source_is_reported_without_waiting(stuck_child: StuckChild) -> None:
    pid = stuck_child.popen.pid
    diagnosis = _diagnosis.diagnose([capture_identity(0, pid)], window_s=0.0, cpu_window_s=0.0,
                                    stacks_source="faulthandler", stacks_timeout_s=600)
    (rank,) = diagnosis.ranks
    assert rank.stacks is not None and rank.stacks.status is StackStatus.SKIPPED_TASK_IN_D, rank.stacks
    assert rank.stacks.source is StackSource.FAULTHANDLER


@pytest.mark.timeout(60)
@pytest.mark.fuse
def test_a_registered_rank_whose_main_thread_is_in_fuse_d_is_not_signalled(
        procs: ProcessTracker, fuse_stall: FuseStall) -> None:
    proc, path = _rank(procs)
    _order(proc, f"stat {fuse_stall.new_path()}")
    assert fuse_stall.wait_held(proc.pid, 10 * WAIT_SCALE)
    result = take_faulthandler_stacks([(proc.pid, _start(proc.pid))], timeout_s=600)[proc.pid]
    assert result.status is StackStatus.SKIPPED_TASK_IN_D, result
    assert not _pending(proc.pid, _dump_signal(path))


@pytest.mark.timeout(60)
@pytest.mark.fuse
def test_a_helper_thread_in_d_leaves_py_spy_out_and_the_dump_still_comes(
        procs: ProcessTracker, fuse_stall: FuseStall) -> None:
    # A driver or NCCL thread wedged while the main thread waits: py-spy could hang on the mm lock,
    # the rank's own handler runs on the main thread.
    proc, _path = _rank(procs)
    _order(proc, f"thread-stat {fuse_stall.new_path()}")
    assert wait_until(lambda: any(state == "D" for state in _procfs.read_thread_states(proc.pid).values()), 10)
    diagnosis = _diagnosis.diagnose([capture_identity(0, proc.pid)], window_s=0.0, cpu_window_s=0.0,
                                    stacks_timeout_s=10 * WAIT_SCALE)
    (rank,) = diagnosis.ranks
    assert rank.stacks is not None and rank.stacks.status is StackStatus.TAKEN, rank.stacks
    assert rank.stacks.source is StackSource.FAULTHANDLER and "a thread is in D" in rank.stacks.other_source
    assert rank.stuck_in is not None and rank.stuck_in.function == "wait_for_a_peer_that_never_comes"


def test_the_registration_removes_files_of_gone_processes(procs: ProcessTracker) -> None:
    first, first_path = _rank(procs)
    first.kill()  # SIGKILL: its exit handler never runs
    first.wait(10)
    assert os.path.exists(first_path)
    _second, second_path = _rank(procs)
    assert not os.path.exists(first_path) and os.path.exists(second_path)


def test_a_clean_exit_removes_the_file(procs: ProcessTracker) -> None:
    proc, path = _rank(procs)
    assert proc.stdin is not None
    proc.stdin.close()  # the order loop ends, the interpreter exits normally
    assert proc.wait(10) == 0
    assert not os.path.exists(path)


DUMP = """\
Thread 0x00007f0000000002 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 327 in wait
  File "/srv/app/worker.py", line 12 in helper_loop

Current thread 0x00007f0000000001 (most recent call first):
  File "/srv/app/worker.py", line 40 in wait_for_peer
  File ???, line ??? in ???
  <no Python frame>
Thread 0x00007f0000000002 (most recent call first):
  File "/srv/app/worker.py", line 99 in second_dump_not_read
"""


def test_the_text_dump_is_parsed_up_to_the_next_dump() -> None:
    threads = parse_faulthandler_dump(DUMP, main_ident=0x7F0000000001, pid=4242)
    assert [(thread.tid, thread.name) for thread in threads] == [(None, ""), (4242, "MainThread")]
    assert [frame.function for frame in threads[0].frames] == ["wait", "helper_loop"]
    assert threads[0].stuck_in is not None and threads[0].stuck_in.function == "helper_loop"
    assert [(frame.function, frame.file, frame.line) for frame in threads[1].frames] == [
        ("wait_for_peer", "/srv/app/worker.py", 40), ("???", "???", 0)]
    assert parse_faulthandler_dump("") == ()


def test_many_ranks_are_signalled_together_under_one_deadline(procs: ProcessTracker) -> None:
    ranks = [_rank(procs)[0] for _ in range(4)]
    results = take_faulthandler_stacks([(proc.pid, _start(proc.pid)) for proc in ranks], timeout_s=10 * WAIT_SCALE)
    assert all(results[proc.pid].status is StackStatus.TAKEN for proc in ranks), results


def test_snapshots_of_one_rank_at_once_each_read_a_whole_dump(procs: ProcessTracker) -> None:
    """Three snapshots of the same rank (the engine's and a scan's) race: each must read a complete
    dump of every thread. Half the rounds start with a dump file past the size at which a reader
    truncates it first (an older run's dumps, appended here to the rank's own file): a reader that
    truncates while the other reads its dump, or reads from the middle of the other's, loses
    threads or the whole dump."""
    import threading

    proc, path = _rank(procs)
    _order(proc, "threads 60")  # a long dump: the window in which the other reader acts is wide
    assert proc.stdout is not None and proc.stdout.readline().decode().strip() == "threads 60"
    start_time = _start(proc.pid)
    solo = take_faulthandler_stacks([(proc.pid, start_time)], timeout_s=10 * WAIT_SCALE)[proc.pid]
    assert solo.status is StackStatus.TAKEN
    from trtllm_liveness.diagnose._faulthandler_stacks import TRUNCATE_AT

    for round_number in range(16):
        if round_number % 2:
            with open(path, "ab") as dump:  # the rank's file: 0600, ours
                dump.write(b"#" * (TRUNCATE_AT + 1))
        barrier = threading.Barrier(3, timeout=10 * WAIT_SCALE)
        results: list[object] = []

        def snapshot(barrier: threading.Barrier, results: list[object]) -> None:
            barrier.wait()
            results.append(take_faulthandler_stacks([(proc.pid, start_time)], timeout_s=10 * WAIT_SCALE)[proc.pid])

        threads = [threading.Thread(target=snapshot, args=(barrier, results)) for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30 * WAIT_SCALE)
        assert len(results) == 3, f"round {round_number}: a snapshot never returned"
        for result in results:
            assert getattr(result, "status", None) is StackStatus.TAKEN, (round_number, result)
            assert len(getattr(result, "threads", ())) == len(solo.threads), (round_number, result)
