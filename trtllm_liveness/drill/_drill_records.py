"""What crosses between ``trtllm-liveness drill`` and its engine process: typed records, one JSON
object per line (:mod:`._drill_engine` prints them, :mod:`trtllm_liveness.cli._drill_command` reads
them). Every parser raises ``ValueError`` naming the field; nothing here blocks or imports
TensorRT-LLM.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from ..process._identity import ProcessIdentity

__all__ = ["DrillOptions", "DrillRank", "EngineReady", "EngineReport"]


def _field(document: Any, key: str, kind: type | tuple[type, ...], *, optional: bool = False) -> Any:
    if not isinstance(document, dict):
        raise ValueError(f"drill record: expected an object, got {type(document).__name__}")
    value = document.get(key)
    if value is None and optional:
        return None
    if isinstance(value, bool) and kind is not bool and not (isinstance(kind, tuple) and bool in kind):
        raise ValueError(f"drill record: {key} must be {kind}, got {value!r}")
    if not isinstance(value, kind):
        raise ValueError(f"drill record: {key} must be {kind}, got {value!r}")
    return value


@dataclass(frozen=True)
class DrillOptions:
    """How the engine process runs: the user's ``model`` through ``tensorrt_llm.LLM(model,
    tensor_parallel_size=tp)``; ``engine`` (``module:attribute``, for testing) names a callable that
    turns ``model`` into what is passed instead; ``requests`` streaming requests of up to
    ``max_tokens`` tokens; ``stream_timeout_s`` bounds the model load and the first tokens,
    ``fault_wait_s`` the wait for the fault, ``observe_s`` the watch after it. ``hosts``: the ranks
    span hosts (``--hosts``): the engine waits until every one of the ``tp`` ranks is watched;
    ``session`` (``module:attribute``, for testing) names a callable whose result is passed as the
    LLM's ``_mpi_session`` (the fakes have no ``trtllm-llmapi-launch`` to make one)."""

    model: str
    tp: int = 1
    engine: str = ""
    session: str = ""
    hosts: bool = False
    requests: int = 4
    max_tokens: int = 1024
    stream_timeout_s: float = 600.0
    fault_wait_s: float = 60.0
    observe_s: float = 10.0

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> DrillOptions:
        document = json.loads(text)
        return cls(model=_field(document, "model", str), tp=_field(document, "tp", int),
                   engine=_field(document, "engine", str), session=_field(document, "session", str),
                   hosts=_field(document, "hosts", bool), requests=_field(document, "requests", int),
                   max_tokens=_field(document, "max_tokens", int),
                   stream_timeout_s=float(_field(document, "stream_timeout_s", (int, float))),
                   fault_wait_s=float(_field(document, "fault_wait_s", (int, float))),
                   observe_s=float(_field(document, "observe_s", (int, float))))


@dataclass(frozen=True)
class DrillRank:
    """One rank as the engine's monitor registered it (its identity) and how it is watched."""

    rank: int
    pid: int
    start_time: int | None
    host: str
    pid_namespace: int | None
    method: str

    def identity(self) -> ProcessIdentity:
        return ProcessIdentity(rank=self.rank, pid=self.pid, start_time=self.start_time, hostname=self.host,
                               pid_namespace=self.pid_namespace)

    @classmethod
    def from_dict(cls, document: Any) -> DrillRank:
        return cls(rank=_field(document, "rank", int), pid=_field(document, "pid", int),
                   start_time=_field(document, "start_time", int, optional=True), host=_field(document, "host", str),
                   pid_namespace=_field(document, "pid_namespace", int, optional=True),
                   method=_field(document, "method", str))


@dataclass(frozen=True)
class EngineReady:
    """The engine is up and every request streams: its ranks, the engine process, the TensorRT-LLM
    that runs it; ``agents``: the ranks that run a remote host's agent (none on one host)."""

    ranks: tuple[DrillRank, ...]
    proxy_pid: int
    version: str
    streaming: int
    agents: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"ranks": [asdict(rank) for rank in self.ranks], "proxy_pid": self.proxy_pid,
                "version": self.version, "streaming": self.streaming, "agents": list(self.agents)}

    @classmethod
    def from_dict(cls, document: Any) -> EngineReady:
        ranks = _field(document, "ranks", list)
        agents = _field(document, "agents", list, optional=True) or []
        if not all(isinstance(rank, int) and not isinstance(rank, bool) for rank in agents):
            raise ValueError(f"drill record: agents must be a list of ranks, got {agents!r}")
        return cls(ranks=tuple(DrillRank.from_dict(rank) for rank in ranks),
                   proxy_pid=_field(document, "proxy_pid", int), version=_field(document, "version", str),
                   streaming=_field(document, "streaming", int), agents=tuple(agents))


@dataclass(frozen=True)
class EngineReport:
    """What followed the fault, as monotonic times (CLOCK_MONOTONIC: one clock for the machine, so
    the drill subtracts its own fault time): the monitor's first event, the first ``check_health()``
    that answered False, when every request had failed, when tokens stopped; the fatal error (its
    message, kind, rank, whether restartable); ``pending``: requests neither finished nor failed when
    the watch ended; then ``shutdown()``: how long it took and the ranks it left unkillable."""

    detected_at: float | None
    health_false_at: float | None
    failed_all_at: float | None
    tokens_stopped_at: float | None
    fatal: str
    fatal_kind: str
    fatal_rank: int | None
    restartable: bool | None
    pending: int
    total: int
    shutdown_s: float | None
    unkillable: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        document = asdict(self)
        document["unkillable"] = list(self.unkillable)
        return document

    @classmethod
    def from_dict(cls, document: Any) -> EngineReport:
        def stamp(key: str) -> float | None:
            value = _field(document, key, (int, float), optional=True)
            return None if value is None else float(value)

        unkillable = _field(document, "unkillable", list)
        if not all(isinstance(pid, int) and not isinstance(pid, bool) for pid in unkillable):
            raise ValueError(f"drill record: unkillable must be a list of pids, got {unkillable!r}")
        return cls(detected_at=stamp("detected_at"), health_false_at=stamp("health_false_at"),
                   failed_all_at=stamp("failed_all_at"), tokens_stopped_at=stamp("tokens_stopped_at"),
                   fatal=_field(document, "fatal", str), fatal_kind=_field(document, "fatal_kind", str),
                   fatal_rank=_field(document, "fatal_rank", int, optional=True),
                   restartable=_field(document, "restartable", bool, optional=True),
                   pending=_field(document, "pending", int), total=_field(document, "total", int),
                   shutdown_s=stamp("shutdown_s"), unkillable=tuple(unkillable))


def choose_victim(candidates: list[DrillRank], wanted: int | None, *, where: str, none: str,
                  also: str = "") -> DrillRank | str:
    """The rank to hit among ``candidates``: ``wanted``, or the highest; else why not (``where``
    names the ranks that may be hit, ``also`` adds to the list of those, ``none`` says why there
    are none)."""
    if wanted is not None:
        chosen = [rank for rank in candidates if rank.rank == wanted]
        if chosen:
            return chosen[0]
        return f"rank {wanted} is not {where} (hittable: {[rank.rank for rank in candidates] or 'none'}{also})"
    if not candidates:
        return none
    return max(candidates, key=lambda rank: rank.rank)
