"""``trtllm-liveness launch``: the recorded failure's status after an engine failed, else the
launcher's, unless it is 0 while an engine never ended cleanly; the outcome pipe; the end of a job
that outlives its failed engine.

Real child processes through the CLI; the engine's side is :mod:`trtllm_liveness.exit._outcome`, the
calls its start, its fatal path and its healthy shutdown make. The multi-host case (mpirun exiting
0 after a host crash) is in tests/unittest/multihost/test_agents.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.support.process_tracker import ProcessTracker, state_of
from tests.support.waits import WAIT_SCALE, wait_until
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
    # after a recorded failure its status is the supervisor's, whatever the launcher exits with
    ("o.record_outcome('rank 2 died', True, 1).join(5)", 3, 1, "exited 3 after the engine failed: rank 2 died"),
    ("o.record_outcome('rank 2 died', True, 3).join(5)", 134, 3, "exited 134 after the engine failed"),
    # Open MPI's abort (14) after the fatal error was recorded (its default error handler ends the
    # engine at its next operation with a dead or stopped worker): the recorded status says why
    ("o.record_outcome('rank 3 wedged', False, 69).join(5)", 14, 69, "exited 14 (Open MPI's abort)"),
    ("o.record_outcome('rank 2 died', True, 3).join(5)", 14, 3, "after the engine failed: rank 2 died"),
    ("pass", 14, 14, ""),  # an engine that ended cleanly: 14 is the launcher's own status
    # Open MPI's abort at a dead peer before the engine's verdict (no exit hook runs): unclean
    ("os._exit(14)", 0, 1, "exited 14, but the engine (pid"),
    ("os._exit(255)", 0, 1, "exited 255, but the engine (pid"),  # mpirun's status after a host crash, at times
    # a failure that turned unrestartable (a rank left unkillable after a death) outranks the first
    ("o.record_outcome('rank 2 died', True, 3); o.record_unrestartable('rank 3 unkillable', 69); os._exit(14)",
     0, 69, "after the engine failed: rank 3 unkillable; exiting 69"),
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
    with open(path, "w") as handle:
        handle.write("[" * 5000 + "]" * 5000)  # deeper than the JSON reader's recursion: malformed too
    with pytest.raises(ValueError, match="malformed"):
        read_outcomes(directory)
    os.unlink(path)
    os.symlink("/etc/passwd", path)
    with pytest.raises(OSError):
        read_outcomes(directory)  # O_NOFOLLOW: never a file the link points to


def test_a_record_with_fields_of_a_newer_version_is_read_for_what_it_knows(tmp_path: os.PathLike[str]) -> None:
    """Another host's newer package may write more fields: its verdict still decides the status."""
    with open(os.path.join(str(tmp_path), "outcome.1.json"), "w") as handle:
        handle.write('{"state": "failed", "message": "x", "restartable": false, "exit_code": 76, "pid": 1, '
                     '"added_later": [1]}')
    (outcome,) = read_outcomes(str(tmp_path))
    assert (outcome.state, outcome.exit_code, outcome.restartable) == ("failed", 76, False)


# ------------------------------------------------------------------ switching on: the hook, the settings, the line

HOOKED = ("import sys; print('hooked' if getattr(sys.meta_path[0], '_target', None) == 'tensorrt_llm.executor.proxy' "
          "else 'not hooked')")


def launch_env(**variables: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key not in ("TRTLLM_WORKER_LIVENESS", "PYTHONPATH")}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    return {**env, **variables}


def launch_with(*argv: str, **variables: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *argv], capture_output=True, text=True, timeout=60 * WAIT_SCALE, check=False,
                          env=launch_env(**variables))


def liveness_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("trtllm-liveness: worker liveness")]


