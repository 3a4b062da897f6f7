"""The Open MPI environment of the reference executor, and the PRRTE session-directory collision.

A SIGKILLed launcher leaves ``<tmpdir>/prte.<pid>/`` behind; once the pid counter wraps (pid_max is
32768 here) a new ``prte`` with that pid fails with "The PMIx server's listener thread failed to
start" and mpi4py's futures hang forever. This happened in CI. ``configure_mpi_env`` gives every
launching process a fresh PRRTE session base, which the test below proves against a real collision.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.support.children import REPO_ROOT, HelperProcess
from tests.support.facilities import needs, require_facility
from tests.support.leftovers import remove_orphaned_prte_tmpdirs
from tests.support.process_tracker import ProcessTracker
from tests.support.waits import WAIT_SCALE, wait_until
from trtllm_liveness.demo._mpi_env import PRTE_TMPDIR_PREFIX, PRTE_TMPDIR_VAR, configure_mpi_env

require_facility("mpi", allow_module_level=True)

NS_LAST_PID = Path("/proc/sys/kernel/ns_last_pid")
LISTENER_FAILED = "listener thread failed to start"
PLANTED = 300  # pids planted after the position: covers the helper, its threads and prte


def test_private_prte_tmpdir_is_fresh_and_user_value_wins() -> None:
    env: dict[str, str] = {}
    configure_mpi_env(env)
    base = Path(env[PRTE_TMPDIR_VAR])
    assert base.is_dir() and not any(base.iterdir())
    assert base.name.startswith(f"{PRTE_TMPDIR_PREFIX}{os.getpid()}-")
    assert base.parent == Path(tempfile.gettempdir())
    again: dict[str, str] = {}
    configure_mpi_env(again)
    assert again[PRTE_TMPDIR_VAR] == str(base)  # one per process, not one per call

    exported = {PRTE_TMPDIR_VAR: "/somewhere/else"}
    configure_mpi_env(exported)
    assert exported[PRTE_TMPDIR_VAR] == "/somewhere/else"


def test_private_prte_tmpdir_is_removed_when_its_process_exits(tmp_path: Path) -> None:
    code = (
        "import os; from trtllm_liveness.demo._mpi_env import configure_mpi_env, PRTE_TMPDIR_VAR\n"
        "configure_mpi_env(); base = os.environ[PRTE_TMPDIR_VAR]\n"
        "open(os.path.join(base, 'prte.1'), 'w').close(); print(base, flush=True)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True,
                          env={**os.environ, "TMPDIR": str(tmp_path)}, timeout=60, check=True)
    base = Path(done.stdout.strip())
    assert base.parent == tmp_path
    assert not base.exists()


def test_a_scenario_child_ending_with_os_exit_removes_its_prte_tmpdir(tmp_path: Path) -> None:
    from trtllm_liveness.demo._scenario_launcher import run_scenario

    run = run_scenario({"mode": "main", "fault": "none", "tokens": 3, "observe_s": 10.0},
                       60 * WAIT_SCALE, env={"TMPDIR": str(tmp_path)})
    assert run.survivors == () and run.done and run.returncode == 0, run.problems()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(PRTE_TMPDIR_PREFIX)] == []


def test_orphaned_prte_tmpdirs_are_removed_and_live_ones_kept(procs: ProcessTracker, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = procs.sleeper()
    live = procs.sleeper()
    dead.kill()
    dead.wait(10)
    orphan = tmp_path / f"{PRTE_TMPDIR_PREFIX}{dead.pid}-abc"
    owned = tmp_path / f"{PRTE_TMPDIR_PREFIX}{live.pid}-def"
    for base in (orphan, owned):
        (base / f"prte.{base.name}").mkdir(parents=True)
    assert remove_orphaned_prte_tmpdirs() == [str(orphan)]
    assert not orphan.exists() and owned.exists()


def _can_position_pids() -> str | None:
    if not os.access(NS_LAST_PID, os.W_OK):
        return f"{NS_LAST_PID} is not writable (needs CAP_SYS_ADMIN over this pid namespace)"
    return None


def _plant_stale_sessions(base: Path, first_pid: int) -> None:
    """What a SIGKILLed prte leaves behind, for ``first_pid .. first_pid + PLANTED``."""
    host = socket.gethostname()
    for pid in range(first_pid, first_pid + PLANTED):
        session = base / f"prte.{pid}"
        session.mkdir()
        for name in {host, host.split(".")[0]}:
            (session / f"pmix.{name}.tool").write_text("stale\n")
            (session / f"pmix.{name}.tool.{pid}").write_text("stale\n")


def _spawn_at(first_pid: int, env: dict[str, str]) -> HelperProcess:
    """Start the spawning helper with the pid counter just below ``first_pid``."""
    NS_LAST_PID.write_text(str(first_pid - 1))
    return HelperProcess("mpi_spawn", {}, env=env)


@pytest.mark.timeout(240)
@needs("ns-last-pid")
def test_stale_prte_session_of_a_killed_launcher_cannot_break_the_spawn(tmp_path: Path) -> None:
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    first_pid = int(NS_LAST_PID.read_text()) + 2000
    if first_pid + 2 * PLANTED > pid_max:
        first_pid = 1000
    shared = tmp_path / "shared"  # stands for /tmp, where PRRTE puts prte.<pid> by default
    shared.mkdir()
    _plant_stale_sessions(shared, first_pid)

    # Control: a session base shared across launches (PRRTE's default) breaks as seen in CI.
    with _spawn_at(first_pid, {"TMPDIR": str(shared), PRTE_TMPDIR_VAR: str(shared)}) as control:
        assert wait_until(lambda: LISTENER_FAILED in control.stderr_tail() or not control.alive(), 60)
        assert LISTENER_FAILED in control.stderr_tail(), control.stderr_tail()

    # With the private base the same planted pids are harmless.
    with _spawn_at(first_pid, {"TMPDIR": str(shared), PRTE_TMPDIR_VAR: ""}) as fixed:
        record = fixed.read_record(60 * WAIT_SCALE, "ok")
        assert record["ok"] is True
        assert first_pid <= record["prte_pid"] < first_pid + PLANTED, "prte did not land on a planted pid"
        base = Path(record["prte_tmpdir_base"])
        assert base.parent == shared and base.name.startswith(PRTE_TMPDIR_PREFIX)
        assert fixed.wait_exit(60 * WAIT_SCALE) == 0, fixed.stderr_tail()
    assert not base.exists()
