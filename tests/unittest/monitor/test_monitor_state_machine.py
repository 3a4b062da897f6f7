"""Hypothesis drives register / kill / check / close in random orders against a simple model.

Real processes (``/bin/sleep``, our children) are killed for real; the model says which
registered ranks are dead, and the monitor must agree: ``find_dead_worker()`` returns a dead
registered identity (sticky) exactly when one exists, never a live one, and no pidfd leaks.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tests.support.process_tracker import state_of
from tests.support.waits import wait_until
from trtllm_liveness.monitor import WorkerProcessMonitor
from trtllm_liveness.process import ProcessIdentity, capture_identity

pytestmark = [pytest.mark.real_process, pytest.mark.timeout(300)]

SLEEP = shutil.which("sleep") or "/bin/sleep"
MAX_PROCS = 5


def open_fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


class MonitorMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.fds_at_start = open_fd_count()
        self.children: list[subprocess.Popen[bytes]] = []
        self.identities: list[ProcessIdentity] = []
        self.killed: set[int] = set()  # pids
        self.monitor = WorkerProcessMonitor()
        self.registered: dict[int, ProcessIdentity] = {}  # rank -> identity
        self.sticky: ProcessIdentity | None = None
        self.started = False

    @initialize()
    def two_workers(self) -> None:
        for _ in range(2):
            self.spawn()

    @precondition(lambda self: len(self.children) < MAX_PROCS)
    @rule()
    def spawn(self) -> None:
        child = subprocess.Popen([SLEEP, "3600"], start_new_session=True)
        self.children.append(child)
        # Wait until exec has happened so the start time and comm are final.
        wait_until(lambda: state_of(child.pid) is not None, 5)
        self.identities.append(capture_identity(len(self.identities), child.pid))

    @precondition(lambda self: bool(self.identities))
    @rule(data=st.data())
    def register(self, data: st.DataObject) -> None:
        identity = data.draw(st.sampled_from(self.identities))
        self.monitor.register([identity])
        self.registered[identity.rank] = identity

    @precondition(lambda self: any(c.pid not in self.killed for c in self.children))
    @rule(data=st.data())
    def kill(self, data: st.DataObject) -> None:
        child = data.draw(st.sampled_from([c for c in self.children if c.pid not in self.killed]))
        os.kill(child.pid, signal.SIGKILL)
        self.killed.add(child.pid)
        # Our child stays a zombie until we reap it, so "dead" is a stable fact to check against.
        assert wait_until(lambda: state_of(child.pid) == "Z", 10)

    @rule()
    def start_watcher(self) -> None:
        self.monitor.start()
        self.started = True

    @rule()
    def check(self) -> None:
        dead = self.monitor.find_dead_worker()
        dead_registered = {i for i in self.registered.values() if i.pid in self.killed}
        if self.sticky is not None:
            assert dead == self.sticky
        elif dead_registered:
            assert dead in dead_registered
            self.sticky = dead
        else:
            assert dead is None

    @rule()
    def close_and_renew(self) -> None:
        self.monitor.close()
        self.monitor = WorkerProcessMonitor()
        self.registered.clear()
        self.sticky = None

    @invariant()
    def never_reports_a_live_process(self) -> None:
        failure = self.monitor.failure
        if failure is not None:
            assert failure.identity.pid in self.killed

    def teardown(self) -> None:
        self.monitor.close()
        for child in self.children:
            if child.pid not in self.killed:
                child.kill()
            child.wait(10)
        assert open_fd_count() <= self.fds_at_start, "pidfds or pipes leaked"


MonitorMachine.TestCase.settings = settings(
    max_examples=40, stateful_step_count=15, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestMonitorStateMachine = MonitorMachine.TestCase
