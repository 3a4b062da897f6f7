"""What one rank's death writes to the log of an engine on the upstream-shaped fake (main).

``tests/programs/lifecycle_child.py``'s ``session`` scenario: real MPI ranks, rank 1 SIGKILLed
while requests stream, the fatal error awaited, then ``shutdown()`` stops the other rank. One
failure is one ERROR (the fatal line) and one WARNING (the diagnosis); the rank the extension
stops itself is one INFO line, never a death.
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
_LINE = re.compile(r" (DEBUG|INFO|WARNING|ERROR|CRITICAL) (trtllm_liveness[\w.]*): (.*)")


def _liveness_lines(log: str) -> dict[str, list[str]]:
    """The extension's log lines by level (the child logs ``time thread LEVEL logger: message``)."""
    found: dict[str, list[str]] = {}
    for line in log.splitlines():
        match = _LINE.search(line)
        if match:
            found.setdefault(match.group(1), []).append(match.group(3))
    return found


def test_a_killed_rank_is_one_error_one_diagnosis_and_the_stopped_rank_one_info() -> None:
    with HelperProcess("lifecycle_child", {"scenario": "session", "tree": "main"}, ENV) as child:
        record = child.read_record(60 * WAIT_SCALE, "abandoned")
        status = child.wait_exit(30 * WAIT_SCALE)
        log = child.stderr_tail(10**7)
        survivors = child.close()
    assert status == 0 and survivors == [], log
    assert record["fatal"] and "rank 1" in str(record["fatal"]), log
    lines = _liveness_lines(log)
    errors, warnings, infos = lines.get("ERROR", []), lines.get("WARNING", []), lines.get("INFO", [])
    assert len(errors) == 1 and errors[0].startswith("liveness: fatal: MPI worker rank 1 "), log
    assert len(warnings) == 1 and warnings[0].startswith("liveness: diagnosis"), log
    stopped = [line for line in infos if "stopped rank 0 " in line]
    assert len(stopped) == 1 and "SIGTERM" in stopped[0], log
    assert not any("exited unexpectedly" in line for line in warnings + infos), log
