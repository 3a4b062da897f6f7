"""``trtllm-liveness scan`` judges ``D`` by the kernel's hung-task rule, as the monitor does: a thread
in ``D`` on every sample *without a context switch* between them is ``d-state`` (and, with SIGKILL
pending on two samples, ``unkillable``); a thread in ``D`` on every sample that switches between
them (slow reads through FUSE that make progress) is ``ok``.

Real processes: a reader of the FUSE stall's slow-read file (every READ answered after 100-300 ms)
and a child stuck in ``D`` from either source (freezer, an unanswered FUSE lookup).
"""

from __future__ import annotations

import os
import signal

import pytest

from tests.support.fuse_stall import FuseStall
from tests.support.process_tracker import ProcessTracker, state_of
from tests.support.slow_reads import SlowReadResult
from tests.support.stuck_processes import StuckChild
from tests.support.waits import wait_until
from trtllm_liveness.diagnose._scan import Verdict, scan
from trtllm_liveness.process import _procfs

pytestmark = [pytest.mark.real_process, pytest.mark.fuse, pytest.mark.timeout(90)]


def _kill_pending_in_d(pid: int) -> bool:
    try:
        return _procfs.sigkill_pending(pid) and _procfs.read_stat(pid).state == "D"
    except OSError:
        return False


def test_scan_calls_slow_io_ok_and_a_thread_that_never_runs_d_state_then_unkillable(
    procs: ProcessTracker, fuse_stall: FuseStall, stuck_child: StuckChild
) -> None:
    reader, reader_tid = procs.slow_reader(fuse_stall, 8.0)  # outlasts the wait and the scan on a loaded machine
    stuck = stuck_child.popen
    assert wait_until(lambda: state_of(stuck.pid) == "D", 10)
    result = scan([reader.pid, stuck.pid], window_s=1.0, samples=5)
    slow, held = result.processes
    assert result.samples == 5
    # The look-alike is real: the reading thread was in D on (nearly) every sample of the scan.
    [reading] = [thread for thread in slow.threads if thread.tid == reader_tid]
    assert reading.d_samples >= 4, slow
    assert slow.verdict is Verdict.OK, slow.detail
    assert "making progress" in slow.detail or reading.d_samples < result.samples, slow.detail
    assert held.verdict is Verdict.D_STATE, held.detail
    assert "with no context switch" in held.detail and f"thread {stuck.pid} " in held.detail, held.detail
    # Killed, it stays in D with SIGKILL pending and never runs: unkillable, and said why.
    os.kill(stuck.pid, signal.SIGKILL)
    assert wait_until(lambda: _kill_pending_in_d(stuck.pid), 10)
    [report] = scan([stuck.pid], window_s=1.0, samples=5).processes
    assert report.verdict is Verdict.UNKILLABLE, report.detail
    assert "SIGKILL pending and no context switch" in report.detail, report.detail
    assert reader.stdout is not None
    progress = SlowReadResult.parse(reader.stdout.readline())  # before a release ends the reads too
    assert progress.mismatches == 0 and progress.reads >= 3, progress
    stuck_child.release()
