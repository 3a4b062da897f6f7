"""Which rank a stall is named after, from evidence, and what the naming rests on.

When an engine stalls, every rank waits on every other: the one to name is the one that stopped
first. The evidence, strongest first:

1. **gone, stopped or in D**: a rank whose process exited, that is stopped (``T``: SIGSTOP, a
   tracer) or that has a thread in uninterruptible sleep cannot be the one waiting on the others;
2. **behind in iterations**: the rank whose executor loop counted the fewest iterations (the
   others did one more before they blocked on it);
3. **spinning while the others sleep**: one rank on CPU while all the others sleep. Never above
   the first two: a rank busy-polling in a collective whose peer is gone spins too, and the leader
   (rank 0) busy-polls its request queue, so the leader is never named for spinning.

Nothing names the leader by default: without evidence :func:`name_stalled_rank` returns None.
:func:`stalled_rank_of` takes the short procfs snapshot the evidence needs (no stacks).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..process._identity import ProcessIdentity
from ._diagnosis import Activity, RankDiagnosis

__all__ = ["NamingBasis", "StalledRank", "name_stalled_rank", "stalled_rank_of"]

DEFAULT_CPU_WINDOW_S = 0.1
"""The CPU window of :func:`stalled_rank_of`: 10 ticks at ``CLK_TCK`` 100, enough to tell a
spinning thread from a sleeping one."""


class NamingBasis(str, enum.Enum):
    """What a stalled rank's naming rests on, strongest first."""

    GONE = "gone"
    STOPPED = "stopped"
    IN_D = "in-d"
    BEHIND = "behind"
    SPINNING = "spinning"


@dataclass(frozen=True)
class StalledRank:
    """The rank a stall is named after, the kind of evidence and that evidence in a few words."""

    rank: int
    pid: int
    basis: NamingBasis
    evidence: str

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"rank": self.rank, "pid": self.pid, "basis": self.basis.value, "evidence": self.evidence}


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(map(str, ranks))


def _state_evidence(ranks: Sequence[RankDiagnosis]) -> StalledRank | None:
    found: list[tuple[int, int, RankDiagnosis, NamingBasis, str]] = []
    for rank in ranks:
        if rank.verdict is not None and rank.verdict.is_dead:
            found.append((0, rank.rank, rank, NamingBasis.GONE, f"rank {rank.rank} is gone ({rank.detail})"))
        elif rank.activity is Activity.STOPPED:
            main = rank.main_thread
            state = main.state if main is not None else "T"
            found.append((1, rank.rank, rank, NamingBasis.STOPPED, f"rank {rank.rank} is stopped ({state})"))
        elif rank.activity is Activity.IN_D:
            d_threads = [thread for thread in rank.threads if thread.activity is Activity.IN_D]
            where = f" in {d_threads[0].wchan}" if d_threads and d_threads[0].wchan else ""
            found.append((2, rank.rank, rank, NamingBasis.IN_D,
                          f"rank {rank.rank} has {len(d_threads)} thread(s) in D{where}"))
    if not found:
        return None
    found.sort(key=lambda item: item[:2])
    _order, _number, rank, basis, evidence = found[0]
    if len(found) > 1:
        evidence += f"; also {_ranks([item[1] for item in found[1:]])}"
    return StalledRank(rank.rank, rank.pid, basis, evidence)


def _iteration_evidence(ranks: Sequence[RankDiagnosis], iterations: Mapping[int, int],
                        leader: int | None) -> StalledRank | None:
    known = {rank.rank: rank for rank in ranks if rank.rank in iterations}
    counts = {number: iterations[number] for number in known}
    if len(counts) < 2 or min(counts.values()) == max(counts.values()):
        return None
    lowest = min(counts.values())
    behind = sorted(number for number, count in counts.items() if count == lowest)
    ahead = sorted(number for number in counts if number not in behind)
    named = next((number for number in behind if number != leader), behind[0])
    who = f"rank {named}" if len(behind) == 1 else f"ranks {_ranks(behind)}"
    evidence = (f"{who} at {lowest} executor iteration(s), ranks {_ranks(ahead)} at "
                f"{_ranks(sorted({counts[number] for number in ahead}))}")
    return StalledRank(named, known[named].pid, NamingBasis.BEHIND, evidence)


def _spin_evidence(ranks: Sequence[RankDiagnosis], leader: int | None) -> StalledRank | None:
    alive = [rank for rank in ranks if rank.verdict is not None and not rank.verdict.is_dead
             and rank.activity is not Activity.UNKNOWN]
    spinning = [rank for rank in alive if rank.activity is Activity.SPINNING and rank.rank != leader]
    others = [rank for rank in alive if rank not in spinning and rank.rank != leader]
    if len(spinning) != 1 or not others or any(rank.activity is not Activity.SLEEPING for rank in others):
        return None
    (named,) = spinning
    return StalledRank(named.rank, named.pid, NamingBasis.SPINNING,
                       f"rank {named.rank} spins while ranks {_ranks(sorted(rank.rank for rank in others))} sleep")


def name_stalled_rank(ranks: Sequence[RankDiagnosis], *, iterations: Mapping[int, int] | None = None,
                      leader: int | None = 0) -> StalledRank | None:
    """The rank to name for a stall of ``ranks``, by the precedence of the module docstring.

    ``iterations`` maps rank numbers to the executor iterations each reported (ranks missing
    from it are not compared); ``leader`` is the rank never named for spinning (None: no leader).
    Returns None when no evidence singles a rank out (never a default rank). Pure function.
    """
    return (_state_evidence(ranks)
            or (_iteration_evidence(ranks, iterations, leader) if iterations else None)
            or _spin_evidence(ranks, leader))


def stalled_rank_of(targets: Sequence[ProcessIdentity | int], *, iterations: Mapping[int, int] | None = None,
                    leader: int | None = 0, cpu_window_s: float = DEFAULT_CPU_WINDOW_S) -> StalledRank | None:
    """Take a short procfs snapshot of ``targets`` (no stacks) and name the stalled rank.

    Blocks about ``cpu_window_s`` plus procfs reads (``window_s`` 0: one scan sample; a rank in
    ``D`` is not confirmed over a window). Never raises for a process that is gone or
    unreadable. Thread-safe.
    """
    from ._diagnosis import diagnose

    diagnosis = diagnose(targets, stacks=False, window_s=0.0, cpu_window_s=cpu_window_s, iterations=iterations,
                         leader=leader)
    return diagnosis.named
