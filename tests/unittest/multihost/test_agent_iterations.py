"""The host agent's loop, at the unit level (the agent's thread is not started; its socket is a
recorder of what would be sent, or frames already queued): a wall clock stepped back does not
silence the iterations messages; a snapshot request whose caller gave up is skipped; the unasked
verdict snapshot is taken once per verdict."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import pytest

from trtllm_liveness._events import EventKind, WorkerEvent
from trtllm_liveness.multihost import _agent
from trtllm_liveness.multihost._agent import AgentSettings, HostAgent
from trtllm_liveness.process._identity import ProcessIdentity

pytestmark = [pytest.mark.timeout(30)]

OWN = ProcessIdentity(2, 4242, 100, "hostB", None)
OTHER = ProcessIdentity(3, 4243, 101, "hostB", None)


class RecordingSocket:
    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def send(self, frame: bytes, *flags: Any) -> None:
        self.sent.append(frame)


@pytest.fixture
def agent() -> Iterator[HostAgent]:
    yield HostAgent(AgentSettings("tcp://127.0.0.1:1", b"k" * 32, 1.0, None, iterations_interval_s=1.0), OWN, [OTHER])


def test_a_wall_clock_stepped_back_does_not_silence_the_iterations(agent: HostAgent,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    sock = RecordingSocket()
    wall = [1_000_000.0]
    monkeypatch.setattr(_agent.time, "time", lambda: wall[0])
    agent.note_iteration(3, 1, 0.0)
    agent._send_iterations(sock)
    assert len(sock.sent) == 1
    wall[0] -= 3600.0  # the clock is stepped back an hour
    agent.note_iteration(3, 2, 0.0)
    agent._send_iterations(sock)
    assert len(sock.sent) == 2, "no iterations message for as long as the clock was stepped back"


class QueuedFrames:
    """The agent's socket with frames already queued (as ZMQ holds them until read)."""

    def __init__(self, frames: list[bytes]) -> None:
        self.frames = frames

    def recv(self, flags: int = 0) -> bytes:
        import zmq

        if not self.frames:
            raise zmq.Again()
        return self.frames.pop(0)


def test_a_snapshot_request_whose_caller_gave_up_is_skipped_before_a_queued_stop(
        agent: HostAgent, monkeypatch: pytest.MonkeyPatch) -> None:
    import zmq

    from trtllm_liveness.multihost import _wire

    taken: list[int] = []

    def slow_snapshot(sock: Any, request: Any) -> None:
        taken.append(request.req)
        time.sleep(0.5)  # longer than the next request's caller waits

    monkeypatch.setattr(agent, "_snapshot", slow_snapshot)
    stops: list[Any] = []
    monkeypatch.setattr(agent, "_stop_requested", lambda sock, monitor, message: stops.append(message.kind))
    secret = agent.settings.secret
    frames = [_wire.encode(secret, _wire.TO_AGENT, "snapreq", agent.sid, seq, req=seq, cpu=0.0, stacks=False, st=0.1,
                           exp=0.2) for seq in (1, 2)]
    frames.append(_wire.encode(secret, _wire.TO_AGENT, "stop", agent.sid, 3, grace=0.1, kill=0.1, req=1))
    assert agent._receive(zmq, QueuedFrames(frames), None) == "stop"  # type: ignore[arg-type]
    assert taken == [1] and stops == ["stop"], (taken, stops)


class Failing:
    def __init__(self) -> None:
        self.failure: Any = None


def test_the_unasked_verdict_snapshot_is_taken_once_per_verdict(agent: HostAgent,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    taken: list[int] = []
    monkeypatch.setattr(agent, "_snapshot", lambda sock, request: taken.append(request.req))
    monitor = Failing()
    sock = RecordingSocket()
    first = object()
    for event in ("died", "lost"):  # two batches of events of the same verdict
        monitor.failure = first
        agent._pending.append(_event(event))
        agent._send_events(sock, monitor)  # type: ignore[arg-type]
    assert taken == [0]
    monitor.failure = object()  # another verdict
    agent._pending.append(_event("died"))
    agent._send_events(sock, monitor)  # type: ignore[arg-type]
    assert taken == [0, 0]


def _event(kind: str) -> WorkerEvent:
    return WorkerEvent(EventKind(kind), OTHER, f"rank 3 {kind}", detected_at=time.monotonic())


def test_a_failed_snapshot_is_a_warning_and_the_reply_still_goes(agent: HostAgent, monkeypatch: pytest.MonkeyPatch,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    from trtllm_liveness.diagnose import _diagnosis

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("diagnosis broke")

    monkeypatch.setattr(_diagnosis, "diagnose", broken)
    sock = RecordingSocket()
    agent._snapshot(sock, _agent.VERDICT_SNAPSHOT)
    assert len(sock.sent) == 1  # the reply, without ranks
    assert [record.levelname for record in caplog.records if record.levelno >= logging.WARNING] == ["WARNING"]
    assert "diagnosis broke" in caplog.text


def test_the_agent_forwards_only_its_own_ranks_iterations(agent: HostAgent) -> None:
    agent.note_iteration(OWN.rank, 5, 0.0)
    agent.note_iteration(OTHER.rank, 6, 0.0)
    agent.note_iteration(99, 7, 0.0)  # not a rank of this host: the hub would reject the whole message
    assert sorted(rank for rank, _count, _at in agent._changed_iterations()) == [OWN.rank, OTHER.rank]


class Armed:
    def __init__(self) -> None:
        self.armed: list[float | None] = []

    def arm_wedge_detection(self, timeout: float | None) -> None:
        self.armed.append(timeout)


def test_each_command_is_parsed_once_and_a_malformed_one_is_a_logged_rejection(
        agent: HostAgent, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The hub's commands reach the agent as typed records; one with a field of the wrong type or
    range is rejected (counted, logged), never acted on, and the next one is still taken."""
    import zmq

    from trtllm_liveness.multihost import _wire

    stops: list[Any] = []
    monkeypatch.setattr(agent, "_stop_requested", lambda sock, monitor, command: stops.append(command))
    secret, monitor = agent.settings.secret, Armed()
    frames = [_wire.encode(secret, _wire.TO_AGENT, "arm", agent.sid, 1, d="soon"),
              _wire.encode(secret, _wire.TO_AGENT, "arm", agent.sid, 2, d=5),
              _wire.encode(secret, _wire.TO_AGENT, "stop", agent.sid, 3, grace=-1.0, kill=0.1, req=1),
              _wire.encode(secret, _wire.TO_AGENT, "stop", agent.sid, 4, grace=0.5, kill=1.0, req=7)]
    with caplog.at_level(logging.WARNING):
        assert agent._receive(zmq, QueuedFrames(frames), monitor) == "stop"  # type: ignore[arg-type]
    assert monitor.armed == [5.0]
    assert stops == [_wire.StopCommand(0.5, 1.0, 7)]
    assert agent.rejected.count == 2
    assert "arm: field 'd' must be a number" in caplog.text and "stop: field 'grace' must be a number" in caplog.text
    rejection = _wire.encode(secret, _wire.TO_AGENT, "reject", agent.sid, 5, **_wire.Rejection("not ours").fields())
    assert agent._receive(zmq, QueuedFrames([rejection]), monitor) == "refused"  # type: ignore[arg-type]
