"""``trtllm-liveness drill``: a real fault in an engine built through the LLM API of the installed
``tensorrt_llm``, here the upstream-shaped fakes of main and 1.2.x (tests/fakes; ``--engine
tests.support.drill_engine:fake_engine`` gives their ``LLM`` the ``FakeEngine`` it takes where
upstream takes a model), with real MPI ranks, real signals and the real freezer.

Each run is the installed console script in a session of its own with a ``TMPDIR`` of the test's;
afterwards no process carrying that ``TMPDIR`` may be left (the drill's engine process, ``prte``
and the ranks all inherit it), nor a file in it, nor a freezer group, nor a marker in the
quarantine directory the settings name: the drill leaves nothing. No timing is asserted.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import tmpdir_runs as runs
from tests.support.facilities import MPI_MARKS, needs
from tests.support.process_tracker import ProcessTracker
from tests.support.waits import WAIT_SCALE, wait_until
from trtllm_liveness.demo._cgroup_faults import FREEZER_ROOT
from trtllm_liveness.demo._mpi_env import PRTE_TMPDIR_VAR, configure_mpi_env
from trtllm_liveness.process import _procfs
from trtllm_liveness.quarantine._marker import MARKER_NAME, QuarantinedProcess, write_marker

pytestmark = [pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[3]
CLI = Path(sys.executable).parent / "trtllm-liveness"
FACTORY = "tests.support.drill_engine:fake_engine"


@pytest.fixture
def drill_tmp() -> Iterator[Path]:
    """A short TMPDIR of the test's own (tests/support/tmpdir_runs.py): ZMQ ipc paths live below it."""
    with runs.short_tmpdir("tdrill-") as path:
        yield path


def _env(tmpdir: Path, tree: str, liveness: str | None) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key not in ("TRTLLM_WORKER_LIVENESS", "PYTHONPATH")}
    configure_mpi_env(env)
    (tmpdir / "prte").mkdir(exist_ok=True)
    env[PRTE_TMPDIR_VAR] = str(tmpdir / "prte")  # removed with the test's directory
    env["TMPDIR"] = str(tmpdir)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "tests" / "fakes" / tree), str(REPO)])
    if liveness is not None:
        env["TRTLLM_WORKER_LIVENESS"] = liveness
    return env


def _start(procs: ProcessTracker, tmpdir: Path, *args: str, tree: str = "trtllm_main",
           liveness: str | None = None) -> subprocess.Popen[bytes]:
    return runs.start(procs, [str(CLI), "drill", "/models/drill-test", "--engine", FACTORY, *args],
                      _env(tmpdir, tree, liveness))


def _finish(proc: subprocess.Popen[bytes], tmpdir: Path) -> tuple[int, str, str]:
    return runs.finish(proc, tmpdir, allowed=["prte"])  # the test's own PRRTE session base


def _freezer_groups() -> list[str]:
    with contextlib.suppress(OSError):
        return sorted(name for name in os.listdir(FREEZER_ROOT) if name.startswith("trtllm-liveness-drill"))
    return []


def _real_mpi(test: Any) -> Any:
    for mark in MPI_MARKS:
        test = mark(test)
    return test


@_real_mpi
@pytest.mark.parametrize("tree", ["trtllm_main", "trtllm_v12"])
def test_a_killed_rank_is_detected_and_nothing_is_left(tree: str, procs: ProcessTracker, drill_tmp: Path) -> None:
    proc = _start(procs, drill_tmp, "--tp", "2", "--json", tree=tree, liveness="exit_on_fatal=1,exit_code=3")
    status, out, err = _finish(proc, drill_tmp)
    assert status == 0, (out, err)
    record = json.loads(out)
    assert record["tensorrt_llm"] == {"trtllm_main": "1.3.0.dev0+main", "trtllm_v12": "1.2.1"}[tree]
    assert (record["fault"], record["rank"], record["tp"]) == ("kill", 1, 2)
    assert record["verdict"]["kind"] == "detected" and record["ok"] is True, record
    assert record["detected_ms"] is not None and record["health_false_ms"] is not None
    assert record["requests_failed_ms"] is not None and record["pending"] == 0 and record["requests"] == 4
    assert f"rank 1 (pid {record['pid']})" in record["fatal"], record
    # What a server with these settings would do, which the drill itself did not (it exited 0).
    assert record["would_exit_status"] == 3 and "exit_on_fatal=1" in record["would_exit"]
    assert record["would_leave_marker"].startswith("none at "), record  # a death is restartable
    assert record["processes_left"] == []


@_real_mpi
@needs("freezer")
def test_a_wedge_names_the_exit_status_and_marker_it_would_leave_and_leaves_neither(
        procs: ProcessTracker, drill_tmp: Path, tmp_path: Path) -> None:
    quarantine = tmp_path / "quarantine"
    quarantine.mkdir(mode=0o755)
    proc = _start(procs, drill_tmp, "--tp", "2", "--fault", "wedge",
                  liveness=f"d_state_timeout_s=1,scan_interval_s=0.2,shutdown_grace_s=1,shutdown_term_s=0.5,"
                           f"shutdown_kill_s=1,exit_on_fatal=1,quarantine_dir={quarantine},quarantine_slurm_drain=1")
    status, out, err = _finish(proc, drill_tmp)
    assert status == 0, (out, err)
    assert "verdict: detected: wedged of rank 1" in out, out
    assert "would: exit with status 69 (not restartable on this host; exit_on_fatal=1)" in out, out
    assert f"quarantine marker it would leave: {quarantine / MARKER_NAME}: pid " in out and "state D" in out, out
    assert "and would run: Slurm drain of this node (quarantine_slurm_drain=1)" in out, out
    assert "unkillable after SIGKILL" in out and "processes left: none" in out, out
    assert list(quarantine.iterdir()) == [], "the drill left a marker in the configured directory"
    assert _freezer_groups() == []


