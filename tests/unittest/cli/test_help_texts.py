"""What ``--help`` says agrees with what the commands do, and reads as plain text on a terminal."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.facilities import needs
from tests.support.process_tracker import ProcessTracker
from tests.support.waits import WAIT_SCALE

pytestmark = [pytest.mark.real_process, pytest.mark.timeout(60), needs("console-script")]

CLI = Path(sys.executable).parent / "trtllm-liveness"
COMMANDS = ("scan", "watch", "demo-processes", "doctor", "config", "autoload", "quarantine", "launch", "drill")
# Sphinx/reST markup that belongs in docstrings, not on a terminal.
MARKUP = re.compile(r":(?:data|func|class|mod|meth|attr):`|``")


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(CLI), *args], capture_output=True, text=True, timeout=30 * WAIT_SCALE,
                          start_new_session=True)


def gone_pid(procs: ProcessTracker) -> int:
    """The pid of a process that existed and is gone (reaped)."""
    child = procs.sleeper()
    child.kill()
    child.wait(10)
    return child.pid


@pytest.mark.parametrize("command", ("", *COMMANDS))
def test_help_has_no_docstring_markup(command: str) -> None:
    result = run(*([command] if command else []), "--help")
    assert result.returncode == 0, result
    assert not MARKUP.search(result.stdout), MARKUP.findall(result.stdout)


def test_launch_help_names_the_outcome_variable() -> None:
    assert "TRTLLM_LIVENESS_OUTCOME" in run("launch", "--help").stdout


def test_a_pid_that_does_not_exist_is_3_for_scan_and_2_for_watch_as_the_help_says(procs: ProcessTracker) -> None:
    pid = gone_pid(procs)
    scanned = run("scan", str(pid), "--window", "0")
    watched = run("watch", str(pid))
    assert scanned.returncode == 3 and "gone" in scanned.stdout.lower(), scanned
    assert watched.returncode == 2 and "no such process" in watched.stderr, watched
    for command in ("scan", "watch"):
        text = " ".join(run(command, "--help").stdout.split())
        assert "2 bad arguments (watch: also a pid that does not exist or cannot be watched)" in text
        assert "(scan: also a pid that does not exist, reported beside the others)" in text
