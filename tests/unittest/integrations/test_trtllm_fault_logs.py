"""What one rank's death writes to the log of an engine on the upstream-shaped fake (main).

``tests/programs/lifecycle_child.py``'s ``session`` scenario: real MPI ranks, rank 1 SIGKILLed
while requests stream, the fatal error awaited, then ``shutdown()`` stops the other rank. One
failure is one ERROR (the fatal line) and one WARNING (the diagnosis); the end of rank 0 (stopped
by the extension, or by MPI's runtime after the death) is one INFO line, never a death, and the
diagnosis, taken before the stop, shows it alive.
"""

from __future__ import annotations

import re

import pytest

from tests.support.children import HelperProcess
from tests.support.facilities import MPI_MARKS
from tests.support.waits import WAIT_SCALE

pytestmark = [pytest.mark.timeout(90), *MPI_MARKS]

ENV = {"TRTLLM_WORKER_LIVENESS": "enabled=1,scan_interval_s=0.1,shutdown_grace_s=1,shutdown_term_s=0.5,"
                                 "shutdown_kill_s=1"}
_RANK0_END = re.compile(r"stopped rank 0 |rank 0 \(pid \d+\) on host \S+ exited after")
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
    assert len(warnings) == 1 and warnings[0].startswith("liveness: diagnosis"), log
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
    rank0 = re.search(r"rank 0 \(pid \d+\) (\S+)", diagnoses[0])
    assert rank0 is not None and rank0.group(1) != "exited", log
    assert re.search(r"rank 1 \(pid \d+\) exited", diagnoses[0]), log
    if "liveness: stopped rank 0 " in log:  # the extension's stop, not MPI's runtime, ended it
        assert log.index("liveness: diagnosis") < log.index("liveness: stopped rank 0 "), log
