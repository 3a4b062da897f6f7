"""Start-up, submit, session and exit of the liveness proxy on the upstream-shaped fakes, in child processes.

Each test runs ``tests/programs/lifecycle_child.py`` in a child of its own session (tracked by the
``procs`` fixture, its whole session killed at the end) and asserts on the JSON lines it prints:
the engine is built with upstream's own ``create()`` on real MPI ranks, so upstream's blocking
PAIR sends, ZMQ contexts and mpi4py's exit joins live and die with the child, never in pytest's
process (an in-process ZMQ context whose ``term()`` waits on a send stuck to a dead peer blocks
the interpreter that owns it). D state is real (cgroup v1 freezer, owned by the parent's
``freezer`` fixture, so a killed child leaks no cgroup).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.children import HelperProcess
from tests.support.facilities import MPI_MARKS
from tests.support.process_tracker import ProcessTracker, state_of
from tests.support.stuck_processes import Freezer
from tests.support.waits import WAIT_SCALE, wait_until
from trtllm_liveness.integrations.trtllm._engine_shutdown import UPSTREAM_SHUTDOWN_THREAD

pytestmark = [pytest.mark.timeout(120), *MPI_MARKS]

COMMON = "enabled=1,scan_interval_s=0.05,shutdown_grace_s=0.5,shutdown_term_s=0.5,shutdown_kill_s=1"
TREES = ["main", "v12"]


class Child:
    """A lifecycle_child run: JSON records out, one-word commands in; its session killed at exit."""

    def __init__(self, procs: ProcessTracker, options: dict[str, Any], config: str,
                 env: dict[str, str] | None = None) -> None:
        self.helper = HelperProcess("lifecycle_child", options,
                                    {"TRTLLM_WORKER_LIVENESS": f"{COMMON},{config}", **(env or {})})
        procs.popens.append(self.helper.popen)
        procs.track(self.helper.pid)

    def record(self, key: str | None, timeout: float = 30) -> dict[str, Any]:
        return self.helper.read_record(timeout * WAIT_SCALE, key)

    def send(self, word: str) -> None:
        self.helper.send(word)

    def log(self) -> str:
        return self.helper.stderr_tail(10**7)

    def finish(self, timeout: float = 30) -> tuple[int | None, str, list[int]]:
        """(exit status or None, the whole stderr, survivors of the session kill)."""
        status = self.helper.wait_exit(timeout * WAIT_SCALE)
        log = self.log()
        return status, log, self.helper.close()

    def close(self) -> None:
        if self.helper.popen.stdout is not None and not self.helper.popen.stdout.closed:
            self.helper.close()


@pytest.fixture
def child_factory(procs: ProcessTracker) -> Iterator[Any]:
    children: list[Child] = []

    def make(options: dict[str, Any], config: str = "", env: dict[str, str] | None = None) -> Child:
        child = Child(procs, options, config, env)
        children.append(child)
        return child

    try:
        yield make
    finally:
        for child in children:
            child.close()


def _pids(record: dict[str, Any]) -> dict[int, int]:
    assert record["identities"], record
    return {rank: pid for rank, pid, _start in record["identities"]}


def _hold_in_d(freezer: Freezer, pid: int, seconds: float) -> float:
    """Freeze ``pid``, keep it in D for ``seconds``, thaw; the monotonic time of the thaw."""
    assert freezer.freeze([pid])
    assert wait_until(lambda: state_of(pid) == "D", 10)
    threading.Event().wait(seconds)
    freezer.thaw()
    return time.monotonic()


# ----------------------------------------------------------------------------- wedge timer at READY


@pytest.mark.freezer
@pytest.mark.parametrize("tree", TREES)
def test_d_state_during_startup_is_no_wedge_and_the_timer_starts_at_ready(child_factory: Any, freezer: Freezer,
                                                                          tree: str) -> None:
    """A slow cold-mount weight load (the leader in D during the model build)
    must not be called a wedge; after READY the same D state is one."""
    child = child_factory({"scenario": "startup", "tree": tree, "init_delay_s": 4.0}, "d_state_timeout_s=0.2")
    leader = _pids(child.record("identities"))[0]
    frozen_at = time.monotonic()
    thawed_at = _hold_in_d(freezer, leader, 8 * 0.2)  # well over d_state_timeout_s, several scans
    created = child.record(None)  # "created", or "create_error" where start-up D was called a wedge
    assert "create_error" not in created, (created, child.log())
    # The frozen leader could not send READY, so READY (and the arming) came after the thaw.
    assert created["ready_at"] > thawed_at > frozen_at, created
    assert created["fatal"] is None, (created, child.log())
    assert created["wedge_armed"] is True
    assert created["events"] == [], created
    assert freezer.freeze([leader])
    child.send("watch")
    fatal = child.record("fatal")["fatal"]
    freezer.thaw()
    child.send("done")
    status, log, survivors = child.finish()
    assert fatal is not None and "uninterruptible" in fatal and "rank 0" in fatal, log
    assert status == 0, log
    assert survivors == []


@pytest.mark.freezer
@pytest.mark.parametrize("tree", TREES)
def test_startup_keeps_its_own_bound(child_factory: Any, freezer: Freezer, tree: str) -> None:
    """With ``startup_d_state_timeout_s`` a leader stuck in D during the build is
    a wedge (the READY bound, 30 s, is not what applies before READY); ``create()`` raises it."""
    child = child_factory({"scenario": "startup", "tree": tree, "init_delay_s": 4.0},
                          "d_state_timeout_s=30,startup_d_state_timeout_s=0.2")
    leader = _pids(child.record("identities"))[0]
    assert freezer.freeze([leader])
    failed = child.record("create_error")
    freezer.thaw()
    child.send("done")
    status, log, survivors = child.finish()
    assert "uninterruptible" in failed["create_error"] and "rank 0" in failed["create_error"], log
    assert status == 0, log
    assert survivors == []


# ----------------------------------------------------------------------------- sessions


@pytest.mark.parametrize("passed_in", [True, False])
def test_a_session_the_proxy_does_not_own_is_never_abandoned(child_factory: Any, passed_in: bool) -> None:
    """On main, after a death, ``abandon()`` only for the session the proxy created
    (upstream's ``shutdown()`` does so when ``_owns_mpi_session``; the extension's bounded shutdown,
    when upstream's is still blocked, must keep to the same rule)."""
    child = child_factory({"scenario": "session", "tree": "main", "passed_in": passed_in})
    record = child.record("abandoned", 60)
    status, log, survivors = child.finish()
    assert record["fatal"] is not None and "rank 1" in record["fatal"], log
    assert record["owns"] is (not passed_in), record
    if passed_in:
        assert record["abandoned"] == 0, (record, log)
    else:
        assert record["abandoned"] >= 1, (record, log)  # the owner's dead world is torn down
    assert status == 0, log
    assert survivors == []


@pytest.mark.freezer
@pytest.mark.parametrize("tree", TREES)
def test_interpreter_exits_after_a_wedged_world_without_exit_on_fatal(child_factory: Any, freezer: Freezer,
                                                                      tree: str) -> None:
    """On 1.2.x (main's ``_mark_engine_dead`` does it itself), after a fatal error
    mpi4py's exit join of its manager thread is released, so the process exits within a bound
    although no rank will ever answer that thread (both ranks stay frozen until after the exit).
    A SIGKILLed rank does not show it on Open MPI 5 with ULFM: the manager thread then dies of
    MPI_ERR_PROC_FAILED by itself."""
    child = child_factory({"scenario": "exit_join", "tree": tree}, "d_state_timeout_s=0.3")
    pids = _pids(child.record("identities"))
    assert freezer.freeze(list(pids.values()))
    child.send("watch")
    fatal = child.record("fatal")["fatal"]
    returning = child.record("returning")
    status = child.helper.wait_exit(30 * WAIT_SCALE)  # the ranks are still frozen
    log = child.log()
    freezer.thaw()
    survivors = child.helper.close()
    assert fatal is not None and "uninterruptible" in fatal, log
    assert any("_manager" in name for name in returning["threads"]), returning  # the join was real
    # Of the extension's threads only upstream's shutdown() runner, blocked with the world, is left,
    # named by its one WARNING; every other one ended within its bound.
    assert set(returning["extension_threads"]) <= {UPSTREAM_SHUTDOWN_THREAD}, returning
    if returning["extension_threads"]:
        assert log.count("upstream shutdown still blocked") == 1, log[-6000:]
    assert "still running past their bound" not in log and "still running after their bound" not in log, log[-6000:]
    assert status == 0, f"the interpreter exit did not end within the bound (status {status}):\n{log[-6000:]}"
    assert survivors == []


# ----------------------------------------------------------------------------- sends


def test_no_extension_send_from_a_thread_that_does_not_own_the_socket(child_factory: Any) -> None:
    """Upstream's ZMQ sockets have no lock and, with ``TLLM_LLMAPI_ZMQ_DEBUG=1``,
    raise on use from any thread but the first that used them. A death with requests in flight
    while the owner keeps submitting: no ownership error from any send (the extension's fatal path
    and its shutdown included)."""
    child = child_factory({"scenario": "sends", "tree": "main", "rank": 1}, "", {"TLLM_LLMAPI_ZMQ_DEBUG": "1"})
    record = child.record("violations", 60)
    status, log, survivors = child.finish()
    assert record["debug"] == "1"
    assert record["fatal"] is not None and "rank 1" in record["fatal"], log
    assert record["rejected"] > 0, record  # submits went on after the fatal error
    assert record["violations"] == [], (record["violations"], log[-6000:])
    assert "thread safety violation" not in log, log[-6000:]
    assert status == 0, log
    assert survivors == []


def test_a_healthy_shutdown_sends_from_the_owning_thread_in_zmq_debug_mode(child_factory: Any) -> None:
    """Before: a healthy shutdown() ran upstream's shutdown (and its pre_shutdown() sends) in a
    helper thread; in debug mode upstream raised there ("thread safety violation"), so no stop
    sentinel and no cancellation went out. (The fake's own shutdown in debug mode with requests in
    flight then still waits for its dispatch thread, with or without the extension: the bounded
    stop ends it; that is the fake's behaviour, not checked against upstream.)"""
    child = child_factory({"scenario": "sends", "tree": "main", "healthy": True}, "shutdown_grace_s=10",
                          {"TLLM_LLMAPI_ZMQ_DEBUG": "1"})
    record = child.record("violations", 60)
    status, log, survivors = child.finish()
    assert record["debug"] == "1" and record["fatal"] is None, log[-4000:]
    assert record["violations"] == [] and "thread safety violation" not in log, log[-6000:]
    assert status == 0, log[-4000:]
    assert survivors == []


# ----------------------------------------------------------------------------- submit re-check


def test_request_registered_after_the_fatal_sweep_is_failed(child_factory: Any) -> None:
    """On 1.2.x, a request that passed the fatal check and registered after the
    sweep of pending results must not stay pending forever. 16 threads submit back to back against
    a SIGKILL of rank 1 (upstream's making of each result takes 20 ms, so the death mostly falls
    between a submit's check and its registration): every request ``submit()`` returned ends with
    an error, and no submitter is left blocked."""
    child = child_factory({"scenario": "late_register", "tree": "v12", "threads": 16, "result_delay_s": 0.02})
    record = child.record("pending", 90)
    status, log, survivors = child.finish()
    assert record["fatal"] is not None and "rank 1" in record["fatal"], log
    assert record["submitted"] > 0 and record["rejected"] > 0, record
    assert record["pending"] == [], (record, log[-4000:])
    assert record["errors"] == record["submitted"], record
    assert record["stuck_submitters"] == [], record
    assert status == 0, log
    assert survivors == []
