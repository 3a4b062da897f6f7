"""``trtllm-liveness launch``: the launcher's status, unless it is 0 while an engine failed or never
ended cleanly.

Real child processes through the CLI; the engine's side is :mod:`trtllm_liveness.exit._outcome`, the
calls its start, its fatal path and its healthy shutdown make. The multi-host case (mpirun exiting
0 after a host crash) is in tests/unittest/multihost/test_agents.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tests.conftest import WAIT_SCALE, ProcessTracker
from trtllm_liveness.exit._outcome import read_outcomes

pytestmark = [pytest.mark.real_process, pytest.mark.timeout(60)]

CLI = [sys.executable, "-m", "trtllm_liveness.cli", "launch", "--"]
ENGINE = ("import os, signal, sys; from trtllm_liveness.exit import _outcome as o; o.mark_running({code}); "
          "{then}; sys.exit({status})")


def launch(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *argv], capture_output=True, text=True, timeout=30 * WAIT_SCALE, check=False)


def engine(then: str, status: int = 0, code: int = 1) -> subprocess.CompletedProcess[str]:
    return launch(sys.executable, "-c", ENGINE.format(code=code, then=then, status=status))


@pytest.mark.parametrize(("then", "status", "expected", "says"), [
    ("o.record_outcome('rank 2 on hostB died', True, 1).join(5)", 0, 1, "the engine failed: rank 2 on hostB died"),
    ("o.record_outcome('rank 3 wedged', False, 69).join(5)", 0, 69, "the engine failed: rank 3 wedged"),
    ("o.record_outcome('rank 2 died', True, 1).join(5)", 3, 3, ""),  # the launcher's own failure stands
    # Open MPI's abort (14) after the fatal error was recorded (its default error handler ends the
    # engine at its next operation with a dead or stopped worker): the recorded status says why
    ("o.record_outcome('rank 3 wedged', False, 69).join(5)", 14, 69, "exited 14 (Open MPI's abort)"),
    ("o.record_outcome('rank 2 died', True, 3).join(5)", 14, 3, "after the engine failed: rank 2 died"),
    ("pass", 14, 14, ""),  # no failure recorded: MPI's abort is the launcher's own status
    # killed with its job before it could record why (PRRTE's teardown after a host crash)
    ("os.kill(os.getpid(), signal.SIGKILL)", 0, 1, "never ended cleanly"),
    ("o.mark_clean()", 0, 0, ""),  # a healthy shutdown
    ("pass", 0, 0, ""),  # a normal interpreter exit without a failure is clean
    ("o.record_outcome('first', True, 1).join(5); o.mark_clean(); o.mark_running(1)", 0, 1, "failed: first"),
])
def test_the_status_is_the_launchers_unless_an_engine_failed_or_ended_unclean(then: str, status: int, expected: int,
                                                                              says: str) -> None:
    done = engine(then, status)
    if "SIGKILL" in then:
        # The child itself dies of SIGKILL: the wrapper reports that (137); the job's launcher (mpirun)
        # would exit 0 around it, as the program below shows.
        assert done.returncode == 128 + signal.SIGKILL, done.stderr
        return
    assert done.returncode == expected, done.stderr
    assert says in done.stderr


def test_an_engine_killed_under_a_launcher_that_exits_0_is_no_success() -> None:
    """The host-crash shape: the launcher (here a shell standing in for mpirun) exits 0 although its
    engine process was killed before it could record anything but ``running``."""
    inner = ENGINE.format(code=1, then="os.kill(os.getpid(), signal.SIGKILL)", status=0)
    done = launch("sh", "-c", f'{sys.executable} -c "{inner}"; exit 0')
    assert done.returncode == 1, done.stderr
    assert "never ended cleanly" in done.stderr


def test_no_engine_keeps_the_launchers_status() -> None:
    assert launch(sys.executable, "-c", "pass").returncode == 0
    assert launch(sys.executable, "-c", "import sys; sys.exit(7)").returncode == 7
    assert launch().returncode == 2


def test_a_signal_reaches_the_launcher_and_its_status_is_128_plus_n(procs: ProcessTracker) -> None:
    wrapper = subprocess.Popen([*CLI, sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"],
                               stdout=subprocess.PIPE, start_new_session=True)
    procs.popens.append(wrapper)
    procs.track(wrapper.pid)
    assert wrapper.stdout is not None and wrapper.stdout.readline() == b"up\n"
    wrapper.send_signal(signal.SIGTERM)
    assert wrapper.wait(30 * WAIT_SCALE) == 128 + signal.SIGTERM


def test_malformed_or_linked_records_are_refused(tmp_path: os.PathLike[str]) -> None:
    directory = str(tmp_path)
    path = os.path.join(directory, "outcome.1.json")
    with open(path, "w") as handle:
        handle.write('{"state": "failed", "message": "x", "restartable": true, "exit_code": 0, "pid": 1}')
    with pytest.raises(ValueError, match="malformed"):
        read_outcomes(directory)
    os.unlink(path)
    os.symlink("/etc/passwd", path)
    with pytest.raises(OSError):
        read_outcomes(directory)  # O_NOFOLLOW: never a file the link points to
