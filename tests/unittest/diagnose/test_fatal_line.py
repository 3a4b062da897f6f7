"""The fatal ERROR line with its evidence, for every kind of failure, and the fatal verdict's
snapshot as a typed record in the outcome record and the termination message.

The line is built by one function for every kind (a death, a wedge, a stall, a lost host, an
unkillable rank): today's message with the evidence appended, the stall's inside its naming.
Real processes give the evidence: a SIGSTOPped child is named stopped from ``/proc`` at once.
"""

from __future__ import annotations

import json
import logging
import re
import signal
import threading
from pathlib import Path

import pytest

from tests.support.process_tracker import ProcessTracker
from tests.support.waits import wait_until
from trtllm_liveness._events import EventKind, WorkerEvent
from trtllm_liveness.diagnose._diagnosis import diagnose
from trtllm_liveness.diagnose._diagnosis_text import STATES_ONLY, fatal_line, instant_evidence, snapshot_record
from trtllm_liveness.diagnose._stalled_rank import stalled_rank_now
from trtllm_liveness.exit._outcome import OUTCOME_ENV, read_outcomes, record_outcome, record_snapshot
from trtllm_liveness.exit._snapshot_record import FatalSnapshot, RankSnapshot
from trtllm_liveness.exit._termination_log import amend_termination_message, write_termination_message
from trtllm_liveness.process import _procfs
from trtllm_liveness.process._identity import ProcessIdentity, capture_identity

pytestmark = [pytest.mark.timeout(60)]

WHO = ProcessIdentity(rank=1, pid=4242, start_time=1, hostname="node-a", pid_namespace=None)
EVIDENCE = f"rank 1 is stopped (T) ({STATES_ONLY})"
SNAPSHOT = FatalSnapshot("died of rank 1", 1.0e9, 120.0, "rank 1 is gone (no such process)", (
    RankSnapshot(0, 41, "node-a", "S", "futex_wait_queue", "sleeping", 17, "faulthandler", ("wait (a.py:3)",)),
    RankSnapshot(1, 42, "node-b", "", "", "exited", None, "skipped-not-running")))


@pytest.mark.parametrize(("kind", "cause", "form"), [
    (EventKind.DIED, "killed by SIGKILL", r"MPI worker rank 1 \(pid 4242\) on host node-a exited unexpectedly: "
                                          r"killed by SIGKILL; evidence: rank 1 is stopped"),
    (EventKind.WEDGED, "thread 4242 in D for 5.0s", r"MPI worker rank 1 \(pid 4242\) on host node-a is wedged in "
                                                    r"uninterruptible sleep \(D\): .*; evidence: rank 1"),
    (EventKind.LOST, "its agent went silent", r"MPI worker rank 1 \(pid 4242\) on host node-a is lost: its agent "
                                              r"went silent; evidence: rank 1"),
    (EventKind.UNKILLABLE, "SIGKILL pending", r"MPI worker rank 1 \(pid 4242\) on host node-a is unkillable .*; "
                                              r"evidence: rank 1"),
    (EventKind.STALLED, "no progress for 3.00s; rank 1 is stopped (T)",
     r"engine stalled \(named: MPI worker rank 1 \(pid 4242\) on host node-a; evidence: rank 1 is stopped \(T\) "
     r"\(from the ranks' thread states now; the snapshot follows\)\): no progress for 3.00s$"),
])
def test_every_kind_keeps_its_form_with_the_evidence_appended(kind: EventKind, cause: str, form: str) -> None:
    line = fatal_line(WorkerEvent(kind, WHO, cause), EVIDENCE)
    assert re.match(form, line), line
    assert line.count("rank 1 is stopped") == 1, line  # the stall's own evidence is not repeated


def test_the_evidence_of_a_stopped_rank_is_read_from_proc_at_once(procs: ProcessTracker) -> None:
    child, other = procs.sleeper(), procs.sleeper()
    ranks = [capture_identity(0, other.pid), capture_identity(1, child.pid)]
    child.send_signal(signal.SIGSTOP)
    assert wait_until(lambda: _procfs.read_stat(child.pid).state == "T", 10)
    evidence = instant_evidence(stalled_rank_now(ranks))
    assert evidence.startswith("rank 1 is stopped (T)") and STATES_ONLY in evidence, evidence
    assert instant_evidence(None).startswith("no local rank is gone, stopped, in D or behind")

    # The snapshot of the same ranks, as the record the WARNING line and the records carry.
    diagnosis = diagnose(ranks, stacks=False, window_s=0.0, cpu_window_s=0.05, iterations={0: 5, 1: 5})
    record = snapshot_record(diagnosis, "stalled of rank 1", hosts={0: "node-a", 1: "node-a"},
                             iterations={0: 5, 1: 5})
    by_rank = {rank.rank: rank for rank in record.ranks}
    assert by_rank[1].state == "T" and by_rank[1].cpu == "stopped" and by_rank[1].iterations == 5
    assert by_rank[0].state == "S" and by_rank[0].stacks == "not asked"
    assert record.named.startswith("rank 1 is stopped")
    assert f"rank 1 (pid {child.pid}) on host node-a: T, wchan " in record.summary()
    child.send_signal(signal.SIGCONT)


