"""``trtllm-liveness demo``: arguments, the timeline's wording and order, ``--compare``, and that
nothing the demo starts outlives it (files in its ``TMPDIR``, processes) on any way out.

The MPI tests run the installed console script as a child with a ``TMPDIR`` of their own and
look, after it exits, at that directory and at every process carrying that ``TMPDIR`` in its
environment (the scenario child, ``prte`` and the ranks all inherit it). Nothing asserts on timing.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
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
from tests.support.stuck_processes import Freezer
from tests.support.waits import WAIT_SCALE, wait_until
from trtllm_liveness.demo import _demo_run as demo
from trtllm_liveness.demo._scenario_records import (
    Detection,
    ScenarioOptions,
    ScenarioResult,
    ScenarioRun,
    ShutdownOutcome,
    Victim,
)

pytestmark = [pytest.mark.timeout(240)]

CLI = Path(sys.executable).parent / "trtllm-liveness"
RUN_TIMEOUT = 120 * WAIT_SCALE


def _cli_missing() -> bool:
    return not CLI.exists()


# ------------------------------------------------------------------ arguments and help (no MPI)


@pytest.mark.skipif(_cli_missing(), reason="console script not installed next to sys.executable")
@pytest.mark.parametrize(("args", "message"), [
    (["--requests", "0"], "--requests must be between 1 and"),
    (["--requests", "0", "--json"], "--requests must be between 1 and"),
    (["--requests", "-3"], "--requests must be between 1 and"),
    (["--timeout", "0"], "--timeout must be a positive number"),
    (["--timeout", "nan"], "--timeout must be a positive number"),
    (["--stall-timeout", "-1"], "--stall-timeout must be a positive number"),
    (["--compare", "--compare-bound", "0"], "--compare-bound must be a positive number"),
    (["--workers", "1000"], "--workers must be >= 2 and <="),
])
def test_bad_arguments_get_a_clear_error_and_status_2(args: list[str], message: str, tmp_path: Path) -> None:
    done = subprocess.run([str(CLI), "demo", *args], capture_output=True, text=True, timeout=RUN_TIMEOUT,
                          check=False, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert done.returncode == 2, done
    assert message in done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    assert done.stdout == ""  # no JSON record, and no run: nothing was started
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(_cli_missing(), reason="console script not installed next to sys.executable")
def test_help_explains_the_short_bounds_and_compare() -> None:
    done = subprocess.run([str(CLI), "demo", "--help"], capture_output=True, text=True, timeout=RUN_TIMEOUT,
                          check=False)
    assert done.returncode == 0
    text = " ".join(done.stdout.split())  # argparse wraps the epilog
    assert "d_state_timeout_s=1 (default 30)" in text
    assert "shutdown_grace_s=1 (default 10)" in text
    assert "--compare-bound" in text


# ------------------------------------------------------------------ wording of the output (records)


def _result(fault: str = "kill", *, detection: Detection | None = None, liveness: bool = True,
            pending: int = 0, unkillable: tuple[int, ...] = (), frozen: tuple[int, ...] = (),
            by_harness: bool = False) -> ScenarioResult:
    return ScenarioResult(
        iteration=0, options=ScenarioOptions(fault=fault, liveness=liveness, observe_s=10.0), phase="serving",
        pids=(100, 101), victims=(Victim(1, 101),), in_flight=4, pending_not_done=pending, detection=detection,
        shutdown=ShutdownOutcome(shutdown_ms=None if by_harness else 95.0, by_harness=by_harness,
                                 unkillable=unkillable),
        survivors_while_frozen=frozen)


def _detection(detected: float | None, health: float | None, failed: float | None) -> Detection:
    return Detection(detected_ms=detected, health_false_ms=health, requests_failed_ms=failed, e2e_ms=None,
                     stall_detected_ms=None, floor_ms=None, pending_errors=(), new_request_error=None, window_s=10.0)


def test_timeline_is_in_time_order_and_explains_both_stamps() -> None:
    # The run the issue saw: the health probe that found the death was called before the
    # monitor's event was stamped (inside that very call).
    out = _result(detection=_detection(detected=13.6, health=12.5, failed=12.8))
    run = ScenarioRun(results=(out,), survivors=(), done=True)
    args = demo_args()
    lines = demo._single_lines(args, 1, out, run, ok=True)
    labels = [line.strip() for line in lines]
    order = [next(i for i, line in enumerate(labels) if line.startswith(label))
             for label in ("check_health() False", "every request failed", "detected by the monitor")]
    assert order == sorted(order)
    assert any("may itself have found the fault first" in line for line in lines)


def test_wedge_output_says_the_demo_released_the_unkillable_rank() -> None:
    out = _result("wedge", detection=_detection(1100.0, 1101.0, 1102.0), unkillable=(101,), frozen=(101,))
    run = ScenarioRun(results=(out,), survivors=(), done=True)
    text = "\n".join(demo._single_lines(demo_args(fault="wedge"), 1, out, run, ok=True))
    assert "unkillable after SIGKILL: pids [101] (host must be recycled)" in text
    released = text.index("the demo then thawed its freezer cgroup so pids [101] could die")
    assert released < text.index("processes left: none")


def test_wedge_output_explains_the_freezers_wait_channel() -> None:
    out = dataclasses.replace(_result("wedge", detection=_detection(1100.0, 1101.0, 1102.0)),
                              fatal_error="rank 1 (pid 101) ... in D for 1.0s (wchan hrtimer_nanosleep)")
    run = ScenarioRun(results=(out,), survivors=(), done=True)
    lines = demo._single_lines(demo_args(fault="wedge"), 1, out, run, ok=True)
    fatal = next(i for i, line in enumerate(lines) if line.startswith("  fatal error:"))
    assert "freezes a sleeping thread where it sleeps" in lines[fatal + 1], lines


@pytest.mark.freezer
def test_the_freezer_keeps_a_sleeping_threads_wait_channel(procs: ProcessTracker, freezer: Freezer) -> None:
    """What the note above says, on this kernel: a task frozen asleep keeps its sleep's wait
    channel; only a task frozen while running shows the freezer's own."""
    if tuple(int(part) for part in os.uname().release.split(".")[:2] if part.isdigit()) < (6, 1):
        pytest.skip("the freezer marks sleeping tasks frozen in place since Linux 6.1")
    sleeping = procs.sleeper()
    spinning = subprocess.Popen([sys.executable, "-c", "print('ready', flush=True)\nwhile True: pass"],
                                stdout=subprocess.PIPE, start_new_session=True)
    procs.popens.append(spinning)
    procs.track(spinning.pid)
    assert spinning.stdout is not None and spinning.stdout.readline() == b"ready\n"
    freezer.freeze([sleeping.pid, spinning.pid])
    wchan = {pid: Path(f"/proc/{pid}/wchan").read_text() for pid in (sleeping.pid, spinning.pid)}
    assert wchan[spinning.pid] == "__refrigerator", wchan
    assert wchan[sleeping.pid] not in ("__refrigerator", "", "0") and "sleep" in wchan[sleeping.pid], wchan


