"""What a user sees of upstream's own threads and teardown after a rank dies, on both fakes.

Each (tree, rank, dispatcher) runs ``tests/programs/teardown_child.py`` once in a child of its own
session: requests stream, the leader (rank 0) or a subordinate (rank 1) is SIGKILLed, the fatal
error and the failure of every pending request are awaited, then ``shutdown()``. Upstream's
dispatch thread either keeps up with the leader (``idle``: it waits in its blocking receive when the
rank dies) or lags behind it (``lagging``: responses wait in the result socket, as under load; see
the child's ``dispatch_delay_s``). The tests read that run's two records and its stderr; each
finding has its own test, sharing the runs:

- upstream's threads log no ERROR and no traceback after the death (the 1.2-era dispatch loop
  indexes its result table: a response in flight for a request the extension failed raised
  ``KeyError`` there; closing upstream's sockets under its running dispatcher raises too);
- nothing of upstream's teardown is alive once ``shutdown()`` returned, and the normal path logs no
  WARNING about it (main's proxy waits up to 5 s for its futures and its dispatcher after a death;
  1.2's waits for its dispatcher without a bound);
- the 1.2 note that the session has no ``abandon()`` is not logged where the exit join was released
  (after a death, and when a wedged world really leaves upstream's teardown blocked: then one
  WARNING says so), and is one INFO line per process where it could not be released.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from typing import Any

import pytest

from tests.support.children import HelperProcess
from tests.support.facilities import MPI_MARKS
from tests.support.process_tracker import ProcessTracker
from tests.support.stuck_processes import Freezer
from tests.support.upstream_fakes import tree as fake_tree
from tests.support.waits import WAIT_SCALE

pytestmark = [pytest.mark.timeout(150), *MPI_MARKS]

CONFIG = "enabled=1,scan_interval_s=0.05,shutdown_grace_s=0.5,shutdown_term_s=0.5,shutdown_kill_s=1"
DISPATCH_DELAY_S = {"idle": 0.0, "lagging": 0.002}
CASES = [(tree, rank, dispatcher) for tree in ("v12", "main") for rank in (0, 1) for dispatcher in DISPATCH_DELAY_S]
IDS = [f"{tree}-rank{rank}-{dispatcher}" for tree, rank, dispatcher in CASES]
V12 = [case for case in CASES if case[0] == "v12"]
V12_IDS = [case_id for case_id in IDS if case_id.startswith("v12")]
UPSTREAM_ERROR_MARKERS = (" ERROR tensorrt_llm", "Error in thread", "Context was terminated")


@dataclass(frozen=True)
class TeardownRun:
    """One teardown_child run: its records, its whole stderr, its exit status and survivors."""

    after: dict[str, Any]
    final: dict[str, Any]
    log: str
    status: int | None
    survivors: tuple[int, ...]

    def upstream_error_lines(self) -> list[str]:
        """The stderr lines that upstream's threads and logger printed at ERROR (tracebacks counted
        through the records: each record's own line count)."""
        return [line for line in self.log.splitlines() if any(marker in line for marker in UPSTREAM_ERROR_MARKERS)]


_RUNS: dict[tuple[str, int, str], TeardownRun] = {}


def teardown_run(procs: ProcessTracker, tree: str, rank: int, dispatcher: str) -> TeardownRun:
    """The run of (tree, rank, dispatcher), made once per session; every test of it reads the same run."""
    key = (tree, rank, dispatcher)
    if key not in _RUNS:
        options = {"tree": tree, "rank": rank, "requests": 8, "dispatch_delay_s": DISPATCH_DELAY_S[dispatcher]}
        helper = HelperProcess("teardown_child", options, {"TRTLLM_WORKER_LIVENESS": CONFIG})
        procs.popens.append(helper.popen)
        procs.track(helper.pid)
        try:
            after = helper.read_record(90 * WAIT_SCALE, "after_shutdown")
            final = helper.read_record(30 * WAIT_SCALE, "left")
            status = helper.wait_exit(30 * WAIT_SCALE)
            log = helper.stderr_tail(10**7)
        finally:
            survivors = helper.close()
        _RUNS[key] = TeardownRun(after, final, log, status, tuple(survivors))
    run = _RUNS[key]
    # The scenario itself: the named rank died while every request streamed, and each one failed.
    assert run.after["streaming"], run.log[-4000:]
    assert run.after["fatal"] is not None and f"rank {rank}" in run.after["fatal"], run.log[-4000:]
    assert run.after["failed"] == run.after["requests"], (run.after, run.log[-4000:])
    assert run.status == 0, f"exit status {run.status}\n{run.log[-6000:]}"
    assert run.survivors == ()
    return run