def test_the_snapshot_record_round_trips_and_bad_forms_are_named() -> None:
    assert FatalSnapshot.from_dict(json.loads(json.dumps(SNAPSHOT.to_dict()))) == SNAPSHOT
    with pytest.raises(ValueError, match="ranks"):
        FatalSnapshot.from_dict({**SNAPSHOT.to_dict(), "ranks": "none"})
    with pytest.raises(ValueError, match="iterations"):
        FatalSnapshot.from_dict({**SNAPSHOT.to_dict(), "ranks": [{**SNAPSHOT.ranks[0].to_dict(), "iterations": "x"}]})
    # Cut to a limit, the JSON stays whole: frames go first, then ranks from the end.
    small = json.loads(SNAPSHOT.to_json(300))
    assert len(json.dumps(small, separators=(",", ":"))) <= 300 and small["ranks"][0]["main_frames"] == []


def test_the_outcome_record_carries_the_snapshot_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(OUTCOME_ENV, str(tmp_path))
    writer = record_outcome("MPI worker rank 1 ... exited unexpectedly; evidence: rank 1 is gone", True, 1)
    assert writer is not None
    snapshot_writer = record_snapshot(SNAPSHOT)
    assert snapshot_writer is not None
    for thread in (writer, snapshot_writer):
        thread.join(10)
    (outcome,) = read_outcomes(str(tmp_path))
    assert outcome.state == "failed" and "evidence: rank 1 is gone" in outcome.message
    assert outcome.snapshot == SNAPSHOT
    assert record_snapshot(SNAPSHOT) is None  # once


def test_the_termination_message_is_amended_with_the_snapshot_and_never_by_another_error(tmp_path: Path) -> None:
    path = tmp_path / "termination-log"
    first = "trtllm-liveness: fatal engine error: rank 1 died; evidence: rank 1 is gone\n"
    threads = [write_termination_message(str(path), first)]
    amended = first + f"snapshot: {SNAPSHOT.to_json(3000)}\n"
    threads.append(amend_termination_message(str(path), amended))
    assert amend_termination_message(str(path), "trtllm-liveness: fatal engine error: another\n") is None
    for thread in threads:
        assert isinstance(thread, threading.Thread)
        thread.join(10)
    text = path.read_text()
    assert text == amended, text  # the first write, if it ran last, never overwrote its amendment
    assert FatalSnapshot.from_dict(json.loads(text.split("snapshot: ", 1)[1])) == SNAPSHOT



def test_a_failing_snapshot_report_is_a_warning_not_a_second_error(procs: ProcessTracker,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """The failure already has its one ERROR: a reporter of its snapshot that raises (the one asked
    at the request, or the one asked while another diagnosis ran) adds a WARNING with its text."""
    from trtllm_liveness.integrations.trtllm._engine_stall import Diagnoser

    ranks = [capture_identity(0, procs.sleeper().pid)]
    diagnoser = Diagnoser(lambda: ranks)
    release = threading.Event()

    def stall_reporter(diagnosis: object) -> None:
        release.wait(30)
        raise RuntimeError("reporter broke")

    def late(diagnosis: object) -> None:
        raise RuntimeError("late reporter broke")

    try:
        assert diagnoser.request("stall 1", stall_reporter)
        assert not diagnoser.request("died of rank 0", late, snapshot=True)  # one runs already
        release.set()
        assert diagnoser.await_snapshot(30) and diagnoser.done.wait(30)
    finally:
        assert diagnoser.close() == []
    assert [record.levelname for record in caplog.records if record.levelno >= logging.WARNING] == \
        ["WARNING", "WARNING"], caplog.text
    assert "reporter broke" in caplog.text and "late reporter broke" in caplog.text


def test_a_snapshot_asked_while_a_diagnosis_runs_is_reported_from_that_one(procs: ProcessTracker) -> None:
    """A stall's diagnosis (0.2 s CPU window) is running when a fatal verdict asks for its snapshot:
    the running one is the snapshot: it is announced and handed to the verdict's reporter once."""
    from trtllm_liveness.integrations.trtllm._engine_stall import Diagnoser

    ranks = [capture_identity(0, procs.sleeper().pid), capture_identity(1, procs.sleeper().pid)]
    diagnoser = Diagnoser(lambda: ranks)
    reported: list[object] = []
    stall_done = threading.Event()
    try:
        assert diagnoser.request("stall 1", lambda diagnosis: stall_done.set())
        assert not diagnoser.request("died of rank 1", reported.append, snapshot=True)  # one runs already
        assert diagnoser.await_snapshot(30)
        assert stall_done.is_set() and len(reported) == 1
        assert {rank.rank for rank in getattr(reported[0], "ranks", ())} == {0, 1}
    finally:
        assert diagnoser.close() == []
