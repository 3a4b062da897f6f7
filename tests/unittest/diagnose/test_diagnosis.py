"""The diagnosis snapshot (trtllm_liveness.diagnose._diagnosis) on real processes: blocked, spinning,
stopped, frozen in D; Python stacks by the real py-spy; the odd rank out; py-spy that never ends."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from tests.support import rank_children
from tests.support.facilities import needs
from tests.support.fuse_stall import FuseStall
from tests.support.process_tracker import ProcessTracker
from tests.support.rank_children import SPINNING, start
from tests.support.stuck_processes import StuckChild
from tests.support.waits import WAIT_SCALE, wait_until
from trtllm_liveness.cli import main as cli_main
from trtllm_liveness.diagnose import _diagnosis
from trtllm_liveness.diagnose._diagnosis import Activity
from trtllm_liveness.diagnose._py_spy import StackStatus, _parse_text_dump, find_py_spy, take_stacks
from trtllm_liveness.process import _procfs
from trtllm_liveness.process._identity import capture_identity

pytestmark = [pytest.mark.timeout(120), pytest.mark.real_process]

def _py_spy() -> str:
    path = find_py_spy()
    assert path is not None
    return path


def test_each_thread_is_classified_by_its_cpu_use_and_state(procs: ProcessTracker) -> None:
    blocked, spinning, stopped = rank_children.blocked(procs), start(procs, SPINNING), rank_children.stopped(procs)
    diagnosis = _diagnosis.diagnose([blocked.pid, spinning.pid, stopped.pid], stacks=False)
    activities = [rank.activity for rank in diagnosis.ranks]
    assert activities == [Activity.SLEEPING, Activity.SPINNING, Activity.STOPPED], diagnosis.summary()
    assert [rank.rank for rank in diagnosis.ranks] == [0, 1, 2]
    sleeping = diagnosis.ranks[0].main_thread
    assert sleeping is not None and sleeping.wchan and sleeping.cpu_fraction is not None
    assert all(rank.stacks is None for rank in diagnosis.ranks)
    json.dumps(diagnosis.to_dict())


@needs("py-spy")
def test_stacks_name_the_function_each_process_is_stuck_in(procs: ProcessTracker) -> None:
    blocked, spinning, stopped = rank_children.blocked(procs), start(procs, SPINNING), rank_children.stopped(procs)
    identities = [capture_identity(rank, proc.pid) for rank, proc in enumerate((blocked, spinning, stopped))]
    diagnosis = _diagnosis.diagnose(identities, stacks_timeout_s=10 * WAIT_SCALE)
    for rank, function in zip(diagnosis.ranks, ["wait_for_peer_that_never_comes", "spin_on_a_flag_nobody_sets",
                                                "wait_for_peer_that_never_comes"], strict=True):
        assert rank.stacks is not None and rank.stacks.status is StackStatus.TAKEN, rank.stacks
        assert rank.stuck_in is not None and rank.stuck_in.function == function, rank.to_dict()
    assert diagnosis.py_spy
    # The stopped child stayed stopped: --nonblocking neither resumes nor pauses it.
    assert _procfs.read_stat(stopped.pid).state == "T"


def _recording_py_spy(tmp_path: Path) -> tuple[str, Path]:
    """The real py-spy behind a wrapper that logs each command line: shows which pids it was run on."""
    log = tmp_path / "py-spy-calls"
    wrapper = tmp_path / "py-spy"
    wrapper.write_text(f'#!/bin/sh\necho "$@" >> {log}\nexec {_py_spy()} "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    return str(wrapper), log


@needs("py-spy")
def test_a_rank_in_d_gets_no_py_spy_run_and_the_snapshot_returns(
        procs: ProcessTracker, stuck_child: StuckChild, tmp_path: Path) -> None:
    healthy = rank_children.blocked(procs)
    py_spy, log = _recording_py_spy(tmp_path)
    wedged = stuck_child.popen.pid
    diagnosis = _diagnosis.diagnose([healthy.pid, wedged], py_spy=py_spy, stacks_timeout_s=10 * WAIT_SCALE)
    in_d = diagnosis.rank(wedged)
    assert in_d is not None and in_d.activity is Activity.IN_D, diagnosis.summary()
    assert in_d.stacks is not None and in_d.stacks.status is StackStatus.SKIPPED_TASK_IN_D
    assert "task in D" in in_d.stacks.detail
    calls = log.read_text().splitlines()
    assert any(f"--pid {healthy.pid}" in call for call in calls), calls
    assert not any(f"--pid {wedged} " in call + " " for call in calls), calls
    ok = diagnosis.rank(healthy.pid)
    assert ok is not None and ok.stuck_in is not None and ok.stuck_in.function == "wait_for_peer_that_never_comes"


@needs("py-spy")
def test_the_spinning_rank_among_sleepers_is_named_the_odd_rank_out(procs: ProcessTracker) -> None:
    ranks = [*(rank_children.blocked(procs) for _ in range(3)), start(procs, SPINNING)]
    diagnosis = _diagnosis.diagnose([capture_identity(rank, proc.pid) for rank, proc in enumerate(ranks)],
                                    stacks_timeout_s=10 * WAIT_SCALE)
    odd = diagnosis.odd_rank_out
    assert odd is not None and odd.rank == 3 and odd.aspect == "activity", diagnosis.summary()
    assert odd.value == "spinning" and odd.others_value == "sleeping" and odd.others == (0, 1, 2)
    python = [found for found in diagnosis.odd_ranks if found.aspect == "python"]
    assert [(found.rank, found.value, found.others_value) for found in python] == [
        (3, "spin_on_a_flag_nobody_sets", "wait_for_peer_that_never_comes")]
    assert "rank 3 is spinning" in diagnosis.summary()


PIPE_READER = """\
import os, sys
def wait_for_a_message_nobody_sends():
    read_end, _write_end = os.pipe()
    sys.stdout.write("ready\\n"); sys.stdout.flush()
    os.read(read_end, 1)