@pytest.mark.parametrize(("tree", "rank", "dispatcher"), CASES, ids=IDS)
def test_upstreams_threads_log_no_error_after_a_death(procs: ProcessTracker, tree: str, rank: int,
                                                      dispatcher: str) -> None:
    run = teardown_run(procs, tree, rank, dispatcher)
    errors = run.final["upstream_errors"]
    lines = sum(int(error["lines"]) for error in errors)
    assert (len(errors), lines) == (0, 0), "\n".join(f"[{e['thread']} {e['level']}] {e['text']}" for e in errors)
    assert run.upstream_error_lines() == []


@pytest.mark.parametrize(("tree", "rank", "dispatcher"), CASES, ids=IDS)
def test_nothing_of_upstreams_teardown_outlives_shutdown(procs: ProcessTracker, tree: str, rank: int,
                                                         dispatcher: str) -> None:
    run = teardown_run(procs, tree, rank, dispatcher)
    assert run.after["after_shutdown"] == [], run.log[-6000:]
    assert run.final["left"] == []
    assert run.final["teardown_warnings"] == [], run.final["teardown_warnings"]


@pytest.mark.parametrize(("tree", "rank", "dispatcher"), CASES, ids=IDS)
def test_no_thread_of_the_extension_outlives_shutdown_after_a_death(procs: ProcessTracker, tree: str, rank: int,
                                                                    dispatcher: str) -> None:
    run = teardown_run(procs, tree, rank, dispatcher)
    assert run.after["extension_threads"] == [], run.log[-6000:]


@pytest.mark.parametrize("tree", ["v12", "main"])
@pytest.mark.parametrize("fault", ["stall", "none"])
def test_no_thread_of_the_extension_outlives_shutdown_after_a_stall_or_a_clean_run(
        procs: ProcessTracker, tree: str, fault: str) -> None:
    """A fatal stall verdict (the leader's step loop blocks: no output, no iteration), and a healthy
    engine shut down with its requests in flight: when ``shutdown()`` returns, every thread the
    extension started has ended (the diagnosis, the fatal path's, the stall timer, the watcher, and
    the agent hub's, with its remote stop and snapshot), and upstream's teardown too."""
    config = CONFIG + ",hosts=on,hosts_bind=127.0.0.1"
    config += ",stall_timeout_s=1,stall_action=fatal" if fault == "stall" else ""
    helper = HelperProcess("teardown_child", {"tree": tree, "rank": 0, "requests": 4, "fault": fault},
                           {"TRTLLM_WORKER_LIVENESS": config})
    procs.popens.append(helper.popen)
    procs.track(helper.pid)
    try:
        after = helper.read_record(90 * WAIT_SCALE, "after_shutdown")
        status = helper.wait_exit(60 * WAIT_SCALE)
        log = helper.stderr_tail(10**7)
    finally:
        survivors = helper.close()
    assert after["streaming"], log[-4000:]
    if fault == "stall":
        assert after["fatal"] is not None and "stall" in after["fatal"], log[-4000:]
        assert after["failed"] == after["requests"], (after, log[-4000:])
    else:
        assert after["fatal"] is None, log[-4000:]
    assert after["extension_threads"] == [], log[-6000:]
    assert after["after_shutdown"] == [], log[-6000:]
    assert status == 0 and survivors == [], log[-6000:]


