"""What crosses between ``trtllm-liveness drill`` and its engine process: typed records, one JSON
object per line (:mod:`._drill_engine` prints them, :mod:`trtllm_liveness.cli._drill_command` reads
them). Every parser raises ``ValueError`` naming the field; nothing here blocks or imports
TensorRT-LLM.
"""

from __future__ import annotations

from dataclasses import dataclass

from .._record_fields import JsonRecord
from ..process._identity import ProcessIdentity, is_local

__all__ = ["DrillOptions", "DrillRank", "EngineReady", "EngineReport", "choose_victim", "local_ranks"]


@dataclass(frozen=True)
class DrillOptions(JsonRecord):
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


@dataclass(frozen=True)
class DrillRank(JsonRecord):
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


@dataclass(frozen=True)
class EngineReady(JsonRecord):
    """The engine is up and every request streams: its ranks, the engine process, the TensorRT-LLM
    that runs it; ``agents``: the ranks that run a remote host's agent (none on one host)."""

    ranks: tuple[DrillRank, ...]
    proxy_pid: int
    version: str
    streaming: int
    agents: tuple[int, ...] = ()

    json_optional = ("agents",)


@dataclass(frozen=True)
class EngineReport(JsonRecord):
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


def local_ranks(ranks: tuple[DrillRank, ...], besides: int) -> list[DrillRank]:
    """The ranks of ``ranks`` that run on this host, their identity verified (a start time), but the
    process ``besides`` (the engine's own, which hosts rank 0)."""
    return [rank for rank in ranks if is_local(rank.identity()) and rank.start_time is not None and rank.pid != besides]
