"""A drill's fault in a rank of another host, asked by the hub and made by that host's agent.

The hub (a :class:`DrillHub` over a real monitor) runs in the test process; each agent is a real
process in a UTS namespace of its own (another hostname: its ranks are another host's to the hub,
tests/programs/host_agent_child.py) over real sleeper ranks. The faults are real: SIGKILL, SIGSTOP,
the cgroup v1 freezer (real ``D``). The proxy side never signals: every pid is verified and hit by
the agent. Clean-up is the agent's (the hub's stop), and checked: no rank, no freezer group left.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.cgroups import remove_leftover_groups
from tests.support.facilities import needs
from tests.support.process_tracker import ProcessTracker, state_of
from tests.support.waits import WAIT_SCALE, wait_until
from trtllm_liveness._events import EventKind, WorkerEvent
from trtllm_liveness.demo._cgroup_faults import FREEZER_ROOT
from trtllm_liveness.drill._drill_faults import _FREEZER_PREFIX, DrillHub, FaultReply
from trtllm_liveness.monitor import WorkerProcessMonitor

pytestmark = [needs("mpi", "testhosts"), pytest.mark.real_process, pytest.mark.timeout(60)]

REPO = str(Path(__file__).resolve().parents[3])
BOUND_S = 10.0 * WAIT_SCALE
HOST = "fakehostB"
RUNNING = ("S", "R")  # an untouched sleeper rank


class Proxy:
    """A monitor with a drill's hub and every event it delivers."""

    def __init__(self) -> None:
        self.monitor = WorkerProcessMonitor()
        self.monitor.start()
        self.events: list[WorkerEvent] = []
        self.monitor.subscribe(self.events.append)
        # A long heartbeat bound: no test here is about a lost host, and a loaded machine must not
        # make one (a lost host's session takes no fault request).
        self.hub = DrillHub(self.monitor, bind="127.0.0.1", heartbeat_timeout_s=5.0, d_state_timeout_s=None,
                            grace_s=0.5, kill_s=1.0).start()

    def close(self) -> None:
        self.hub.close()
        self.monitor.close()


@pytest.fixture
def proxy() -> Iterator[Proxy]:
    made = Proxy()
    try:
        yield made
    finally:
        made.close()


