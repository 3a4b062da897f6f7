"""Unkillable in any state, for the quarantine and the scan: a process still there with SIGKILL
pending is unkillable whether it sleeps in ``D`` or runs in the kernel in ``R``.

- the start-up device check (``_device_holders``) refuses a host where such a process holds an
  accelerator device, and names its state, wait channel and kernel stack;
- the marker's verdict on a recorded process (``_marker.check_process``) says ``unkillable`` with
  the same, not ``alive``;
- the scan's verdict (``diagnose._scan``) is ``unkillable`` after two samples with SIGKILL pending.

The ``R`` case comes from a fake ``/proc`` tree (no test can make a kernel spin loop); real ``D``
from the freezer and FUSE (``stuck_child``), SIGKILLed for real so that the signal stays pending.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests.support.fake_procfs import SIGKILL_PENDING, SPIN_STACK, fake_process
from tests.support.process_tracker import ProcessTracker
from tests.support.stuck_processes import StuckChild
from tests.support.waits import wait_until
from trtllm_liveness.diagnose._scan import Verdict, scan
from trtllm_liveness.process import _procfs
from trtllm_liveness.quarantine._device_holders import find_stuck_device_holders
from trtllm_liveness.quarantine._marker import ProcessVerdict, QuarantinedProcess, check_process

pytestmark = [pytest.mark.timeout(60)]

PID = 4242


@pytest.fixture
def spinning_in_r(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An engine core looping in the GPU driver: every thread R, SIGKILL pending, no thread in D,
    ``/dev/nvidia0`` open; the fake tree is what ``_procfs`` reads."""
    fake_process(tmp_path, PID, {
        PID: ("R", "0", SIGKILL_PENDING, SPIN_STACK, "EngineCore"),
        PID + 1: ("R", "0", SIGKILL_PENDING, SPIN_STACK, "EngineCore"),
    }, shared=SIGKILL_PENDING, devices=("/dev/nvidia0", "/dev/nvidiactl"))
    monkeypatch.setattr(_procfs, "PROCFS_PATH", str(tmp_path))
    return tmp_path


def test_a_device_holder_spinning_in_r_with_sigkill_pending_is_refused(spinning_in_r: Path) -> None:
    (holder,) = find_stuck_device_holders(("/dev/nvidia*",), resample_s=0.01)
    assert holder.pid == PID and holder.kill_pending and holder.state == "R" and holder.d_tids == ()
    assert holder.kernel_stack[0].startswith("uvm_spin_loop"), holder
    text = holder.describe()
    assert "unkillable (SIGKILL pending, state R)" in text and "uvm_spin_loop" in text, text


def test_a_device_holder_in_r_without_sigkill_pending_is_no_suspect(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    fake_process(tmp_path, PID, {PID: ("R", "0", "0" * 16, SPIN_STACK, "EngineCore")}, devices=("/dev/nvidia0",))
    monkeypatch.setattr(_procfs, "PROCFS_PATH", str(tmp_path))
    assert find_stuck_device_holders(("/dev/nvidia*",), resample_s=0.01) == ()


def test_the_marker_calls_a_recorded_process_in_r_with_sigkill_pending_unkillable(spinning_in_r: Path) -> None:
    # No ns/pid in the fake tree: the namespace read there is 0, the recorded one too; its start time is 4.
    recorded = QuarantinedProcess(PID, 4, 0, 1, "R", "", "unkillable", "survived SIGKILL")
    check = check_process(recorded)
    assert check.verdict is ProcessVerdict.UNKILLABLE and check.verdict.blocks, check
    assert check.state == "R" and check.kernel_stack[0].startswith("uvm_spin_loop"), check
    assert "still unkillable (state R" in check.describe() and "uvm_spin_loop" in check.describe()


def test_the_scan_calls_a_process_in_r_with_sigkill_pending_on_two_samples_unkillable(spinning_in_r: Path) -> None:
    (report,) = scan([PID], window_s=0.02, samples=2).processes
    assert report.verdict is Verdict.UNKILLABLE, report
    assert "not in D" in report.detail and "state R" in report.detail and "uvm_spin_loop" in report.detail, report


def test_real_d_with_sigkill_pending_is_unkillable_for_the_marker_and_the_scan(
        stuck_child: StuckChild, procs: ProcessTracker) -> None:
    pid = stuck_child.popen.pid
    os.kill(pid, signal.SIGKILL)  # stays pending: the task is in D
    assert wait_until(lambda: _procfs.sigkill_pending(pid), 10)
    # A FUSE waiter woken by the signal runs for a moment, then waits for the held answer in D.
    assert wait_until(lambda: "D" in _procfs.read_thread_states(pid).values(), 10)
    info = _procfs.read_stat(pid)
    recorded = QuarantinedProcess(pid, info.start_time, _procfs.pid_namespace_inode("self"), 1, "D", "", "wedged", "")
    check = check_process(recorded)
    assert check.verdict is ProcessVerdict.UNKILLABLE and check.state == "D" and check.wchan, check
    (report,) = scan([pid], window_s=0.05, samples=2).processes
    assert report.verdict is Verdict.UNKILLABLE, report
    assert "SIGKILL pending" in report.detail and "kernel stack" in report.detail, report.detail


@pytest.mark.parametrize("flags, unkillable", [(0x400044, False), (0x400040, True)], ids=["exiting", "not-exiting"])
def test_a_process_in_r_with_sigkill_pending_is_unkillable_only_when_not_exiting(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flags: int, unkillable: bool) -> None:
    # A SIGKILLed process keeps SIGKILL pending until it is reaped, also while its exit path
    # (PF_EXITING) still runs in R holding /dev/nvidia*: a normal exit, not an unkillable task.
    fake_process(tmp_path, PID, {PID: ("R", "0", SIGKILL_PENDING, "[<0>] exit_mmap+0x1/0x2\n", "EngineCore")},
                 shared=SIGKILL_PENDING, flags=flags, devices=("/dev/nvidia0",))
    monkeypatch.setattr(_procfs, "PROCFS_PATH", str(tmp_path))
    holders = find_stuck_device_holders(("/dev/nvidia*",), resample_s=0.01)
    assert [holder.pid for holder in holders] == ([PID] if unkillable else []), holders
    check = check_process(QuarantinedProcess(PID, 4, 0, 1, "R", "", "unkillable", "survived SIGKILL"))
    assert check.verdict is (ProcessVerdict.UNKILLABLE if unkillable else ProcessVerdict.ALIVE), check
    (report,) = scan([PID], window_s=0.02, samples=2).processes
    assert report.verdict is (Verdict.UNKILLABLE if unkillable else Verdict.OK), report
