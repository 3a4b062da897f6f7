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
Each rank comes in as its :class:`~._diagnosis_record.RankDiagnosis` (the diagnosis's, with the
CPU window that tells spinning from sleeping, or a remote host's agent's). :func:`stalled_rank_now`
reads only the thread states (no CPU window, so no spinning evidence) for a caller that must not
wait, such as the stall timer's fatal event; this module imports nothing heavier than procfs
parsing and the records for that. :func:`~._diagnosis.stalled_rank_of` takes the diagnosis's short
snapshot and so has all the evidence.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..process import _procfs
from ..process._identity import ProcessIdentity, is_local
from ._diagnosis_record import Activity, NamingBasis, RankDiagnosis, StalledRank, ThreadDiagnosis
from ._scan import Verdict, wchan_or_empty

# NamingBasis and StalledRank (:mod:`._diagnosis_record`) are re-exported for callers of the naming.
__all__ = ["DEFAULT_CPU_WINDOW_S", "NamingBasis", "StalledRank", "name_stalled_rank", "stalled_rank_now"]

DEFAULT_CPU_WINDOW_S = 0.1
"""The CPU window of :func:`~._diagnosis.stalled_rank_of`: 10 ticks at ``CLK_TCK`` 100, enough to tell a
spinning thread from a sleeping one."""


_SEEN = frozenset({Activity.IN_D, Activity.STOPPED, Activity.SPINNING, Activity.SLEEPING, Activity.RUNNING})
"""What a rank alive and seen did; a rank ``running`` (some CPU, or not measured) is neither spinning nor sleeping."""
_STATE_BASES = (NamingBasis.GONE, NamingBasis.STOPPED, NamingBasis.IN_D)  # strongest first


def _activity(rank: RankDiagnosis) -> Activity | None:
    """What the naming reads of a rank: its activity where it is alive and was seen, else None."""
    if rank.verdict is None or rank.verdict is Verdict.ACCESS_DENIED or rank.verdict.is_dead:
        return None
    return rank.activity if rank.activity in _SEEN else None


def _state_basis(rank: RankDiagnosis) -> NamingBasis | None:
    """Gone, stopped or in ``D``: why the rank cannot be the one waiting on the others, if so."""
    if rank.verdict is not None and rank.verdict.is_dead:
        return NamingBasis.GONE
    activity = _activity(rank)
    return NamingBasis.STOPPED if activity is Activity.STOPPED else NamingBasis.IN_D if activity is Activity.IN_D \
        else None


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(map(str, ranks))


def _state_evidence(ranks: Sequence[RankDiagnosis]) -> StalledRank | None:
    found = sorted(((_STATE_BASES.index(basis), rank.rank, rank) for rank in ranks
                    if (basis := _state_basis(rank)) is not None), key=lambda item: item[:2])
    if not found:
        return None
    rank = found[0][2]
    basis = _STATE_BASES[found[0][0]]
    if basis is NamingBasis.GONE:
        evidence = f"rank {rank.rank} is gone ({rank.detail})"
    elif basis is NamingBasis.STOPPED:
        main = rank.main_thread
        evidence = f"rank {rank.rank} is stopped ({main.state if main is not None else 'T'})"
    else:
        d_threads = [thread for thread in rank.threads if thread.activity is Activity.IN_D]
        wchan = d_threads[0].wchan if d_threads else ""
        evidence = f"rank {rank.rank} has {len(d_threads)} thread(s) in D" + (f" in {wchan}" if wchan else "")
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
    seen = [rank for rank in ranks if _activity(rank) is not None]
    spinning = [rank for rank in seen if rank.activity is Activity.SPINNING and rank.rank != leader]
    others = [rank for rank in seen if rank not in spinning and rank.rank != leader]
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


def _states_only(rank: int, pid: int, start_time: int | None) -> RankDiagnosis:
    """One rank from its thread states alone: gone, stopped, in D, or alive (not measured)."""
    try:
        info = _procfs.read_stat(pid)
        states = _procfs.read_thread_states(pid)
    except (OSError, ValueError):
        return RankDiagnosis(rank, pid, Verdict.GONE, "no such process", Activity.EXITED, ())
    if start_time is not None and info.start_time != start_time:
        return RankDiagnosis(rank, pid, Verdict.GONE, "its pid now belongs to another process", Activity.EXITED, ())
    if info.exited:
        return RankDiagnosis(rank, pid, Verdict.ZOMBIE, "exited, not reaped", Activity.EXITED, ())
    d_tids = _procfs.uninterruptible_tids(states)
    if d_tids:
        wchan = wchan_or_empty(pid, d_tids[0])
        threads = tuple(ThreadDiagnosis(tid, "", states[tid], Activity.IN_D, None, wchan if tid == d_tids[0] else "",
                                        0.0, False) for tid in d_tids)
        return RankDiagnosis(rank, pid, Verdict.D_STATE, "", Activity.IN_D, threads)
    if info.state in _procfs.STOPPED_STATES:
        main = ThreadDiagnosis(pid, "", info.state, Activity.STOPPED, None, "", 0.0, False)
        return RankDiagnosis(rank, pid, Verdict.STOPPED, "", Activity.STOPPED, (main,))
    # Alive, its CPU not measured: to the naming neither spinning nor sleeping (see _SEEN).
    return RankDiagnosis(rank, pid, Verdict.OK, "", Activity.RUNNING, ())


def stalled_rank_now(targets: Sequence[ProcessIdentity], *, iterations: Mapping[int, int] | None = None,
                     remote: Mapping[int, RankDiagnosis] | None = None) -> StalledRank | None:
    """:func:`name_stalled_rank` from the ranks' thread states read now (one ``stat`` per thread,
    a wait channel for a rank in ``D``) and ``iterations``: no CPU window, so never by spinning.
    Ranks of another host or PID namespace count by ``remote`` (rank -> its record, as its host's
    agent saw it) where given, else only by their iterations. Blocks for those procfs reads
    only; never raises for a process that is gone or unreadable. Thread-safe."""
    ranks: list[RankDiagnosis] = []
    for identity in targets:
        if remote is not None and identity.rank in remote:
            ranks.append(remote[identity.rank])
        elif not is_local(identity):
            ranks.append(RankDiagnosis(identity.rank, identity.pid, None, "not local", Activity.UNKNOWN, ()))
        else:
            ranks.append(_states_only(identity.rank, identity.pid, identity.start_time))
    return name_stalled_rank(ranks, iterations=iterations)
