"""Every rank takes part in both of ``start_for_rank``'s collectives, also the rank whose host
agent fails to start: a rank that skipped the second ``allgather`` would leave every other rank of
the engine blocked in it at start-up.

One rank on one host, its communicator a recorder of the collectives (the multi-rank case with
real MPI is in test_agents.py); the agent's start fails as it would on a refused connection."""

from __future__ import annotations

from typing import Any

import pytest

from trtllm_liveness.multihost import _placement
from trtllm_liveness.multihost._agent import AgentSettings

pytestmark = [pytest.mark.timeout(30)]


class RecordingComm:
    """A one-rank communicator that records each ``allgather``."""

    def __init__(self) -> None:
        self.gathered: list[Any] = []

    def Get_rank(self) -> int:
        return 0

    def allgather(self, value: Any) -> list[Any]:
        self.gathered.append(value)
        return [value]


class FailingAgent:
    def __init__(self, *args: Any) -> None:
        pass

    def start(self) -> FailingAgent:
        raise OSError("cannot reach the hub")


def test_a_rank_whose_agent_fails_to_start_still_joins_the_second_allgather(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_placement, "HostAgent", FailingAgent)
    comm = RecordingComm()
    settings = AgentSettings("tcp://127.0.0.1:1", b"k" * 32, 1.0, None)
    agent, beats = _placement.start_for_rank(settings, comm, None, open_beats=lambda agent: ("ipc://x", "t"))
    assert (agent, beats) == (None, None)
    assert len(comm.gathered) == 2 and comm.gathered[1] is None, comm.gathered
