"""The host agent's iterations messages, at the unit level (the agent's thread is not started; its
socket is a recorder of what would be sent): a wall clock stepped back does not silence them."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

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
    made = HostAgent(AgentSettings("tcp://127.0.0.1:1", b"k" * 32, 1.0, None, iterations_interval_s=1.0), OWN, [OTHER])
    try:
        yield made
    finally:
        os.close(made._wake_r)
        os.close(made._wake_w)


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