def test_output_names_the_short_bounds() -> None:
    out = _result(detection=_detection(3.0, 4.0, 5.0))
    text = "\n".join(demo._single_lines(demo_args(), 1, out, ScenarioRun((out,), (), True), ok=True))
    assert "demo bounds: d_state_timeout_s=1" in text and "see --help" in text


def test_off_verdicts_are_what_was_measured() -> None:
    hanging = ScenarioRun((_result(liveness=False, pending=3, detection=_detection(None, None, None),
                                   by_harness=True),), (), True)
    verdict = demo.off_verdict(hanging, 20.0, 10.0)
    assert (verdict.kind, verdict.pending, verdict.after_s) == ("hanging", 3, 10.0)
    assert verdict.text.startswith("still hanging after 10 s, 3 requests pending")

    served = ScenarioRun((_result(liveness=False, pending=0, detection=_detection(None, None, None),
                                  by_harness=True),), (), True)
    assert demo.off_verdict(served, 20.0, 10.0).kind == "served"

    noticed = ScenarioRun((_result(liveness=False, detection=_detection(None, 3.7, 4.2), by_harness=True),), (), True)
    assert demo.off_verdict(noticed, 20.0, 10.0).kind == "noticed"

    aborted = ScenarioRun((), (), False, returncode=14, exited_at=11.0, progress=({"fault_at": 10.5},))
    verdict = demo.off_verdict(aborted, 20.0, 10.0)
    assert verdict.kind == "aborted" and "500 ms after the fault (exit status 14)" in verdict.text
    seen = ScenarioRun((), (), False, returncode=14, exited_at=12.0,
                       progress=({"fault_at": 10.5}, {"observed": {"pending_not_done": 0, "health_false_ms": 3.2}}))
    assert "before that: check_health() False at 3 ms, 0 requests pending" in demo.off_verdict(seen, 20.0, 10.0).text

    # Aborted only when the demo killed the workers at the bound: that is a hang, cut.
    cut = ScenarioRun((), (), False, returncode=14, exited_at=21.0,
                      progress=({"fault_at": 10.5}, {"observed": {"pending_not_done": 4}}))
    verdict = demo.off_verdict(cut, 20.0, 10.0)
    assert (verdict.kind, verdict.pending) == ("hanging", 4)
    assert verdict.text.startswith("still hanging after 10 s, 4 requests pending")

    timed_out = ScenarioRun((), (), False, returncode=-9, timed_out=True)
    assert demo.off_verdict(timed_out, 20.0, 10.0).kind == "timed_out"


