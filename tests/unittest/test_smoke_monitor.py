"""First real-process checks of the monitor; the full suite lives in test_monitor.py."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from trtllm_liveness import EventKind, WorkerEvent, WorkerProcessMonitor, WorkerState, capture_identity

from ..conftest import Freezer, ProcessTracker, state_of, wait_until

pytestmark = [pytest.mark.real_process, pytest.mark.timeout(60)]


def test_sigkill_of_child_is_reported_with_rank_and_pid(procs: ProcessTracker) -> None:
    children = [procs.sleeper() for _ in range(3)]
    identities = [capture_identity(rank, child.pid) for rank, child in enumerate(children)]
    events: list[WorkerEvent] = []
    got = threading.Event()
    with WorkerProcessMonitor() as monitor:
        monitor.subscribe(lambda e: (events.append(e), got.set()))
        monitor.register(identities)
        monitor.start()
        assert monitor.find_dead_worker() is None
        os.kill(children[2].pid, signal.SIGKILL)
        assert got.wait(10)
        assert events[0].kind is EventKind.DIED
        assert events[0].identity == identities[2]
        assert monitor.find_dead_worker() == identities[2]
        states = {s.identity.rank: s.state for s in monitor.statuses()}
        assert states[0] is WorkerState.ALIVE
        assert states[2] in (WorkerState.ZOMBIE, WorkerState.EXITED)


def test_frozen_process_becomes_wedged_then_unkillable(procs: ProcessTracker, freezer: Freezer) -> None:
    child = procs.sleeper()
    identity = capture_identity(0, child.pid)
    events: list[WorkerEvent] = []
    with WorkerProcessMonitor(d_state_timeout_s=0.3, scan_interval_s=0.05) as monitor:
        monitor.subscribe(events.append)
        monitor.register([identity])
        monitor.start()
        freezer.add(child.pid)
        freezer.freeze()
        assert wait_until(lambda: state_of(child.pid) == "D", 10)
        assert wait_until(lambda: any(e.kind is EventKind.WEDGED for e in events), 10)
        assert events[0].restartable is False
        os.kill(child.pid, signal.SIGKILL)
        assert wait_until(lambda: any(e.kind is EventKind.UNKILLABLE for e in events), 10)
        assert state_of(child.pid) == "D"  # still there: SIGKILL cannot reap a frozen task
        freezer.thaw()
        assert wait_until(lambda: any(e.kind is EventKind.DIED for e in events), 10)
