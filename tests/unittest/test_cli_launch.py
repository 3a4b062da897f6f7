"""``trtllm-liveness launch``: the launcher's status, unless it is 0 after a recorded fatal error.

Real child processes through the installed console script; the engine's side of the record is
:func:`trtllm_liveness._outcome.record_outcome`, the call its fatal path makes. The multi-host
case (mpirun exiting 0 after a host crash) is in tests/unittest/multihost/.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tests.conftest import WAIT_SCALE, ProcessTracker
from trtllm_liveness._outcome import OUTCOME_ENV, read_outcome, record_outcome

pytestmark = [pytest.mark.real_process, pytest.mark.timeout(60)]

CLI = [sys.executable, "-m", "trtllm_liveness.cli", "launch", "--"]
RECORD = ("import sys; from trtllm_liveness._outcome import record_outcome; "
          "record_outcome('rank 2 on hostB died', {restartable}, {code}).join(5); sys.exit({status})")


def launch(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *argv], capture_output=True, text=True, timeout=30 * WAIT_SCALE, check=False)


@pytest.mark.parametrize(("restartable", "code", "status", "expected"), [
    (True, 1, 0, 1),  # mpirun's 0 after a host crash: the recorded error's status
    (False, 69, 0, 69),  # a wedge: the unrestartable status
    (True, 1, 3, 3),  # the launcher's own failure stands
])
def test_a_recorded_fatal_error_turns_a_zero_status_into_its_own(restartable: bool, code: int, status: int,
                                                                 expected: int) -> None:
    done = launch(sys.executable, "-c", RECORD.format(restartable=restartable, code=code, status=status))
    assert done.returncode == expected, done.stderr
    if status == 0:
        assert "exited 0, but the engine failed: rank 2 on hostB died" in done.stderr


def test_no_record_keeps_the_launchers_status() -> None:
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


def test_the_record_is_made_once_and_a_malformed_one_is_refused(tmp_path: os.PathLike[str]) -> None:
    path = os.path.join(tmp_path, "outcome.json")
    env = {OUTCOME_ENV: path}
    first = record_outcome("first", True, 1, env)
    assert first is not None
    first.join(5)
    second = record_outcome("second", False, 69, env)
    assert second is not None
    second.join(5)
    outcome = read_outcome(path)
    assert outcome is not None and (outcome.message, outcome.restartable, outcome.exit_code) == ("first", True, 1)
    assert record_outcome("none asked", True, 1, {}) is None
    with open(path, "w") as handle:
        handle.write('{"message": "x", "restartable": true, "exit_code": 0}')
    with pytest.raises(ValueError, match="malformed"):
        read_outcome(path)
    os.unlink(path)
    os.symlink("/etc/passwd", path)
    with pytest.raises(OSError):
        read_outcome(path)  # O_NOFOLLOW: never a file the link points to