def demo_args(**changes: object) -> Any:
    import argparse

    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    args = parser.parse_args([])
    for key, value in changes.items():
        setattr(args, key, value)
    return args


# ------------------------------------------------------------------ real runs: nothing left behind


@pytest.fixture
def short_tmpdir() -> Iterator[Path]:
    """A TMPDIR of the test's own (tests/support/tmpdir_runs.py): the reference proxy's ZMQ ipc
    sockets live below it."""
    with runs.short_tmpdir("tdemo-") as path:
        yield path


def _start_demo(procs: ProcessTracker, tmpdir: Path, *args: str) -> subprocess.Popen[bytes]:
    return runs.start(procs, [str(CLI), "demo", *args], {**os.environ, "TMPDIR": str(tmpdir)})


def _assert_nothing_left(proc: subprocess.Popen[bytes], tmpdir: Path) -> tuple[int, str, str]:
    return runs.finish(proc, tmpdir)


def _real_mpi(test: Any) -> Any:
    for mark in MPI_MARKS:
        test = mark(test)
    return test


@_real_mpi
@pytest.mark.skipif(_cli_missing(), reason="console script not installed next to sys.executable")
@pytest.mark.parametrize("path", ["success", pytest.param("wedge", marks=needs("freezer")), "timeout",
                                  "timeout-0.5", "sigint", "sigterm"])
def test_nothing_is_left_on_any_exit_path(path: str, procs: ProcessTracker, short_tmpdir: Path) -> None:
    tmpdir = short_tmpdir
    args = {"success": ["--fault", "kill"], "wedge": ["--fault", "wedge"],
            # A stop run lasts at least its 1 s stall wait and 2 s of shutdown: both bounds hit.
            "timeout": ["--fault", "stop", "--timeout", "2"], "timeout-0.5": ["--fault", "stop", "--timeout", "0.5"],
            "sigint": ["--fault", "stop"], "sigterm": ["--fault", "stop"]}[path]
    proc = _start_demo(procs, tmpdir, *args)
    if path in ("sigint", "sigterm"):
        assert wait_until(lambda: runs.ranks_up(tmpdir) or proc.poll() is not None, 60), "the ranks never started"
        assert proc.poll() is None, "the demo ended before it could be interrupted"
        proc.send_signal(signal.SIGINT if path == "sigint" else signal.SIGTERM)
    status, out, err = _assert_nothing_left(proc, tmpdir)
    assert "Traceback" not in err
    expected = {"success": 0, "wedge": 0, "timeout": 1, "timeout-0.5": 1, "sigint": 130, "sigterm": 143}[path]
    assert status == expected, (out, err)
    if path.startswith("timeout"):
        assert f"did not finish within --timeout ({args[-1]} s)" in err
    if path == "sigint":
        assert "interrupted" in err
    if path == "wedge":
        assert "(host must be recycled)" in out and "the demo then thawed its freezer cgroup" in out


