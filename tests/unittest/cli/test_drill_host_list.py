"""``drill --hosts``'s parts that need no process: the host list, the launch line, the choice of the
rank of another host, the agent's answer to a fault request it cannot take (never a crash, never
a signal), and what makes an engine's agents a drill's. The drill across real test hosts is
tests/unittest/multihost/test_drill_hosts.py."""

from __future__ import annotations

import sys

import pytest

from trtllm_liveness import LivenessConfig, StopReport
from trtllm_liveness.drill._drill_faults import AgentFaults, DrillHub, FaultReply
from trtllm_liveness.drill._drill_hosts import launch_argv, parse_hosts, remote_victim
from trtllm_liveness.drill._drill_records import DrillRank, EngineReady
from trtllm_liveness.integrations.trtllm import _hosts
from trtllm_liveness.monitor import WorkerProcessMonitor
from trtllm_liveness.multihost import AgentHub, AgentSettings, _wire
from trtllm_liveness.multihost._agent_faults import FaultHandler
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
    faults = AgentFaults(own, [])
    fields = faults.handle(_wire.Message("fault", SID, 1, {**body, "k": "fault", "sid": SID, "n": 1}))
    assert fields["outcome"] == "refused" and "malformed fault request" in fields["detail"], fields
    assert fields["pid"] == 0 and fields["age"] is None
    assert faults.rejected.count == 1 and "rejected a fault request (1 so far)" in caplog.text


def test_a_request_for_a_rank_the_agent_does_not_watch_never_signals() -> None:
    """Pid 1 as the agent's own rank: the request names it, the agent refuses (it hits only the ranks
    it registered, verified by start time)."""
    own = ProcessIdentity(rank=2, pid=1, start_time=1, hostname="node2", pid_namespace=None)
    faults = AgentFaults(own, [])
    for rank in (2, 7):
        fields = faults.handle(_wire.Message("fault", SID, 1, {"req": 5, "rank": rank, "fault": "kill"}))
        assert (fields["outcome"], fields["req"], fields["rank"], fields["pid"]) == ("refused", 5, rank, 0), fields


def test_a_reply_round_trips_and_a_malformed_one_is_refused() -> None:
    reply = FaultReply(3, 4, "wedge", "injected", "node2", 77, "frozen", 12.5)
    assert FaultReply.from_dict(reply.to_dict()) == reply
    for bad in ({**reply.to_dict(), "pid": "77"}, {**reply.to_dict(), "at": True}, [], {"req": 1}):
        with pytest.raises(ValueError, match=r"^FaultReply: "):
            FaultReply.from_dict(bad)


def test_an_agent_not_started_for_a_drill_refuses_every_fault_request(caplog: pytest.LogCaptureFixture) -> None:
    """Every agent's fault handler but a drill's (the settings' default, and what a plain hub's
    settings get): refused, logged, nothing made, whichever rank it names."""
    own = ProcessIdentity(rank=2, pid=1, start_time=1, hostname="node2", pid_namespace=None)
    watched = ProcessIdentity(rank=3, pid=1, start_time=1, hostname="node2", pid_namespace=None)
    faults = AgentSettings("tcp://10.0.0.1:5555", b"k" * 32, 1.0, None).faults(own, [watched])
    fields = faults.handle(_wire.Message("fault", SID, 1, {"req": 5, "rank": 3, "fault": "kill"}))
    assert fields == {"req": 5, "rank": 3, "fault": "kill", "outcome": "refused", "pid": 0, "age": None,
                      "detail": "the agent on host node2 refuses faults: its engine was not started as a drill"}
    assert "the host agent on node2 rejected a fault request (1 so far): rank 3, fault 'kill': this engine was " \
           "not started as a drill" in caplog.text
    report = StopReport((), (), 0.5, 1.0, "SIGTERM", 0.0, 0.0)
    assert faults.after_stop(report) is report


def test_only_the_drill_engines_hub_hands_its_agents_the_drills_fault_handler(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine's hub is a plain one, whose agents refuse faults, until its process hands the
    engine the drill's hub (as the drill's engine process alone does)."""
    monkeypatch.setattr(_hosts, "_hub_class", None)  # this process's choice, restored after the test
    config = LivenessConfig(enabled=True, hosts_bind="127.0.0.1")
    monitor = WorkerProcessMonitor()
    try:
        for kind, faults in ((AgentHub, FaultHandler), (DrillHub, AgentFaults)):
            if kind is DrillHub:
                _hosts.use_hub_class(DrillHub)
            hub = _hosts.start_hub(config, monitor)
            assert hub is not None and type(hub) is kind
            try:
                assert hub.agent_settings().faults is faults
            finally:
                hub.close()
    finally:
        monitor.close()