def test_the_command_gets_the_hook_and_one_line_says_the_settings() -> None:
    done = launch_with(sys.executable, "-c", HOOKED)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "hooked", done.stderr  # TRTLLM_WORKER_LIVENESS unset: launch means on
    lines = liveness_lines(done.stderr)
    assert len(lines) == 1 and "worker liveness on (d_state_timeout_s=30, " in lines[0], done.stderr
    assert "exit_on_fatal=0" in lines[0] and "hosts=auto" in lines[0], lines

    tuned = launch_with("sh", "-c", f'exec python -c "{HOOKED}"',
                        TRTLLM_WORKER_LIVENESS="exit_on_fatal=1,quarantine_dir=/run/q,d_state_timeout_s=5")
    assert tuned.stdout.strip() == "hooked", tuned.stderr  # a Python the command starts later, too
    (line,) = liveness_lines(tuned.stderr)
    # The usual settings always, any other only where it is not the default.
    assert "d_state_timeout_s=5," in line and "exit_on_fatal=1" in line and "quarantine_dir=/run/q" in line, line
    assert "shutdown_grace_s" not in line, line

    # "python" is found on the PATH launch_env sets, so the command stays within the line's 160 characters
    # wherever the clone lies; a longer one is cut to them.
    off = launch_with("python", "-c", HOOKED, TRTLLM_WORKER_LIVENESS="0")
    assert off.returncode == 0 and off.stdout.strip() == "not hooked", off.stderr
    assert liveness_lines(off.stderr) == [f"trtllm-liveness: worker liveness off (TRTLLM_WORKER_LIVENESS=0) for: "
                                          f"python -c {HOOKED}"]
    long_argument = "x" * 200
    cut = launch_with("echo", long_argument, TRTLLM_WORKER_LIVENESS="0")
    assert cut.returncode == 0 and cut.stdout.strip() == long_argument, cut.stderr
    (cut_line,) = liveness_lines(cut.stderr)
    shown = cut_line.split(" for: ", 1)[1]
    assert len(shown) == 160 and shown == f"echo {long_argument}"[:157] + "...", cut_line


def test_a_malformed_setting_starts_nothing(tmp_path: os.PathLike[str]) -> None:
    marker = os.path.join(tmp_path, "ran")
    done = launch_with("sh", "-c", f"touch {marker}", TRTLLM_WORKER_LIVENESS="exit_on_fatal=1,d_state_timeout_s=soon")
    assert done.returncode == 78, done.stderr  # EX_CONFIG, as the autoload launcher's
    assert "TRTLLM_WORKER_LIVENESS: d_state_timeout_s must be a number, got 'soon'; nothing started" in done.stderr
    assert not os.path.exists(marker)
    unknown = launch_with("true", TRTLLM_WORKER_LIVENESS="d_state_timout_s=5")
    assert unknown.returncode == 78 and "unknown key 'd_state_timout_s'" in unknown.stderr


def test_a_missing_command_is_127() -> None:
    done = launch_with("no-such-launcher-anywhere")
    assert done.returncode == 127
    assert "command not found: no-such-launcher-anywhere" in done.stderr


def fake_launcher(directory: str, name: str, version: str) -> str:
    """An executable ``name`` that answers ``--version`` with ``version`` and otherwise prints its
    arguments and the three variables, one per line: a stand-in for a launcher of another MPI."""
    path = os.path.join(directory, name)
    with open(path, "w") as handle:
        handle.write(f'#!/bin/sh\nif [ "$1" = --version ]; then echo "{version}"; exit 0; fi\n'
                     'echo "ARGV $*"; echo "PP $PYTHONPATH"; echo "SW $TRTLLM_WORKER_LIVENESS"\n'
                     'echo "OUT $TRTLLM_LIVENESS_OUTCOME"\n')
    os.chmod(path, 0o755)
    return path


def test_each_launcher_gets_what_carries_the_switch_to_other_hosts(tmp_path: os.PathLike[str]) -> None:
    from trtllm_liveness.integrations.trtllm_autoload import SITE_DIR

    directory = str(tmp_path)
    openmpi = launch_with(fake_launcher(directory, "mpirun", "mpirun (Open MPI) 5.0.11"), "-n", "2", "app")
    assert "ARGV -x PYTHONPATH -x TRTLLM_WORKER_LIVENESS -x TRTLLM_LIVENESS_OUTCOME -n 2 app" in openmpi.stdout
    assert f"PP {SITE_DIR}" in openmpi.stdout and "SW 1" in openmpi.stdout and "OUT /" in openmpi.stdout
    assert "forwarded to every host: mpirun -x PYTHONPATH" in openmpi.stderr

    hydra = launch_with(fake_launcher(directory, "mpiexec", "HYDRA build details:"), "-n", "2", "app")
    assert "ARGV -n 2 app" in hydra.stdout and "(Hydra) passes the environment" in hydra.stderr

    unknown = launch_with(fake_launcher(directory, "mpiexec.other", "something else"), "app")
    assert "ARGV app" in unknown.stdout
    assert "NOTE: mpiexec.other --version names neither Open MPI nor MPICH/Hydra" in unknown.stderr