@_real_mpi
@pytest.mark.skipif(_cli_missing(), reason="console script not installed next to sys.executable")
def test_compare_shows_the_hang_without_the_extension(procs: ProcessTracker, short_tmpdir: Path) -> None:
    # A kill in 1.2 mode (no worker monitor of its own): --compare's default where no freezer can
    # make a wedge. A healthy request of the scenario takes ~4 s (400 tokens, 10 ms each), so a
    # bound of 6 s leaves them time to finish had the engine lived.
    tmpdir = short_tmpdir
    proc = _start_demo(procs, tmpdir, "--compare", "--fault", "kill", "--mode", "1.2", "--compare-bound", "6",
                       "--json")
    status, out, err = _assert_nothing_left(proc, tmpdir)
    assert status == 0, (out, err)
    record = json.loads(out)
    off, on = record["off"], record["on"]
    assert off["verdict"]["kind"] == "hanging", off
    assert off["verdict"]["pending"] == off["result"]["in_flight"] > 0
    assert off["result"]["detection"]["health_false_ms"] is None  # health stayed True
    assert off["verdict"]["text"].startswith(f"still hanging after 6 s, {off['verdict']['pending']} requests pending")
    assert on["ok"] is True
    assert on["result"]["pending_not_done"] == 0 and on["result"]["detection"]["health_false_ms"] is not None


@_real_mpi
@pytest.mark.skipif(_cli_missing(), reason="console script not installed next to sys.executable")
def test_compare_by_default_shows_a_fault_only_the_extension_catches(procs: ProcessTracker,
                                                                     short_tmpdir: Path) -> None:
    """``demo --compare --json`` as the README gives it, no other argument: the run without the
    extension hangs with requests pending and health green; the run with it detects the fault.
    The fault is a wedge where the freezer can make one, else a kill in 1.2 mode."""
    proc = _start_demo(procs, short_tmpdir, "--compare", "--json")
    status, out, err = _assert_nothing_left(proc, short_tmpdir)
    assert status == 0, (out, err)
    record = json.loads(out)
    expected = ("wedge", "main") if os.access(demo.FREEZER_ROOT, os.W_OK) else ("kill", "1.2")
    assert (record["fault"], record["mode"]) == expected, record
    off, on = record["off"], record["on"]
    assert off["verdict"]["kind"] == "hanging", off
    assert off["verdict"]["pending"] is not None and off["verdict"]["pending"] > 0, off
    assert on["ok"] is True, on
    assert on["result"]["detection"]["detected_ms"] is not None, on
    assert on["result"]["detection"]["health_false_ms"] is not None and on["result"]["pending_not_done"] == 0, on


@pytest.mark.parametrize(("writable", "mode", "expected"), [
    (True, None, ("wedge", "main")), (True, "1.2", ("wedge", "1.2")),
    (False, None, ("kill", "1.2")), (False, "1.2", ("kill", "1.2")), (False, "main", ("kill", "main")),
])
def test_the_compare_default_is_a_fault_upstream_does_not_catch(writable: bool, mode: str | None,
                                                               expected: tuple[str, str], tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(demo, "FREEZER_ROOT", str(tmp_path) if writable else str(tmp_path / "absent"))
    fault, chosen_mode, why = demo.compare_default(mode)
    assert (fault, chosen_mode) == expected
    if expected == ("kill", "main"):  # the user asked for main: said that it shows nothing, and what does
        assert "try --mode 1.2" in why
    else:
        assert "nothing but the extension" in why or "no worker monitor of its own" in why


@_real_mpi
@pytest.mark.skipif(_cli_missing(), reason="console script not installed next to sys.executable")
def test_a_stop_prints_the_snapshot_and_names_the_stopped_rank_and_its_host(procs: ProcessTracker,
                                                                             short_tmpdir: Path) -> None:
    """``demo --fault stop``: rank 1 SIGSTOPped; once its tokens stopped, the extension's snapshot of
    the ranks names rank 1 (stopped, ``T``) with its host, and shows every rank's state."""
    proc = _start_demo(procs, short_tmpdir, "--fault", "stop")
    status, out, err = _assert_nothing_left(proc, short_tmpdir)
    assert status == 0, (out, err)
    victim = re.search(r"fault 'stop' on rank 1 \(pid (\d+)\)", out)
    assert victim is not None, out
    pid = victim.group(1)
    assert re.search(rf"stalled rank: rank 1 \(pid {pid}\) on host \S+: rank 1 is stopped \(T\)", out), out
    assert re.search(rf"    rank 1 \(pid {pid}\) on host \S+: T, wchan \S+, stopped, ", out), out
    assert re.search(r"    rank 0 \(pid \d+\) on host \S+: [A-Z], wchan \S+, ", out), out
