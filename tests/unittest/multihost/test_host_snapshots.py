"""Every host's snapshot and iterations through the hub: real agent processes in UTS namespaces of
their own (another hostname: their ranks are another host's to the hub), real ranks with their stack
dumps registered, real signals, real TCP on loopback (the agent children of test_agent_hub.py).

What the hub's :meth:`~trtllm_liveness.multihost.AgentHub.snapshot` returns, that a remote rank
stopped with SIGSTOP is the one a stall names (with its host), that callers racing a lost host are
each answered within their bound, and that iterations reach the hub batched. No timing is asserted
(scripts/bench_diagnosis.py and scripts/bench_multihost.py measure).
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time

import pytest

from tests.support.facilities import needs
from tests.support.process_tracker import ProcessTracker
from tests.support.waits import wait_until
from tests.unittest.multihost.test_agent_hub import BOUND_S, Engine, start_agent
from trtllm_liveness.diagnose._stack_records import StackSource, StackStatus
from trtllm_liveness.diagnose._stalled_rank import NamingBasis, stalled_rank_now
from trtllm_liveness.multihost._hub_snapshots import ITERATIONS_INTERVAL_S

pytestmark = [needs("mpi", "testhosts"), pytest.mark.real_process, pytest.mark.timeout(90)]


@pytest.fixture
def engine() -> Engine:
    made = Engine()
    yield made  # type: ignore[misc]
    made.close()


def test_the_hubs_snapshot_has_every_remote_rank_with_its_stacks_and_their_source(procs: ProcessTracker,
                                                                                   engine: Engine) -> None:
    b = start_agent(procs, engine, host="fakehostB", ranks=2, first_rank=2, dumps=True)
    c = start_agent(procs, engine, host="fakehostC", ranks=1, first_rank=5, dumps=True)
    hosts = engine.hub.snapshot(BOUND_S)
    assert [(h.host, h.agent_rank, h.outcome) for h in hosts] == [("fakehostB", 2, "answered"),
                                                                  ("fakehostC", 5, "answered")], hosts
    by_rank = {rank.rank: rank for host in hosts for rank in host.ranks}
    assert sorted(by_rank) == [2, 3, 4, 5, 6], by_rank
    for number, pid in [*b.ranks, *c.ranks]:
        rank = by_rank[number]
        assert rank.pid == pid and rank.host in ("fakehostB", "fakehostC") and rank.threads, rank
        assert rank.stacks is not None and rank.stacks.status is StackStatus.TAKEN, rank.stacks
        assert rank.stacks.source in (StackSource.PY_SPY, StackSource.FAULTHANDLER), rank.stacks
        assert rank.stacks.threads and rank.stuck_in is not None, rank.stacks
        if rank.stacks.source is StackSource.FAULTHANDLER:  # why py-spy was not used is said
            assert rank.stacks.other_source, rank.stacks
    # The agents' own ranks are in it too (stacks by either source, or why not).
    for own in (2, 5):
        assert by_rank[own].stacks is not None and by_rank[own].stacks.source is not None, by_rank[own]


def test_a_remote_rank_stopped_with_sigstop_is_the_one_a_stall_names_with_its_host(procs: ProcessTracker,
                                                                                  engine: Engine) -> None:
    agent = start_agent(procs, engine, host="fakehostB", ranks=2, first_rank=2)
    victim_rank, victim = agent.ranks[1]
    os.kill(victim, signal.SIGSTOP)
    try:
        assert wait_until(lambda: _state(victim) == "T", BOUND_S)
        identities = [status.identity for status in engine.monitor.statuses()]
        remote = {rank.rank: rank for host in engine.hub.snapshot(BOUND_S, cpu_window_s=0.0, stacks=False)
                  for rank in host.ranks}
        named = stalled_rank_now(identities, remote=remote)
        assert named is not None and (named.rank, named.pid, named.basis) == (victim_rank, victim,
                                                                             NamingBasis.STOPPED), named
        by_rank = {identity.rank: identity for identity in identities}
        assert by_rank[named.rank].hostname == "fakehostB"
        # Without the agents' evidence nothing singles a remote rank out.
        assert stalled_rank_now(identities) is None
    finally:
        os.kill(victim, signal.SIGCONT)


def test_an_agents_own_verdict_sends_its_snapshot_after_its_event(procs: ProcessTracker, engine: Engine) -> None:
    """SIGKILL of a rank the agent watches: its event, then unasked its snapshot of the host, which
    the hub keeps: when the agent answers nothing later (stopped), a snapshot call still gets the
    host's ranks as they were at the verdict."""
    agent = start_agent(procs, engine, host="fakehostB", ranks=2, first_rank=2, dumps=True)
    victim_rank, victim = agent.ranks[0]
    os.kill(victim, signal.SIGKILL)
    assert wait_until(lambda: engine.events, BOUND_S)
    assert wait_until(lambda: engine.hub._book._verdicts, BOUND_S)
    os.kill(agent.pid, signal.SIGSTOP)
    try:
        (host,) = engine.hub.snapshot(0.3, cpu_window_s=0.0, stacks=False)
    finally:
        os.kill(agent.pid, signal.SIGCONT)
    assert (host.host, host.outcome) == ("fakehostB", "verdict"), host
    assert "no reply within" in host.detail and "its verdict" in host.detail, host
    by_rank = {rank.rank: rank for rank in host.ranks}
    assert sorted(by_rank) == [2, 3, 4], host
    assert by_rank[victim_rank].verdict is not None and by_rank[victim_rank].verdict.is_dead, by_rank[victim_rank]
    alive = by_rank[agent.ranks[1][0]]
    assert alive.stacks is not None and alive.stacks.source is not None, alive


