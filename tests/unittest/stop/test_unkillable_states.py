"""Unkillable in any state (trtllm_liveness.stop._survivor and the stop's report): a process still
there after the kill grace with SIGKILL pending is unkillable whether it sleeps in D or runs in the
kernel in R; the report says the state, the wait channel and the kernel stack. Real D comes from
the freezer and FUSE; the R and exiting cases from a fake /proc tree (procfs is read through
PROCFS_PATH on every call); a SIGKILL pending during the kill grace is no verdict."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest

from tests.support.fake_procfs import SIGKILL_PENDING, SPIN_STACK, fake_process
from tests.support.fuse_stall import FuseStall
from tests.support.process_tracker import ProcessTracker, state_of
from tests.support.stuck_processes import StuckChild
from tests.support.waits import wait_until
from trtllm_liveness.process import _procfs
from trtllm_liveness.process._identity import capture_identity, local_hostname
from trtllm_liveness.stop._bounded_stop import stop_processes
from trtllm_liveness.stop._stop_report import StopOutcome, UnkillableWorker
from trtllm_liveness.stop._survivor import UnkillableBasis, sample_survivor

pytestmark = [pytest.mark.timeout(60)]

def _unkillable(pid: int) -> UnkillableWorker:
    sample = sample_survivor(pid)
    return UnkillableWorker(rank=1, pid=pid, hostname=local_hostname(), state=sample.state, wchan=sample.wchan,
                            d_tids=sample.d_tids, d_wchan=sample.d_wchan, kill_pending=sample.kill_pending,
                            signal="SIGKILL", waited_s=5.0, basis=sample.basis, exiting=sample.exiting,
                            threads=sample.threads)


def test_a_process_spinning_in_the_kernel_in_r_with_sigkill_pending_is_unkillable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # An engine core looping in the GPU driver: every thread R, SIGKILL pending, no thread in D.
    fake_process(tmp_path, 4242, {
        4242: ("R", "0", SIGKILL_PENDING, SPIN_STACK, "EngineCore"),
        4243: ("S", "futex_wait_queue", SIGKILL_PENDING, "[<0>] futex_wait_queue+0x60/0x90\n", "pt_main"),
    }, shared=SIGKILL_PENDING)
    monkeypatch.setattr(_procfs, "PROCFS_PATH", str(tmp_path))
    sample = sample_survivor(4242)
    assert (sample.state, sample.d_tids, sample.kill_pending) == ("R", (), True)
    assert sample.basis is UnkillableBasis.SIGKILL_PENDING
    (main,) = sample.threads  # the main thread; the sleeping one is neither in D nor in R
    assert main.kernel_stack[0].startswith("uvm_spin_loop+") and main.kernel_stack_note == ""
    worker = _unkillable(4242)
    assert worker.kernel_stack == main.kernel_stack
    assert "state R" in worker.message and "running in the kernel" in worker.message
    assert "uninterruptible sleep" not in worker.message
    data = worker.to_dict()
    assert data["basis"] == "sigkill-pending" and data["kernel_stack"][0].startswith("uvm_spin_loop")
    assert {"rank", "pid", "state", "wchan", "d_tids", "d_wchan", "kill_pending", "message"} <= data.keys()


def test_only_a_helper_thread_with_sigkill_pending_still_counts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_process(tmp_path, 4300, {
        4300: ("S", "do_wait", "0" * 16, "[<0>] do_wait+0x1/0x2\n", "python"),
        4301: ("R", "0", SIGKILL_PENDING, SPIN_STACK, "uvm-worker"),
    })
    monkeypatch.setattr(_procfs, "PROCFS_PATH", str(tmp_path))
    sample = sample_survivor(4300)
    assert sample.kill_pending and sample.basis is UnkillableBasis.SIGKILL_PENDING
    assert [thread.tid for thread in sample.threads] == [4300, 4301]  # main first, then the one in R
    assert sample.threads[1].kernel_stack[0].startswith("uvm_spin_loop+")


def test_a_process_whose_exit_is_stuck_is_unkillable_for_that_reason(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # SIGKILL taken (no longer pending), PF_EXITING set, stuck in D in a driver's release.
    fake_process(tmp_path, 4400, {4400: ("D", "nv_release", "0" * 16, "[<0>] nvidia_close+0x1/0x2\n", "python")},
                  flags=0x400044)
    monkeypatch.setattr(_procfs, "PROCFS_PATH", str(tmp_path))
    worker = _unkillable(4400)
    assert worker.basis is UnkillableBasis.EXITING and worker.exiting and not worker.kill_pending
    assert "exit is stuck" in worker.message


def test_an_unreadable_kernel_stack_is_said_not_invented(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_process(tmp_path, 4500, {4500: ("D", "rdma_wait", SIGKILL_PENDING, "", "python")})
    (tmp_path / "4500" / "task" / "4500" / "stack").unlink()
    monkeypatch.setattr(_procfs, "PROCFS_PATH", str(tmp_path))
    (thread,) = sample_survivor(4500).threads
    assert thread.kernel_stack == () and thread.kernel_stack_note.startswith("not readable")
    assert _unkillable(4500).message.count("uninterruptible sleep") == 1  # the D wording is unchanged


@pytest.mark.real_process
def test_a_real_d_survivor_is_reported_with_its_state_wchan_and_kernel_stack(
        procs: ProcessTracker, stuck_child: StuckChild, caplog: pytest.LogCaptureFixture) -> None:
    wedged = stuck_child.popen
    assert wait_until(lambda: state_of(wedged.pid) == "D", 10)
    caplog.set_level(logging.ERROR, logger="trtllm_liveness")
    report = stop_processes([capture_identity(0, wedged.pid)], grace_s=0.1, kill_s=0.3)
    (stuck,) = report.unkillable
    assert stuck.basis is UnkillableBasis.SIGKILL_PENDING and stuck.state == "D" and stuck.wchan
    main = next(thread for thread in stuck.threads if thread.tid == wedged.pid)
    assert main.state == "D" and main.kill_pending
    assert main.kernel_stack, main.kernel_stack_note  # root here: /proc/PID/task/TID/stack is readable
    assert stuck.kernel_stack == main.kernel_stack
    if stuck_child.source == "fuse":
        assert any(frame.startswith("request_wait_answer") for frame in main.kernel_stack), main.kernel_stack
    data = report.to_dict()["unkillable"][0]
    assert data["basis"] == "sigkill-pending" and data["threads"][0]["kernel_stack"]
    assert any("uninterruptible sleep" in record.getMessage() for record in caplog.records)
    stuck_child.release()
    assert wedged.wait(10) in (-9, -15)


@pytest.mark.real_process
@pytest.mark.fuse
def test_a_sigkill_pending_during_the_kill_grace_is_no_verdict(procs: ProcessTracker, fuse_stall: FuseStall) -> None:
    # In D with SIGKILL pending for a while, then let go well inside kill_s: it exited after the kill.
    child = procs.stuck_in_fuse(fuse_stall)
    released = threading.Event()

    def release_once_pending() -> None:
        if wait_until(lambda: _procfs.sigkill_pending(child.pid), 20):
            fuse_stall.release()
        released.set()

    helper = threading.Thread(target=release_once_pending, daemon=True)
    helper.start()
    report = stop_processes([capture_identity(0, child.pid)], grace_s=0.0, kill_s=30.0)
    assert released.wait(20)
    assert report.unkillable == () and report.workers[0].outcome is StopOutcome.EXITED_AFTER_KILL, report
    helper.join(5)