@pytest.mark.parametrize(("given", "expected", "note"), [
    ([], [], "srun exports the environment"),
    (["--export=ALL,FOO=1"], ["--export=ALL,FOO=1"], "srun --export=ALL"),
    (["--export=FOO,PYTHONPATH"], ["--export=FOO,PYTHONPATH,TRTLLM_WORKER_LIVENESS,TRTLLM_LIVENESS_OUTCOME"],
     "with their names"),
    (["--export", "FOO"], ["--export", "FOO,PYTHONPATH,TRTLLM_WORKER_LIVENESS,TRTLLM_LIVENESS_OUTCOME"],
     "with their names"),
    (["--export=NONE"], ["--export=NONE"], "ranks on other nodes run unprotected"),
])
def test_srun_exports_the_variables(given: list[str], expected: list[str], note: str) -> None:
    from trtllm_liveness.cli._launcher_env import forwarding_for

    forwarding = forwarding_for(["srun", "-N", "2", *given, "app"], {})
    assert list(forwarding.argv) == ["srun", "-N", "2", *expected, "app"]
    assert note in forwarding.how + forwarding.problem
    env = forwarding_for(["srun", "app"], {"SLURM_EXPORT_ENV": "FOO"}).env
    assert env["SLURM_EXPORT_ENV"] == "FOO,PYTHONPATH,TRTLLM_WORKER_LIVENESS,TRTLLM_LIVENESS_OUTCOME"


@pytest.mark.parametrize("argv", [
    ["srun", "-N2", "python", "train.py", "--export=model.onnx"],
    ["srun", "--exclusive", "python", "train.py", "--export", "model.onnx"],
    ["srun", "-N", "2", "--ntasks-per-node", "4", "app", "--export=ALL,x"],
    ["srun", "--", "app", "--export=NONE"],
])
def test_srun_never_rewrites_the_programs_own_arguments(argv: list[str]) -> None:
    # Only srun's own options are read: a program argument spelt like srun's --export is the
    # program's, and SLURM_EXPORT_ENV then carries the names instead.
    from trtllm_liveness.cli._launcher_env import forwarding_for

    forwarding = forwarding_for(argv, {"SLURM_EXPORT_ENV": "FOO"})
    assert list(forwarding.argv) == argv
    assert forwarding.env["SLURM_EXPORT_ENV"].split(",")[0] == "FOO"


# A failure whose message (up to 4000 characters) and snapshot are large and not ASCII: every
# character escapes to 6 or 12 bytes in the record.
HUGE_FAILURE = (
    "from trtllm_liveness.exit._snapshot_record import FatalSnapshot as F, RankSnapshot as R; "
    "ranks = tuple(R(n, 1000 + n, 'h\\u00f6st-\\U0001f600' * 20, 'R', 'w\\u00e4it', 'spinning', n, 'faulthandler', "
    "tuple('fr\\u00e4me-\\U0001f600-%d (x.py:1)' % i for i in range(40))) for n in range(72)); "
    "o.record_outcome('r\\u00e4nk 3 died: ' + '\\U0001f600' * 5000, True, 7).join(5); "
    "o.record_snapshot(F('d\\u00efed of rank 3' * 50, 1.0, 2.0, 'rank 3 \\U0001f600 gone' * 100, ranks, 3)).join(5)")


def test_a_huge_failure_record_stays_valid_json_and_the_launcher_honours_it() -> None:
    done = engine(HUGE_FAILURE, 0)
    assert done.returncode == 7, done.stderr
    assert "ignoring the outcome files" not in done.stderr and "the engine failed: r\u00e4nk 3" in done.stderr