wait_for_a_message_nobody_sends()
"""


def test_the_rank_sleeping_on_another_wait_channel_is_named(procs: ProcessTracker) -> None:
    ranks = [*(rank_children.blocked(procs) for _ in range(3)), start(procs, PIPE_READER)]
    assert wait_until(lambda: _procfs.read_stat(ranks[3].pid).state == "S", 10)
    diagnosis = _diagnosis.diagnose([proc.pid for proc in ranks], stacks=False)
    assert [rank.activity for rank in diagnosis.ranks] == [Activity.SLEEPING] * 4, diagnosis.summary()
    (odd,) = diagnosis.odd_ranks
    futex = diagnosis.ranks[0].main_thread
    assert futex is not None and futex.wchan
    assert (odd.rank, odd.aspect, odd.others_value, odd.others) == (3, "wchan", futex.wchan, (0, 1, 2))
    assert odd.value and odd.value != futex.wchan


def test_no_odd_rank_out_when_all_ranks_do_the_same(procs: ProcessTracker) -> None:
    ranks = [rank_children.blocked(procs) for _ in range(3)]
    diagnosis = _diagnosis.diagnose([proc.pid for proc in ranks], stacks=False)
    assert [rank.activity for rank in diagnosis.ranks] == [Activity.SLEEPING] * 3
    assert diagnosis.odd_ranks == ()


def test_an_identity_whose_pid_was_reused_is_reported_gone_and_not_scanned(procs: ProcessTracker) -> None:
    proc = rank_children.blocked(procs)
    identity = capture_identity(0, proc.pid)._replace(start_time=1)
    diagnosis = _diagnosis.diagnose([identity], stacks=True)
    (rank,) = diagnosis.ranks
    assert rank.verdict is not None and rank.verdict.is_dead and rank.report is None
    assert rank.stacks is not None and rank.stacks.status is StackStatus.SKIPPED_NOT_RUNNING


def _fake_py_spy(tmp_path: Path, body: str) -> str:
    path = tmp_path / "fake-py-spy"
    # Answers the --help probe like a py-spy with --json, then does what the test needs.
    path.write_text(f'#!/bin/sh\ncase "$*" in *--help*) echo "--json"; exit 0;; esac\n{body}\n')
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_a_py_spy_that_never_answers_is_killed_at_the_deadline(procs: ProcessTracker, tmp_path: Path) -> None:
    proc = rank_children.blocked(procs)
    pid_file = tmp_path / "pid"
    fake = _fake_py_spy(tmp_path, f"echo $$ > {pid_file}\nexec sleep 3600")
    result = take_stacks([proc.pid], timeout_s=0.5, py_spy=fake)[proc.pid]
    assert result.status is StackStatus.TIMED_OUT, result
    fake_pid = int(pid_file.read_text())
    procs.track(fake_pid)
    assert not os.path.exists(f"/proc/{fake_pid}")  # killed and reaped


def test_a_py_spy_stuck_in_d_is_left_behind_and_reported(
        procs: ProcessTracker, fuse_stall: FuseStall, tmp_path: Path) -> None:
    proc = rank_children.blocked(procs)
    pid_file = tmp_path / "pid"
    stuck = " ".join(f"'{arg}'" for arg in fuse_stall.stuck_child_cmd())
    fake = _fake_py_spy(tmp_path, f"echo $$ > {pid_file}\nexec {stuck}")
    result = take_stacks([proc.pid], timeout_s=5 * WAIT_SCALE, py_spy=fake)[proc.pid]
    fake_pid = int(pid_file.read_text())
    procs.track(fake_pid)
    assert fake_pid in fuse_stall.held_tids(), "the fake py-spy never reached the FUSE stall"
    assert result.status is StackStatus.DID_NOT_EXIT, result
    assert "py-spy did not exit" in result.detail
    assert _procfs.sigkill_pending(fake_pid)  # killed, and still there until the stall is released


def test_a_py_spy_that_cannot_start_is_reported(procs: ProcessTracker, tmp_path: Path) -> None:
    proc = rank_children.blocked(procs)
    missing = str(tmp_path / "no-such-py-spy")
    result = take_stacks([proc.pid], py_spy=missing)[proc.pid]
    assert result.status is StackStatus.FAILED and "could not start" in result.detail


def test_text_dump_of_an_older_py_spy_is_parsed() -> None:
    text = ('Process 12: python x.py\nPython v3.11.7 (/usr/bin/python3.11)\n\n'
            'Thread 12 (idle): "MainThread"\n    Condition.wait (threading.py:327)\n'
            '    wait_for_peer_that_never_comes (x.py:3)\n    <module> (x.py:5)\n'
            'Thread 0x7F00 (active+gil): "worker"\n    spin (y.py:9)\n')
    threads = _parse_text_dump(text)
    assert [(t.tid, t.name, t.active, t.owns_gil) for t in threads] == [
        (12, "MainThread", False, False), (None, "worker", True, True)]
    assert threads[0].stuck_in is not None and threads[0].stuck_in.function == "wait_for_peer_that_never_comes"


@needs("py-spy")
def test_scan_stacks_prints_the_stacks_and_the_classification(
        procs: ProcessTracker, capsys: pytest.CaptureFixture[str]) -> None:
    proc = rank_children.blocked(procs)
    assert cli_main(["scan", "--stacks", str(proc.pid)]) == 0
    out = capsys.readouterr().out
    assert "rank 0: sleeping; main thread in wait_for_peer_that_never_comes" in out, out
    assert "python thread" in out and "no odd rank out" in out
    assert cli_main(["scan", "--stacks", "--json", str(proc.pid)]) == 0
    data = json.loads(capsys.readouterr().out)
    (rank,) = data["diagnosis"]["ranks"]
    assert rank["activity"] == "sleeping" and rank["stacks"]["status"] == "taken"
    assert rank["stacks"]["threads"][0]["stuck_in"] == "wait_for_peer_that_never_comes"
    assert "diagnosis" not in json.loads(_scan_json(proc.pid, capsys))


def _scan_json(pid: int, capsys: pytest.CaptureFixture[str]) -> str:
    assert cli_main(["scan", "--json", str(pid)]) == 0
    return capsys.readouterr().out