@_real_mpi
def test_a_stop_is_caught_with_stall_detection_and_said_not_to_be_without(procs: ProcessTracker,
                                                                         drill_tmp: Path) -> None:
    caught = _start(procs, drill_tmp, "--tp", "2", "--fault", "stop", "--json",
                    liveness="stall_timeout_s=1,stall_action=fatal,shutdown_grace_s=1")
    status, out, err = _finish(caught, drill_tmp)
    assert status == 0, (out, err)
    record = json.loads(out)
    assert record["verdict"]["kind"] == "detected" and "stalled" in record["verdict"]["text"], record
    assert record["tokens_stopped_ms"] is not None

    missed = _start(procs, drill_tmp, "--tp", "2", "--fault", "stop", "--json", tree="trtllm_v12",
                    liveness="shutdown_grace_s=1")
    status, out, err = _finish(missed, drill_tmp)
    assert status == 1, (out, err)
    record = json.loads(out)
    assert record["verdict"]["kind"] == "not_detected" and record["pending"] == 4, record
    assert "set stall_timeout_s (and stall_action=fatal)" in record["verdict"]["text"]
    assert record["processes_left"] == [] and record["shutdown_ms"] is not None  # bounded all the same


@_real_mpi
def test_sigterm_mid_drill_cleans_up(procs: ProcessTracker, drill_tmp: Path) -> None:
    """A drill ended while its ranks run (model loaded, requests streaming, before the fault is
    watched to its end): status 143, every rank and file gone."""
    proc = _start(procs, drill_tmp, "--tp", "2", "--fault", "stop")
    started = wait_until(lambda: runs.ranks_up(drill_tmp) or proc.poll() is not None, 120 * WAIT_SCALE)
    assert started, "the ranks never started"
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(signal.SIGTERM)
    status, out, err = _finish(proc, drill_tmp)
    assert status == 143, (out, err)
    assert "terminated (SIGTERM); its processes and files are removed" in err


def test_a_quarantined_host_is_refused_and_nothing_starts(procs: ProcessTracker, drill_tmp: Path,
                                                           tmp_path: Path) -> None:
    stuck = procs.sleeper()  # stands for an earlier engine's worker still on this host
    info = _procfs.read_stat(stuck.pid)
    quarantine = tmp_path / "quarantine"
    quarantine.mkdir(mode=0o755)
    write_marker(str(quarantine), [QuarantinedProcess(pid=stuck.pid, start_time=info.start_time,
                                                      pid_namespace=os.stat("/proc/self/ns/pid").st_ino, rank=1,
                                                      state="D", wchan="nv_wait", kind="wedged", cause="test")],
                 "rank 1 wedged")
    proc = _start(procs, drill_tmp, liveness=f"quarantine_dir={quarantine}")
    status, out, err = _finish(proc, drill_tmp)
    assert status == 3, (out, err)
    assert "refusing to run: this host is quarantined" in err and f"pid {stuck.pid}" in err, err
    assert out == ""
    assert (quarantine / MARKER_NAME).exists()  # read, never cleared


def test_without_tensorrt_llm_nothing_starts_and_the_status_says_the_drill_could_not_run(
        procs: ProcessTracker, drill_tmp: Path) -> None:
    env = _env(drill_tmp, "trtllm_main", None)
    env["PYTHONPATH"] = str(REPO)  # the package and the tests, no tensorrt_llm (the fakes are not on the path)
    proc = runs.start(procs, [str(CLI), "drill", "/models/llama", "--tp", "2"], env)
    status, out, err = _finish(proc, drill_tmp)
    assert status == 4, (status, out, err)
    assert err == (f"trtllm-liveness: drill: TensorRT-LLM is not installed (tensorrt_llm is not importable by "
                   f"{sys.executable}): no engine to drill; nothing started\n"), err
    assert out == ""


@_real_mpi
def test_an_engine_that_does_not_start_is_could_not_run_not_a_missed_fault(procs: ProcessTracker,
                                                                             drill_tmp: Path) -> None:
    proc = runs.start(procs, [str(CLI), "drill", "/models/drill-test", "--tp", "2", "--engine",
                              "tests.support.drill_engine:no_such_factory"], _env(drill_tmp, "trtllm_main", None))
    status, out, err = _finish(proc, drill_tmp)
    assert status == 4, (status, out, err)
    assert "drill: the engine did not start streaming: " in err and "no_such_factory" in err, err
    assert out == ""


@pytest.mark.parametrize(("liveness", "says"), [
    ("d_state_timeout_s=soon", "d_state_timeout_s must be a number, got 'soon'; nothing started"),
    ("stall_action=panic", "stall_action must be one of report, fatal"),
])
def test_an_invalid_setting_starts_nothing(liveness: str, says: str, procs: ProcessTracker, drill_tmp: Path) -> None:
    proc = _start(procs, drill_tmp, liveness=liveness)
    status, out, err = _finish(proc, drill_tmp)
    assert status == 78 and says in err and out == "", err