def test_a_malformed_snapshot_field_leaves_the_record_honoured(tmp_path: Path) -> None:
    directory = str(tmp_path)
    with open(os.path.join(directory, "outcome.77.json"), "w", encoding="utf-8") as out:
        out.write('{"state": "failed", "message": "rank 1 died", "restartable": true, "exit_code": 9, "pid": 77, '
                  '"snapshot": {"reason": 5}}')
    (outcome,) = read_outcomes(directory)
    assert (outcome.state, outcome.exit_code, outcome.snapshot) == ("failed", 9, None)


# ------------------------------------------------------------------ the outcome pipe: first, synchronous, once

def test_a_failure_reaches_the_wrapper_when_the_process_ends_at_once_without_any_hook() -> None:
    """Open MPI's abort: the process ends with 14 right after its fatal path began, no exit hook,
    no thread run. The pipe's write is done before ``record_outcome`` returns."""
    done = engine("o.record_outcome('rank 1 died', True, 3); os._exit(14)")
    assert done.returncode == 3, done.stderr
    assert "exited 14 (Open MPI's abort) after the engine failed: rank 1 died; exiting 3" in done.stderr


RACE = """
import os, sys, threading
from trtllm_liveness.exit import _outcome as o
o.mark_running(3)
go = threading.Barrier(8)
def fail(n):
    go.wait()
    o.record_outcome('rank %d died' % n, n % 2 == 0, 3 if n % 2 == 0 else 69)
threads = [threading.Thread(target=fail, args=(n,)) for n in range(8)]
[t.start() for t in threads]
[t.join() for t in threads]
os._exit(14)
"""


