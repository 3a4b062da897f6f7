"""``drill --hosts``'s parts that need no process: the host list, the launch line, the choice of the
rank of another host, and the agent's answer to a fault request it cannot take (never a crash, never
a signal). The drill across real test hosts is tests/unittest/multihost/test_drill_hosts.py."""

from __future__ import annotations

import sys

import pytest

from trtllm_liveness.drill._drill_hosts import launch_argv, parse_hosts, remote_victim
from trtllm_liveness.drill._drill_records import DrillRank, EngineReady
from trtllm_liveness.multihost import _wire
from trtllm_liveness.multihost._drill_faults import AgentFaults, FaultReply
from trtllm_liveness.process._identity import ProcessIdentity

SID = "0" * 32


def test_the_host_list_is_mpiruns_and_the_launch_is_the_readmes_line() -> None:
    hosts = parse_hosts("node1:4, node2")
    assert hosts == (("node1", 4), ("node2", 1))
    argv = launch_argv(hosts, "mpirun", "--map-by slot", "trtllm-llmapi-launch")
    assert argv == [sys.executable, "-m", "trtllm_liveness.cli", "launch", "--", "mpirun", "--host", "node1:4,node2:1",
                    "-n", "5", "--map-by", "slot", "trtllm-llmapi-launch"]


@pytest.mark.parametrize(("value", "why"), [
    ("node1:4", "at least two hosts"), ("node1:4,node1:2", "named twice"), ("node1:0,node2:1", "bad entry"),
    ("node1:x,node2", "bad entry"), ("-oProxyCommand=x:1,node2", "bad entry"), ("node1,,node2", "bad entry"),
])
def test_a_bad_host_list_is_refused_naming_the_entry(value: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_hosts(value)


def _rank(rank: int, host: str, method: str, start: int | None = 100) -> DrillRank:
    return DrillRank(rank=rank, pid=1000 + rank, start_time=start, host=host, pid_namespace=None, method=method)


READY = EngineReady(ranks=(_rank(1, "node1", "pidfd"), _rank(2, "node2", "agent"), _rank(3, "node2", "agent"),
                           _rank(4, "node3", "agent"), _rank(5, "node3", "agent", start=None)),
                    proxy_pid=999, version="x", streaming=4, agents=(2, 4))


def test_the_victim_is_a_rank_of_another_host_never_an_agents_or_the_proxys_hosts() -> None:
    victim = remote_victim(READY, None)
    assert not isinstance(victim, str) and (victim.rank, victim.host) == (3, "node2")
    for wanted in (1, 2, 4, 5, 9):  # the proxy's host, an agent's rank, no start time, no such rank
        why = remote_victim(READY, wanted)
        assert isinstance(why, str) and "hittable: [3]" in why, why
    alone = EngineReady(ranks=(_rank(1, "node1", "pidfd"), _rank(2, "node2", "agent")), proxy_pid=999,
                        version="x", streaming=4, agents=(2,))
    assert "at least 2 slots" in str(remote_victim(alone, None))


@pytest.mark.parametrize("body", [
    {"req": 1, "rank": 3, "fault": "boom"}, {"req": "1", "rank": 3, "fault": "kill"},
    {"req": 1, "rank": -1, "fault": "kill"}, {"req": 1, "rank": True, "fault": "kill"}, {},
])
def test_a_malformed_fault_request_is_answered_refused_and_logged(body: dict[str, object],
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    own = ProcessIdentity(rank=2, pid=1, start_time=1, hostname="node2", pid_namespace=None)
    faults = AgentFaults(True, own, [])
    fields = faults.handle(_wire.Message("fault", SID, 1, {**body, "k": "fault", "sid": SID, "n": 1}))
    assert fields["outcome"] == "refused" and "malformed fault request" in fields["detail"], fields
    assert fields["pid"] == 0 and fields["age"] is None
    assert faults.rejected == 1 and "rejected a fault request (1 so far)" in caplog.text


def test_a_request_for_a_rank_the_agent_does_not_watch_never_signals() -> None:
    """Pid 1 as the agent's own rank: the request names it, the agent refuses (it hits only the ranks
    it registered, verified by start time)."""
    own = ProcessIdentity(rank=2, pid=1, start_time=1, hostname="node2", pid_namespace=None)
    faults = AgentFaults(True, own, [])
    for rank in (2, 7):
        fields = faults.handle(_wire.Message("fault", SID, 1, {"req": 5, "rank": rank, "fault": "kill"}))
        assert (fields["outcome"], fields["req"], fields["rank"], fields["pid"]) == ("refused", 5, rank, 0), fields


def test_a_reply_round_trips_and_a_malformed_one_is_refused() -> None:
    reply = FaultReply(3, 4, "wedge", "injected", "node2", 77, "frozen", 12.5)
    assert FaultReply.from_dict(reply.to_dict()) == reply
    for bad in ({**reply.to_dict(), "pid": "77"}, {**reply.to_dict(), "at": True}, [], {"req": 1}):
        with pytest.raises(ValueError, match="fault reply"):
            FaultReply.from_dict(bad)
