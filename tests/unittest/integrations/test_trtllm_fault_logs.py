"""What one failure writes to the log of an engine on the upstream-shaped fake (main), per kind.

A death: ``tests/programs/lifecycle_child.py``'s ``session`` scenario: real MPI ranks, rank 1
SIGKILLed while requests stream, the fatal error awaited, then ``shutdown()`` stops the other rank.
A stall: ``tests/programs/stall_child.py`` with rank 1 SIGSTOPped and ``stall_action=fatal``. One
failure is one ERROR (the fatal line, in its usual form with the evidence appended) and one WARNING
(the snapshot: every rank's state, wait channel, CPU class, iterations and stack source); the end
of a rank the extension stopped (or MPI's runtime after the death) is one INFO line, never a death,
and the diagnosis, taken before the stop, shows it alive. (Wedges, lost hosts and unkillable
ranks write their line through the same function: ``tests/unittest/diagnose/test_fatal_line.py``.)
"""

from __future__ import annotations

import re

import pytest

from tests.support.children import HelperProcess
from tests.support.facilities import MPI_MARKS
from tests.support.process_tracker import ProcessTracker
from tests.support.waits import WAIT_SCALE

pytestmark = [pytest.mark.timeout(90), *MPI_MARKS]

ENV = {"TRTLLM_WORKER_LIVENESS": "enabled=1,scan_interval_s=0.1,shutdown_grace_s=1,shutdown_term_s=0.5,"
                                 "shutdown_kill_s=1"}
_RANK0_END = re.compile(r"stopped rank 0 |rank 0 \(pid \d+\) on host \S+ exited after")
_SNAPSHOT_RANK = re.compile(r"rank 0 \(pid \d+\) on host \S+: \w, wchan \S+, \w+, (\d+ )?iterations( -)?, "
                            r"stacks [\w-]+")
_LINE = re.compile(r" (DEBUG|INFO|WARNING|ERROR|CRITICAL) (trtllm_liveness[\w.]*): (.*)")


def _liveness_lines(log: str) -> dict[str, list[str]]:
    """The extension's log lines by level (the child logs ``time thread LEVEL logger: message``)."""
    found: dict[str, list[str]] = {}
    for line in log.splitlines():
        match = _LINE.search(line)
        if match:
            found.setdefault(match.group(1), []).append(match.group(3))
    return found


def _killed_rank_run(settings: str = "") -> tuple[dict[str, object], str]:
    """The ``session`` scenario: rank 1 SIGKILLed, the fatal error awaited, ``shutdown()``."""
    env = {key: value + settings for key, value in ENV.items()}
    with HelperProcess("lifecycle_child", {"scenario": "session", "tree": "main"}, env) as child:
        record = child.read_record(60 * WAIT_SCALE, "abandoned")
        status = child.wait_exit(30 * WAIT_SCALE)
        log = child.stderr_tail(10**7)
        survivors = child.close()
    assert status == 0 and survivors == [], log
    assert record["fatal"] and "rank 1" in str(record["fatal"]), log
    return record, log


def test_a_killed_rank_is_one_error_one_diagnosis_and_the_stopped_rank_one_info() -> None:
    _record, log = _killed_rank_run()
    lines = _liveness_lines(log)
    errors, warnings, infos = lines.get("ERROR", []), lines.get("WARNING", []), lines.get("INFO", [])
    assert len(errors) == 1 and errors[0].startswith("liveness: fatal: MPI worker rank 1 "), log
    # The evidence, known at once from /proc, is in the ERROR line: rank 1 is gone.
    assert re.search(r"exited unexpectedly: .*; evidence: rank 1 is gone", errors[0]), log
    assert len(warnings) == 1 and warnings[0].startswith("liveness: diagnosis"), log
    assert _SNAPSHOT_RANK.search(warnings[0]) and "rank 1 (pid " in warnings[0], log
    # Rank 0 is ended by the bounded stop, or first by MPI's runtime tearing the job down.
    ends = [line for line in infos if _RANK0_END.search(line)]
    assert len(ends) == 1, log
    assert "SIGTERM" in ends[0] or "exited after the engine's failure" in ends[0], log
    assert not any("exited unexpectedly" in line for line in warnings + infos), log


def test_the_diagnosis_of_a_death_shows_the_surviving_rank_before_the_stop_ends_it() -> None:
    """The fatal verdict's snapshot is taken before the bounded stop signals rank 0: it shows
    rank 0 alive (its activity), rank 1 exited. (MPI's runtime may end rank 0 on its own after the
    death; the snapshot, 0.05 s after the detection, precedes that too.) The stop's wait is raised
    from its 0.3 s so that a loaded machine's slow stack reads end within it as well."""
    _record, log = _killed_rank_run(",diagnosis_before_stop_s=10")
    diagnoses = [line for line in _liveness_lines(log).get("WARNING", []) if line.startswith("liveness: diagnosis")]
    assert len(diagnoses) == 1, log
    rank0 = re.search(r"rank 0 \(pid \d+\) on host \S+: [^,]*, wchan \S+, ([\w-]+)", diagnoses[0])
    assert rank0 is not None and rank0.group(1) != "exited", log
    assert re.search(r"rank 1 \(pid \d+\) on host \S+: [^,]*, wchan \S+, exited", diagnoses[0]), log
    if "liveness: stopped rank 0 " in log:  # the extension's stop, not MPI's runtime, ended it
        assert log.index("liveness: diagnosis") < log.index("liveness: stopped rank 0 "), log


STALL_ENV = ("enabled=1,scan_interval_s=0.05,shutdown_grace_s=0.5,shutdown_term_s=0.5,shutdown_kill_s=1,"
             "stall_timeout_s=2,stall_action=fatal")


def test_a_fatal_stall_is_one_error_with_its_evidence_and_one_diagnosis(procs: ProcessTracker) -> None:
    """Rank 1 SIGSTOPped: the ERROR names it with the evidence inside the naming
    (``engine stalled (named: MPI worker rank 1 ...; evidence: rank 1 is stopped ...)``); the
    stall's own WARNING is not written besides (the fatal line is the failure's line); one WARNING
    carries the snapshot, in which rank 1 is stopped (``T``)."""
    options = {"tree": "main", "engine": {"step_acks": True, "stall": {"rank": 1, "kind": "stop", "after_tokens": 3}}}
    helper = HelperProcess("stall_child", options, {"TRTLLM_WORKER_LIVENESS": STALL_ENV})
    procs.popens.append(helper.popen)
    procs.track(helper.pid)
    try:
        record = helper.read_record(90 * WAIT_SCALE, "events")
        status = helper.wait_exit(30 * WAIT_SCALE)
        log = helper.stderr_tail(10**7)
    finally:
        helper.close()
    assert status == 0 and record["fatal_kind"] == "stalled", log
    lines = _liveness_lines(log)
    errors, warnings = lines.get("ERROR", []), lines.get("WARNING", [])
    assert len(errors) == 1, log
    assert re.match(r"liveness: fatal: engine stalled \(named: MPI worker rank 1 \(pid \d+\) on host \S+; "
                    r"evidence: rank 1 is stopped \(T\)", errors[0]), errors[0]
    assert errors[0].count("rank 1 is stopped") == 1, errors[0]
    assert len(warnings) == 1 and warnings[0].startswith("liveness: diagnosis (stalled of rank 1)"), log
    assert re.search(r"rank 1 \(pid \d+\) on host \S+: T, wchan \S+, stopped, .*stacks [\w-]+",
                     warnings[0]), warnings[0]