def test_racing_failures_of_one_process_send_one_line(tmp_path: Path) -> None:
    """Eight threads' fatal paths at once: one failure line, its status the one the wrapper exits with."""
    from trtllm_liveness.exit._outcome import OUTCOME_ENV
    from trtllm_liveness.exit._outcome_pipe import OutcomePipe

    for _ in range(5):
        directory = tempfile.mkdtemp(dir=tmp_path)
        pipe = OutcomePipe(directory)
        try:
            child = subprocess.Popen([sys.executable, "-c", RACE], env={**os.environ, OUTCOME_ENV: directory},
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            _, stderr = child.communicate(timeout=30 * WAIT_SCALE)
            assert child.returncode == 14, stderr
            failures = pipe.read_failures()
        finally:
            pipe.close()
        assert len(failures) == 1, failures
        assert failures[0].exit_code == (3 if failures[0].restartable else 69)
        assert failures[0].pid == child.pid and failures[0].start_time is not None


def test_the_fatal_path_never_waits_on_the_outcome_files_lock() -> None:
    """A write of the outcome file stuck on its file system (a hung shared ``--outcome-dir``) holds
    the file's lock: the failure and its turn to unrestartable still reach the wrapper at once. (A
    fatal path that waited would hang here: the timer ends such a process with 99, read as 3.)"""
    hold = ("import threading; threading.Timer(20, os._exit, (99,)).start(); "
            "from trtllm_liveness.exit._process_ending import process_ending; "
            "process_ending().outcome.lock.acquire(); "
            "o.record_outcome('rank 1 died', True, 3); o.record_unrestartable('rank 2 unkillable', 69); os._exit(14)")
    done = engine(hold, code=3)
    assert done.returncode == 69, done.stderr
    assert "after the engine failed: rank 2 unkillable; exiting 69" in done.stderr


UNRESTARTABLE_FILE = """
import sys
from trtllm_liveness.exit import _outcome as o
from trtllm_liveness.exit._snapshot_record import FatalSnapshot
o.mark_running(3)
o.record_outcome('rank 1 died', True, 3).join(10)
snapshot = lambda: o.record_snapshot(FatalSnapshot('died of rank 1', 1.0e9, 12.0, 'rank 1 is gone', (), 1)).join(10)
turn = lambda: o.record_unrestartable('rank 2 unkillable', 69).join(10)
for step in sys.argv[1:]:
    {"snapshot": snapshot, "turn": turn}[step]()
assert o.record_unrestartable('rank 2 unkillable', 69) is None  # once
sys.exit(14)
"""


@pytest.mark.parametrize("order", [("snapshot", "turn"), ("turn", "snapshot")])
def test_a_failure_turned_unrestartable_is_rewritten_in_its_file_with_its_snapshot(tmp_path: Path,
                                                                                   order: tuple[str, str]) -> None:
    """Where the pipe brought nothing (no FIFO, a wrapper on another host), the file decides: it must
    say "do not restart here" after a rank was left unkillable, with the snapshot, in either order."""
    from trtllm_liveness.exit._outcome import OUTCOME_ENV

    done = subprocess.run([sys.executable, "-c", UNRESTARTABLE_FILE, *order],
                          env={**os.environ, OUTCOME_ENV: str(tmp_path)},
                          capture_output=True, text=True, timeout=30 * WAIT_SCALE, check=False)
    assert done.returncode == 14, done.stderr
    (outcome,) = read_outcomes(str(tmp_path))
    assert (outcome.state, outcome.exit_code, outcome.restartable) == ("failed", 69, False)
    assert outcome.message == "rank 1 died"
    assert outcome.snapshot is not None and outcome.snapshot.reason == "died of rank 1"


def test_the_pipe_refuses_what_is_not_a_failure_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Another writer's bytes (garbage, bad fields, a line longer than any engine writes) are logged
    and dropped; the good line between them is read; nothing raises."""
    from trtllm_liveness.exit._outcome_pipe import LINE_LIMIT, OutcomePipe, PipedFailure, encode_failure, open_writer

    directory = str(tmp_path)
    pipe = OutcomePipe(directory)
    writer = open_writer(directory)
    try:
        assert writer >= 0
        good = encode_failure(PipedFailure("rank 4 died", True, 3, 4242, 17))
        for chunk in (b"not json\n", b'{"state":"failed","exit_code":0,"pid":1}\n', good,
                      b'{"state":"clean"}\n', b"[" * 3000 + b"\n", b"x" * (LINE_LIMIT + 10)):
            os.write(writer, chunk)
        with caplog.at_level("WARNING"):
            failures = pipe.read_failures()
            failures += pipe.read_failures()
        assert failures == [PipedFailure("rank 4 died", True, 3, 4242, 17)]
        assert "over-long line" in caplog.text and caplog.text.count("malformed line") == 4
        assert len(encode_failure(PipedFailure("\U0001f600" * 4000, False, 69, 1, None))) <= LINE_LIMIT
    finally:
        os.close(writer)
        pipe.close()
        pipe.close()  # once: a second close releases nothing


def test_no_pipe_where_nobody_reads_or_the_name_is_not_a_fifo(tmp_path: Path) -> None:
    from trtllm_liveness.exit._outcome_pipe import PIPE_NAME, open_writer

    directory = str(tmp_path)
    assert open_writer(directory) == -1  # none made
    os.mkfifo(os.path.join(directory, PIPE_NAME))
    assert open_writer(directory) == -1  # no reader: a write would find nobody
    os.unlink(os.path.join(directory, PIPE_NAME))
    Path(directory, PIPE_NAME).write_text("")
    assert open_writer(directory) == -1  # a plain file is not the wrapper's pipe


# ------------------------------------------------------------------ the job ends after its engine failed

# The launcher's shape after a lost host: its engine process (rank 0) failed and exited, and the
# launcher stays (PRRTE waits for the cut-off host's daemon), deaf to SIGTERM.
OUTLIVING = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
             "subprocess.run([sys.executable, '-c', {inner!r}]); print('engine gone', flush=True); time.sleep(600)")


def test_a_launcher_that_outlives_its_failed_engine_is_ended() -> None:
    inner = ENGINE.format(code=3, then="o.record_outcome('hostB lost', True, 3)", status=14)
    done = launch(sys.executable, "-c", OUTLIVING.format(inner=inner))
    assert done.returncode == 3, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("trtllm-liveness launch:")]
    assert lines[0].endswith(": SIGTERM") and ": SIGKILL to it" in lines[1], lines
    assert "after the failed engine process exited (pid" in lines[0], lines
    assert lines[2].endswith("exited 137 after the engine failed: hostB lost; exiting 3"), lines


def test_with_exit_on_fatal_a_failed_process_that_stays_up_is_ended_after_the_guards_bound() -> None:
    """Its own exit guard would end it after exit_delay_s + exit_timeout_s; here nothing does."""
    then = "o.record_outcome('rank 1 wedged', False, 69); import time; time.sleep(600)"
    done = launch_with(sys.executable, "-c", ENGINE.format(code=3, then=then, status=0),
                       TRTLLM_WORKER_LIVENESS="exit_on_fatal=1,exit_delay_s=0.1,exit_timeout_s=0.5,"
                                              "shutdown_term_s=0.5,shutdown_kill_s=0.5")
    assert done.returncode == 69, done.stderr
    assert "ending python" in done.stderr and ": SIGTERM" in done.stderr and "SIGKILL" not in done.stderr
    assert "exited 143 after the engine failed: rank 1 wedged; exiting 69" in done.stderr


def test_without_exit_on_fatal_a_failed_process_keeps_its_job() -> None:
    """A server that answers its health check with the failure is the orchestrator's to end."""
    then = "o.record_outcome('rank 1 died', True, 3); import time; time.sleep(4)"
    done = launch_with(sys.executable, "-c", ENGINE.format(code=3, then=then, status=0),
                       TRTLLM_WORKER_LIVENESS="1")
    assert done.returncode == 3, done.stderr
    assert "ending " not in done.stderr and "exited 0, but the engine failed: rank 1 died" in done.stderr


# The launcher's engine child fails and stays up, deaf to SIGTERM (a server wedged in its own
# shutdown), as does the launcher.
DEAF = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "subprocess.Popen([sys.executable, '-c', {inner!r}]); time.sleep(600)")