@pytest.mark.parametrize(("tree", "rank", "dispatcher"), V12, ids=V12_IDS)
def test_no_abandon_note_where_the_exit_join_was_released(procs: ProcessTracker, tree: str, rank: int,
                                                          dispatcher: str) -> None:
    """1.2.x has no ``abandon()``; after a death the fatal path released mpi4py's exit join of the
    owned pool (logged at INFO), so a missing ``abandon()`` leaves nothing for the exit to wait on."""
    run = teardown_run(procs, tree, rank, dispatcher)
    assert "released mpi4py's exit join" in run.log, run.log[-4000:]
    assert run.final["abandon_notes"] == [], run.final["abandon_notes"]


@pytest.mark.freezer
def test_a_wedged_world_leaves_one_warning_and_no_abandon_note(procs: ProcessTracker, freezer: Freezer) -> None:
    """1.2.x, both ranks held in D (frozen) until after the exit: the bounded stop cannot end them,
    so upstream's teardown really is left (its session joins a pool thread that no rank will ever
    answer): one WARNING says so. The fatal path released the exit join of that thread, so there
    is no note that the session has no ``abandon()``, and the interpreter exits."""
    helper = HelperProcess("lifecycle_child", {"scenario": "exit_join", "tree": "v12"},
                           {"TRTLLM_WORKER_LIVENESS": f"{CONFIG},d_state_timeout_s=0.3"})
    procs.popens.append(helper.popen)
    procs.track(helper.pid)
    try:
        pids = [pid for _rank, pid, _start in helper.read_record(60 * WAIT_SCALE, "identities")["identities"]]
        assert freezer.freeze(pids)
        helper.send("watch")
        fatal = helper.read_record(30 * WAIT_SCALE, "fatal")["fatal"]
        helper.read_record(30 * WAIT_SCALE, "returning")
        status = helper.wait_exit(30 * WAIT_SCALE)
        log = helper.stderr_tail(10**7)
    finally:
        freezer.thaw()
        survivors = helper.close()
    assert fatal is not None and "uninterruptible" in fatal, log[-4000:]
    assert log.count("upstream shutdown still blocked") == 1, log[-6000:]
    assert "has no abandon()" not in log, log[-6000:]
    assert status == 0, log[-6000:]
    assert survivors == []


_NOTE_WHERE_THE_JOIN_STAYS = """
import logging
import sys
import types

notes = []
class Notes(logging.Handler):
    def emit(self, record):
        if "has no abandon()" in record.getMessage():
            notes.append(record.levelname)
logging.getLogger("trtllm_liveness").addHandler(Notes())
logging.getLogger("trtllm_liveness").setLevel(logging.DEBUG)

import tensorrt_llm.executor.proxy  # upstream's import order (the session module is loaded through it)
from tensorrt_llm.llmapi.mpi_session import MpiPoolSession
from trtllm_liveness._config import LivenessConfig
from trtllm_liveness.integrations.trtllm._state import EngineLiveness
from trtllm_liveness.integrations.trtllm._upstream_teardown import abandon_session

# mpi4py's futures were never imported here: no exit-join table, so no join can be released.
assert "mpi4py.futures._core" not in sys.modules
for _engine in range(3):
    session = MpiPoolSession.__new__(MpiPoolSession)      # 1.2.x's session class: no abandon()
    session.mpi_pool = None
    proxy = types.SimpleNamespace(mpi_session=session, _owns_mpi_session=True)
    abandon_session(proxy, EngineLiveness(config=LivenessConfig(enabled=True)))
print("NOTES", *notes)
"""


def test_abandon_note_is_one_info_line_per_process_where_the_join_stays(procs: ProcessTracker) -> None:
    """Three engines of one process whose upstream teardown stayed blocked, on a session without
    ``abandon()`` whose pool thread's exit join cannot be released: the note comes once, at INFO."""
    env = {k: v for k, v in os.environ.items() if k != "TRTLLM_WORKER_LIVENESS"}
    env["PYTHONPATH"] = os.pathsep.join([str(fake_tree("v12")), os.getcwd()])
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_NOTE_WHERE_THE_JOIN_STAYS)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=True)
    procs.popens.append(proc)
    procs.track(proc.pid)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err.decode()[-3000:]
    assert out.decode().split() == ["NOTES", "INFO"], err.decode()[-3000:]