class Agent:
    """One agent process (rank 2 on :data:`HOST`) over ``ranks`` sleepers (ranks 3, 4, ...)."""

    def __init__(self, procs: ProcessTracker, proxy: Proxy, log: Path, *, drill: bool = True,
                 ranks: int = 2, die_at_group: bool = False) -> None:
        hub = proxy.hub
        options = {"host": HOST, "endpoint": hub.endpoint, "secret": hub.secret.hex(), "ranks": ranks,
                   "first_rank": 2, "heartbeat_timeout_s": hub.heartbeat_timeout_s, "drill": drill,
                   "die_at_group": die_at_group}
        self.log = log
        with open(log, "wb") as handle:
            self.popen = subprocess.Popen(["unshare", "--uts", sys.executable, "-m", "tests.programs.host_agent_child",
                                           json.dumps(options)], stdout=subprocess.PIPE, stderr=handle,
                                          start_new_session=True, cwd=REPO)
        procs.popens.append(self.popen)
        procs.track(self.popen.pid)
        record = self._line(BOUND_S * 2)
        assert record is not None and record["ready"], (record, self.log_text())
        self.ranks = {int(rank): int(pid) for rank, pid, _start in record["ranks"]}
        for pid in self.ranks.values():
            procs.track(pid)

    def _line(self, timeout: float) -> dict[str, Any] | None:
        got: list[bytes] = []
        stdout = self.popen.stdout
        assert stdout is not None
        reader = threading.Thread(target=lambda: got.append(stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout)
        return json.loads(got[0]) if got and got[0] else None

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def drill_groups() -> list[str]:
    if not os.path.isdir(FREEZER_ROOT):
        return []
    return sorted(name for name in os.listdir(FREEZER_ROOT) if name.startswith(_FREEZER_PREFIX))


@pytest.fixture(autouse=True)
def no_group_left(procs: ProcessTracker) -> Iterator[None]:
    """Every agent's freezer group is gone after each test; one left is thawed, removed, and fails it
    (before ``procs`` ends the test's processes: a frozen one could not die)."""
    del procs
    yield
    left = drill_groups()
    remove_leftover_groups(_FREEZER_PREFIX)
    assert left == [], f"freezer groups left: {left}"


def stop_and_check(proxy: Proxy, agent: Agent, unkillable: tuple[int, ...] = ()) -> None:
    """The drill's clean-up on that host: the hub's stop, made by the agent (reporting
    ``unkillable`` as a server's stop would: a frozen rank), then the agent's thaw; nothing is left."""
    stops = proxy.hub.stop_hosts(BOUND_S)
    assert [(stop.host, stop.outcome, tuple(rank for rank, _pid, _text in stop.unkillable)) for stop in stops] == \
        [(HOST, "stopped", unkillable)], stops
    assert agent.popen.wait(BOUND_S) == 75
    assert all(state_of(pid) in (None, "Z") for pid in agent.ranks.values()), \
        {pid: state_of(pid) for pid in agent.ranks.values()}
    assert drill_groups() == []


def assert_injected(reply: FaultReply, agent: Agent, fault: str) -> None:
    assert (reply.outcome, reply.rank, reply.pid, reply.host, reply.fault) == \
        ("injected", 4, agent.ranks[4], HOST, fault), reply
    assert reply.at is not None and "verified against its start time" in reply.detail


def test_kill_is_made_by_the_agent_and_reported_as_the_ranks_death(procs: ProcessTracker, proxy: Proxy,
                                                                   tmp_path: Path) -> None:
    agent = Agent(procs, proxy, tmp_path / "agent.log")
    assert isinstance(proxy.hub, DrillHub)
    reply = proxy.hub.inject_fault(4, "kill", BOUND_S)
    assert_injected(reply, agent, "kill")
    assert wait_until(lambda: proxy.events, BOUND_S)
    event = proxy.events[0]
    assert (event.kind, event.identity.rank, event.identity.pid, event.identity.hostname) == \
        (EventKind.DIED, 4, agent.ranks[4], HOST)
    assert state_of(agent.ranks[3]) in RUNNING  # the other rank was not touched
    stop_and_check(proxy, agent)


def test_stop_is_made_by_the_agent_and_cleaned_up_by_its_stop(procs: ProcessTracker, proxy: Proxy,
                                                              tmp_path: Path) -> None:
    agent = Agent(procs, proxy, tmp_path / "agent.log")
    assert isinstance(proxy.hub, DrillHub)
    reply = proxy.hub.inject_fault(4, "stop", BOUND_S)
    assert_injected(reply, agent, "stop")
    assert wait_until(lambda: state_of(agent.ranks[4]) == "T", BOUND_S)
    assert proxy.events == []  # a stopped rank is alive: only a stall bound would catch it
    stop_and_check(proxy, agent)


@needs("freezer")
def test_wedge_is_real_d_state_reported_unkillable_at_the_stop_then_thawed(procs: ProcessTracker,
                                                                          tmp_path: Path) -> None:
    proxy = Proxy()
    try:
        agent = Agent(procs, proxy, tmp_path / "agent.log")
        assert isinstance(proxy.hub, DrillHub)
        reply = proxy.hub.inject_fault(4, "wedge", BOUND_S)
        assert_injected(reply, agent, "wedge")
        assert "freezer" in reply.detail
        assert state_of(agent.ranks[4]) == "D"  # the freezer reached FROZEN before the answer
        assert len(drill_groups()) == 1
        stop_and_check(proxy, agent, unkillable=(4,))
    finally:
        proxy.close()


@needs("freezer")
def test_an_agent_killed_while_its_rank_is_frozen_leaves_its_guard_to_thaw_it(procs: ProcessTracker,
                                                                             tmp_path: Path) -> None:
    """The agent's own process SIGKILLed (as a launcher's teardown may) while the rank it froze is in
    ``D``: nobody asks it to clean up, and the group's guard thaws the rank and removes the group."""
    proxy = Proxy()
    try:
        agent = Agent(procs, proxy, tmp_path / "agent.log")
        assert isinstance(proxy.hub, DrillHub)
        assert_injected(proxy.hub.inject_fault(4, "wedge", BOUND_S), agent, "wedge")
        assert state_of(agent.ranks[4]) == "D" and len(drill_groups()) == 1
        os.kill(agent.popen.pid, signal.SIGKILL)
        assert agent.popen.wait(BOUND_S) == -signal.SIGKILL
        assert wait_until(lambda: drill_groups() == [], BOUND_S), drill_groups()
        assert state_of(agent.ranks[4]) in RUNNING  # thawed, alive: the procs fixture ends it
    finally:
        proxy.close()


@needs("freezer")
def test_an_agent_killed_as_its_group_is_made_leaves_no_group(procs: ProcessTracker, tmp_path: Path) -> None:
    """The agent's process SIGKILLed right after it made its freezer group, before it froze anything
    (a launcher's teardown landing there): the group's guard, started before the group, removes it."""
    proxy = Proxy()
    try:
        agent = Agent(procs, proxy, tmp_path / "agent.log", die_at_group=True)
        assert isinstance(proxy.hub, DrillHub)
        reply = proxy.hub.inject_fault(4, "wedge", 1.0)
        assert reply.outcome != "injected", reply
        assert agent.popen.wait(BOUND_S) == -signal.SIGKILL, agent.log_text()
        assert wait_until(lambda: drill_groups() == [], BOUND_S), drill_groups()
        assert state_of(agent.ranks[4]) in RUNNING
    finally:
        proxy.close()


def test_an_agent_whose_engine_is_no_drill_refuses_and_logs_it(procs: ProcessTracker, proxy: Proxy,
                                                              tmp_path: Path) -> None:
    """The hub asks (a drill's hub), the agent has a server's fault handler (not the drill's):
    refused, logged, the rank untouched."""
    agent = Agent(procs, proxy, tmp_path / "agent.log", drill=False)
    assert isinstance(proxy.hub, DrillHub)
    reply = proxy.hub.inject_fault(4, "kill", BOUND_S)
    assert (reply.outcome, reply.rank, reply.host, reply.pid, reply.at) == ("refused", 4, HOST, 0, None), reply
    assert "not started as a drill" in reply.detail
    assert wait_until(lambda: "rejected a fault request (1 so far)" in agent.log_text(), BOUND_S), agent.log_text()
    assert "WARNING" in next(line for line in agent.log_text().splitlines() if "rejected a fault request" in line)
    assert state_of(agent.ranks[4]) in RUNNING and proxy.events == []
    stop_and_check(proxy, agent)


def test_the_agents_own_rank_and_a_rank_of_no_remote_host_are_refused(procs: ProcessTracker, proxy: Proxy,
                                                                      tmp_path: Path) -> None:
    agent = Agent(procs, proxy, tmp_path / "agent.log")
    assert isinstance(proxy.hub, DrillHub)
    own = proxy.hub.inject_fault(2, "kill", BOUND_S)
    assert (own.outcome, own.host) == ("refused", HOST) and "the agent's own rank" in own.detail, own
    nowhere = proxy.hub.inject_fault(9, "stop", BOUND_S)
    assert nowhere.outcome == "refused" and "not a rank of a connected remote host" in nowhere.detail, nowhere
    assert agent.popen.poll() is None and all(state_of(pid) in RUNNING for pid in agent.ranks.values())
    stop_and_check(proxy, agent)


def test_racing_requests_each_get_their_own_answer(procs: ProcessTracker, proxy: Proxy, tmp_path: Path) -> None:
    """Four callers at once, two ranks, two faults each: every caller gets the answer to its own
    request (its rank and fault), each rank is hit, and nothing is answered twice."""
    agent = Agent(procs, proxy, tmp_path / "agent.log")
    hub = proxy.hub
    assert isinstance(hub, DrillHub)
    asks = [(3, "stop"), (4, "stop"), (3, "stop"), (4, "stop")]
    replies: list[FaultReply | None] = [None] * len(asks)
    start = threading.Barrier(len(asks), timeout=BOUND_S)

    def ask(index: int) -> None:
        start.wait()
        replies[index] = hub.inject_fault(*asks[index], BOUND_S)

    threads = [threading.Thread(target=ask, args=(index,)) for index in range(len(asks))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(BOUND_S * 2)
    assert all(reply is not None for reply in replies), replies
    assert [(reply.rank, reply.fault, reply.outcome) for reply in replies if reply] == \
        [(rank, fault, "injected") for rank, fault in asks]
    assert len({reply.req for reply in replies if reply}) == len(asks)
    assert wait_until(lambda: all(state_of(agent.ranks[rank]) == "T" for rank in (3, 4)), BOUND_S)
    stop_and_check(proxy, agent)