def test_at_the_end_the_failed_engine_process_is_killed_with_its_launcher() -> None:
    then = "signal.signal(signal.SIGTERM, signal.SIG_IGN); o.record_outcome('rank 1 died', True, 3); " \
        "import time; time.sleep(600)"
    inner = ENGINE.format(code=3, then=then, status=0)
    done = launch_with(sys.executable, "-c", DEAF.format(inner=inner),
                       TRTLLM_WORKER_LIVENESS="exit_on_fatal=1,exit_delay_s=0.1,exit_timeout_s=0.5,"
                                              "shutdown_term_s=0.5,shutdown_kill_s=0.5")
    assert done.returncode == 3, done.stderr
    killed = [line for line in done.stderr.splitlines() if "SIGKILL to it and the failed engine process" in line]
    assert len(killed) == 1, done.stderr
    pid = int(killed[0].split("failed engine process (pid ")[1].split(")")[0])
    assert wait_until(lambda: state_of(pid) in (None, "Z"), 10 * WAIT_SCALE), f"engine process {pid} survives"


FOREIGN = ("import json, os, time; fd = os.open(os.path.join(os.environ['TRTLLM_LIVENESS_OUTCOME'], 'outcome.fifo'), "
           "os.O_WRONLY); os.write(fd, json.dumps({{'state': 'failed', 'message': 'rank 5 died', 'restartable': True, "
           "'exit_code': 3, 'pid': {pid}, 'start_time': 1, 'pid_ns': 1}}).encode() + b'\\n'); time.sleep(4)")


def test_a_failure_of_another_pid_namespace_is_never_taken_for_a_process_here() -> None:
    """Its pid means nothing here (another container's engine on a shared outcome directory): the
    wrapper neither watches nor signals a process by it, and the launcher is left to end by itself."""
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True).stdout.strip()  # a pid with no process behind it now
    done = launch_with(sys.executable, "-c", FOREIGN.format(pid=gone), TRTLLM_WORKER_LIVENESS="1")
    assert done.returncode == 3, done.stderr
    assert "ending " not in done.stderr and "exited 0, but the engine failed: rank 5 died" in done.stderr