def test_snapshot_callers_racing_a_lost_host_are_each_answered_within_their_bound(procs: ProcessTracker) -> None:
    engine = Engine(heartbeat_timeout_s=1.0, progress="flowing")
    try:
        start_agent(procs, engine, host="fakehostB", ranks=1, first_rank=2)
        silent = start_agent(procs, engine, host="fakehostC", ranks=1, first_rank=4)
        answers: list[list[str]] = []
        errors: list[BaseException] = []
        bound_s = 0.5

        def caller() -> None:
            try:
                for _ in range(6):
                    hosts = engine.hub.snapshot(bound_s, cpu_window_s=0.0, stacks=False)
                    answers.append([f"{h.host}:{h.outcome}" for h in hosts])
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=caller) for _ in range(4)]
        for thread in threads:
            thread.start()
        engine.lose_host(silent.pid)  # its agent answers nothing: the host goes silent, then lost
        try:
            for thread in threads:
                thread.join(BOUND_S * 3)
            assert not any(thread.is_alive() for thread in threads), "a snapshot() call did not return"
            assert not errors, errors
            assert len(answers) == 24
            assert all(len(answer) == 2 and answer[0] == "fakehostB:answered" for answer in answers), answers
            assert all(answer[1] in ("fakehostC:answered", "fakehostC:no-answer", "fakehostC:lost")
                       for answer in answers), answers
            assert wait_until(lambda: any(h.connection == "lost" for h in engine.hub.hosts()), BOUND_S)
            after = engine.hub.snapshot(bound_s, cpu_window_s=0.0, stacks=False)
            assert [(h.host, h.outcome) for h in after] == [("fakehostB", "answered"), ("fakehostC", "lost")]
        finally:
            os.kill(silent.pid, signal.SIGCONT)
    finally:
        engine.close()


@pytest.mark.parametrize("interval_s", [ITERATIONS_INTERVAL_S, 2.5])
def test_iterations_reach_the_hub_at_most_once_per_interval_per_host_and_not_while_idle(
        procs: ProcessTracker, engine: Engine, interval_s: float) -> None:
    seen: dict[int, int] = {}
    engine.hub.feed_iterations(lambda rank, count, at: seen.__setitem__(rank, count))
    # Beats of each rank every 20 ms: progress flowing for >= 3 s (>= 7.5 s at the longer interval,
    # three intervals of it: an agent sending once a second would exceed its bound).
    count, every_s = (150 if interval_s == ITERATIONS_INTERVAL_S else 375), 0.02
    started = time.monotonic()
    agent = start_agent(procs, engine, host="fakehostB", ranks=2, first_rank=2, beats=[count, every_s],
                        iterations_interval_s=interval_s)
    done = agent.line(BOUND_S * 3)
    assert done is not None and done["beats_sent"] == count, done
    elapsed = time.monotonic() - started  # covers the whole time the agent could send
    assert wait_until(lambda: seen == {2: count, 3: count, 4: count}, BOUND_S), seen
    messages = engine.hub._book.iteration_messages
    assert messages == done["messages"]
    # The bound, counted: 3 x 150 beats in at most one message per interval (plus the first).
    assert 1 <= messages <= math.ceil(elapsed / interval_s) + 1, (messages, elapsed)
    assert messages < 3 * count / 10
    # Idle: no iteration changes, no message.
    time.sleep(2 * ITERATIONS_INTERVAL_S)
    assert engine.hub._book.iteration_messages == messages


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as handle:
        return handle.read().rpartition(")")[2].split()[0]
