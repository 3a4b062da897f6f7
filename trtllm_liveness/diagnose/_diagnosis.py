"""Where is every rank stuck? A bounded snapshot of local processes for an operator.

:func:`diagnose` builds on :func:`._scan.scan` (per thread: state, wait channel, time in ``D``,
SIGKILL pending, the process verdict; command lines read through
:class:`~trtllm_liveness.process._mm_read.MmReader`) and adds what a scan does not measure:

- **CPU time over a short window** per thread (``utime + stime`` of ``task/<tid>/stat``, read just
  before and just after the scan's samples), which classifies each thread (:class:`Activity`;
  docs/diagnosis.md lists the classes). A rank that spins in a collective whose peer is gone
  looks alive to every other check.
- **Python stacks** of each rank under one deadline for all ranks, from :mod:`._py_spy` (the
  target is never paused) or the rank's own dump (:mod:`._faulthandler_stacks`), picked per rank
  by :mod:`._stack_sources`; docs/diagnosis.md ("Where each stack source works") says which works
  where.
- **The odd rank out** (:class:`OddRankOut`): the one rank whose activity, innermost Python
  function or main-thread wait channel differs from what every other rank shares.
- **The rank a stall is named after** (``named``, :mod:`._stalled_rank`, which orders the evidence).

Never hangs on a wedged rank: ``py-spy`` reads the target's memory, which can block on the
target's mmap lock like a ``cmdline`` read, so ``py-spy`` is never run on a rank with a thread in
``D`` (its dump handler may be, unless the main thread is in ``D``); :mod:`._py_spy` bounds and,
if need be, abandons each ``py-spy`` it starts.

Standard library only; signals only the ``py-spy`` children it started and, for their dumps, the
verified ranks whose dump handler is registered.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence

from ..process import _procfs
from ..process._identity import ProcessIdentity, is_local
from ..process._mm_read import DEFAULT_TIMEOUT_S, MmReader
from . import _scan
from ._diagnosis_record import (
    Activity,
    Diagnosis,
    HostSnapshot,
    OddRankOut,
    RankDiagnosis,
    StalledRank,
    ThreadDiagnosis,
)
from ._py_spy import DEFAULT_STACKS_TIMEOUT_S, find_py_spy
from ._stack_records import RankStacks, StackStatus
from ._stack_sources import SourceChoice, StackTarget, take_rank_stacks
from ._stalled_rank import DEFAULT_CPU_WINDOW_S, name_stalled_rank

# The records (:mod:`._diagnosis_record`) are re-exported for callers of diagnose.
__all__ = ["DEFAULT_WINDOW_S", "Activity", "Diagnosis", "OddRankOut", "RankDiagnosis", "ThreadDiagnosis", "diagnose",
           "find_odd_ranks", "merge_hosts", "stalled_rank_of"]

logger = logging.getLogger(__name__)

DEFAULT_WINDOW_S = 0.2
"""CPU-time window: ticks are 10 ms at ``CLK_TCK`` 100, so 0.2 s resolves 5% of a core."""
SPIN_FRACTION = 0.5
"""A thread on CPU for at least this share of the window is spinning."""
RUNNING_FRACTION = 0.05

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


# Rank-level activity is its most telling thread's: a rank with one thread in D is "in D".
_RANK_ORDER = (Activity.IN_D, Activity.STOPPED, Activity.SPINNING, Activity.RUNNING, Activity.SLEEPING,
               Activity.EXITED, Activity.UNKNOWN)


# ----------------------------------------------------------------------------- helpers


def _cpu_sample(pids: Sequence[int]) -> dict[tuple[int, int], tuple[str, int]]:
    """``(state, utime + stime)`` of each thread of ``pids``; threads gone or unreadable are left out."""
    sample: dict[tuple[int, int], tuple[str, int]] = {}
    for pid in pids:
        try:
            tids = _procfs.list_tids(pid)
        except OSError:
            continue
        for tid in tids:
            info = _procfs.stat_or_none(pid, tid)
            if info is not None:
                sample[(pid, tid)] = (info.state, info.cpu_ticks)
    return sample


_BY_STATE = {"R": Activity.RUNNING, "S": Activity.SLEEPING, "I": Activity.SLEEPING}


def _classify(state: str, before: tuple[str, int] | None, after: tuple[str, int] | None,
              window_s: float) -> tuple[Activity, float | None]:
    if state in _procfs.UNINTERRUPTIBLE_STATES:
        return Activity.IN_D, _fraction(before, after, window_s)
    if state in _procfs.STOPPED_STATES:
        return Activity.STOPPED, _fraction(before, after, window_s)
    if state in _procfs.EXITED_STATES:
        return Activity.EXITED, None
    fraction = _fraction(before, after, window_s)
    if fraction is None:  # no window, or a thread new since the first CPU sample: its state alone
        return _BY_STATE.get(state, Activity.UNKNOWN), None
    # Runnable at both ends of the window counts as spinning even with little CPU: on a loaded
    # host a spinning thread waits for a core in R, while a thread that blocks shows S or D.
    runnable = before is not None and after is not None and before[0] == "R" and after[0] == "R"
    if fraction >= SPIN_FRACTION or runnable:
        return Activity.SPINNING, fraction
    if fraction >= RUNNING_FRACTION:
        return Activity.RUNNING, fraction
    return Activity.SLEEPING, fraction


def _fraction(before: tuple[str, int] | None, after: tuple[str, int] | None, window_s: float) -> float | None:
    if before is None or after is None or window_s <= 0:
        return None
    return max(0, after[1] - before[1]) / _CLK_TCK / window_s


def _rank_activity(threads: Sequence[ThreadDiagnosis]) -> Activity:
    seen = {thread.activity for thread in threads}
    return next((activity for activity in _RANK_ORDER if activity in seen), Activity.UNKNOWN)


# ----------------------------------------------------------------------------- odd rank out


def _odd_one(values: dict[int, str]) -> tuple[int, str, str] | None:
    """``(key, its value, the value all others share)`` when exactly one of >= 3 keys differs."""
    if len(values) < 3:
        return None
    counts: dict[str, list[int]] = {}
    for key, value in values.items():
        counts.setdefault(value, []).append(key)
    if len(counts) != 2:
        return None
    (first, first_keys), (second, second_keys) = counts.items()
    if len(first_keys) == 1:
        return first_keys[0], first, second
    if len(second_keys) == 1:
        return second_keys[0], second, first
    return None


def find_odd_ranks(ranks: Sequence[RankDiagnosis], *, leader: int | None = None) -> tuple[OddRankOut, ...]:
    """The ranks that stand out from all the others, one per aspect: activity (e.g. one spinning
    while the others sleep), the main thread's innermost Python function, its wait channel.

    Only ranks alive and known in that aspect count; at least 3 must be (with 2, neither is "the
    odd one"). The ``leader`` (rank number) is not singled out for being on CPU: it busy-polls its
    requests while the others wait. Pure function of its input.
    """
    alive = [rank for rank in ranks if rank.verdict is not None and not rank.verdict.is_dead
             and rank.verdict is not _scan.Verdict.ACCESS_DENIED]
    by_pid = {rank.pid: rank for rank in alive}
    aspects: list[tuple[str, dict[int, str]]] = [
        ("activity", {rank.pid: rank.activity.value for rank in alive if rank.activity is not Activity.UNKNOWN}),
        ("python", {rank.pid: rank.stuck_in.function for rank in alive if rank.stuck_in is not None}),
        ("wchan", {rank.pid: main.wchan for rank in alive if (main := rank.main_thread) is not None
                   and main.activity in (Activity.SLEEPING, Activity.IN_D)}),
    ]
    found = []
    for aspect, values in aspects:
        odd = _odd_one(values)
        if odd is None:
            continue
        pid, value, others_value = odd
        if aspect == "activity" and by_pid[pid].rank == leader and value in (Activity.SPINNING.value,
                                                                               Activity.RUNNING.value):
            continue
        others = tuple(sorted(by_pid[other].rank for other in values if other != pid))
        found.append(OddRankOut(by_pid[pid].rank, pid, aspect, value, others_value, others))
    return tuple(found)


# ----------------------------------------------------------------------------- snapshot


def _targets(targets: Sequence[ProcessIdentity | int]
             ) -> tuple[list[tuple[int, int, int | None]], list[RankDiagnosis]]:
    """Split into local ``(rank, pid, start_time)`` to scan and ranks reported without a scan
    (remote, reused). A bare pid's start time is read now (None when unreadable)."""
    local: list[tuple[int, int, int | None]] = []
    unscanned: list[RankDiagnosis] = []
    for index, target in enumerate(targets):
        if isinstance(target, int):
            local.append((index, target, _procfs.start_time_or_none(target)))
            continue
        if not is_local(target):
            unscanned.append(RankDiagnosis(target.rank, target.pid, None,
                                           f"not local (host {target.hostname}): not diagnosed here",
                                           Activity.UNKNOWN, (), None))
            continue
        if target.start_time is not None and _procfs.start_time_or_none(target.pid) != target.start_time:
            unscanned.append(RankDiagnosis(target.rank, target.pid, _scan.Verdict.GONE,
                                           "gone (or its pid reused)", Activity.EXITED, (), None))
            continue
        local.append((target.rank, target.pid, target.start_time))
    return local, unscanned


def diagnose(
    targets: Sequence[ProcessIdentity | int],
    *,
    stacks: bool = True,
    window_s: float = DEFAULT_WINDOW_S,
    cpu_window_s: float = DEFAULT_WINDOW_S,
    scan_samples: int = 3,
    stacks_timeout_s: float = DEFAULT_STACKS_TIMEOUT_S,
    py_spy: str | None = None,
    stacks_source: SourceChoice | str = SourceChoice.AUTO,
    iterations: Mapping[int, int] | None = None,
    leader: int | None = 0,
    read_timeout_s: float = DEFAULT_TIMEOUT_S,
    reader: MmReader | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> Diagnosis:
    """Snapshot ``targets`` (identities, or bare pids numbered as ranks 0..n-1) and name the odd one.

    Runs :func:`._scan.scan` over ``window_s`` (``scan_samples`` samples; it ends after one when
    no thread is in ``D``), measures each thread's CPU over at least ``cpu_window_s`` (0: threads
    are classified by their state alone), then, with
    ``stacks``, takes the Python stacks of every live rank from ``stacks_source`` (``auto``:
    ``py-spy`` where installed and permitted, else the rank's faulthandler dump;
    :mod:`._stack_sources`). ``py_spy`` names the executable (default: found on ``PATH`` or beside
    this interpreter). An identity whose start time no longer matches is reported gone and not
    scanned; one of another host or PID namespace is reported and not scanned. ``named`` is the
    rank a stall would be named after (:func:`._stalled_rank.name_stalled_rank`, with
    ``iterations``, rank -> executor iterations, and ``leader``).

    Blocks about ``cpu_window_s`` (``window_s`` when a thread is in ``D``: the scan confirms it), plus the
    scan's bounded command-line reads, plus at most ``stacks_timeout_s`` and
    :data:`~._py_spy.KILL_WAIT_S` for stacks.
    Never raises for a process that is gone or unreadable. Raises ``ValueError`` for a negative
    window, ``scan_samples < 1`` or an unknown ``stacks_source``. Thread-safe (no shared state
    besides ``reader``).
    """
    if window_s < 0 or cpu_window_s < 0:
        raise ValueError("window_s and cpu_window_s must not be negative")
    source = SourceChoice(stacks_source)
    started = clock()
    taken_at = time.time()
    local, unscanned = _targets(targets)
    pids = [pid for _rank, pid, _start in local]
    starts = {pid: start for _rank, pid, start in local}
    before = _cpu_sample(pids)
    t0 = clock()
    result = _scan.scan(pids, window_s=window_s, samples=scan_samples, read_timeout_s=read_timeout_s,
                        reader=reader, clock=clock)
    remaining = t0 + cpu_window_s - clock()
    if pids and remaining > 0:
        time.sleep(remaining)
    after = _cpu_sample(pids)
    measured = clock() - t0
    ranks: list[RankDiagnosis] = []
    for (rank, pid, _start), report in zip(local, result.processes, strict=True):
        threads = []
        for thread in report.threads:
            key = (pid, thread.tid)
            activity, fraction = _classify(thread.state, before.get(key), after.get(key),
                                           measured if cpu_window_s > 0 else 0.0)
            threads.append(ThreadDiagnosis(thread.tid, thread.name, thread.state, activity, fraction,
                                           thread.wchan, thread.d_seconds, thread.kill_pending))
        activity = Activity.EXITED if report.verdict.is_dead else _rank_activity(threads)
        ranks.append(RankDiagnosis(rank, pid, report.verdict, report.detail, activity, tuple(threads), None, report))
    executable = ""
    if stacks:
        executable = (py_spy if py_spy is not None else find_py_spy()) or ""
        ranks = _with_stacks(ranks, starts, stacks_timeout_s, executable or None, source)
        unscanned = [dataclasses.replace(rank, stacks=RankStacks(StackStatus.SKIPPED_NOT_RUNNING, rank.detail))
                     for rank in unscanned]
    all_ranks = tuple(sorted(ranks + unscanned, key=lambda rank: rank.rank))
    diagnosis = Diagnosis(taken_at, measured, (clock() - started) * 1000, all_ranks,
                          find_odd_ranks(all_ranks, leader=leader), result, executable,
                          name_stalled_rank(all_ranks, iterations=iterations, leader=leader))
    logger.debug("diagnosis of %d rank(s) in %.0f ms: %s", len(all_ranks), diagnosis.elapsed_ms, diagnosis.summary())
    return diagnosis


def _with_stacks(ranks: list[RankDiagnosis], starts: Mapping[int, int | None], timeout_s: float,
                 py_spy: str | None, source: SourceChoice) -> list[RankDiagnosis]:
    skipped: dict[int, RankStacks] = {}
    wanted: list[StackTarget] = []
    for rank in ranks:
        if rank.verdict is None or rank.verdict.is_dead or rank.verdict is _scan.Verdict.ACCESS_DENIED:
            why = "not scanned" if rank.verdict is None else rank.verdict.value
            skipped[rank.pid] = RankStacks(StackStatus.SKIPPED_NOT_RUNNING, f"stacks skipped: {why}")
            continue
        # The freshest look: a thread may have entered D (or the rank stopped) since the scan.
        try:
            states = _procfs.read_thread_states(rank.pid)
        except OSError:
            states = {thread.tid: thread.state for thread in rank.threads}
        for thread in rank.threads:  # a thread seen in D by the scan counts as in D
            if thread.activity is Activity.IN_D:
                states[thread.tid] = "D"
        wanted.append(StackTarget(rank.pid, starts.get(rank.pid), states))
    taken = take_rank_stacks(wanted, source=source, timeout_s=timeout_s, py_spy=py_spy) if wanted else {}
    return [dataclasses.replace(rank, stacks=skipped.get(rank.pid) or taken[rank.pid]) for rank in ranks]


def stalled_rank_of(targets: Sequence[ProcessIdentity | int], *, iterations: Mapping[int, int] | None = None,
                    leader: int | None = 0, cpu_window_s: float = DEFAULT_CPU_WINDOW_S) -> StalledRank | None:
    """Take the diagnosis's short procfs snapshot of ``targets`` (no stacks) and name the stalled
    rank with all the evidence, spinning included.

    Blocks about ``cpu_window_s`` plus procfs reads (one scan sample: a rank in ``D`` is not
    confirmed over a window). Never raises for a process that is gone or unreadable. Thread-safe.
    """
    diagnosis = diagnose(targets, stacks=False, window_s=0.0, cpu_window_s=cpu_window_s, iterations=iterations,
                         leader=leader)
    return diagnosis.named


def merge_hosts(diagnosis: Diagnosis, hosts: Sequence[HostSnapshot],
                iterations: Mapping[int, int] | None = None) -> Diagnosis:
    """``diagnosis`` (the proxy's own snapshot, remote ranks in it unscanned) with each remote rank
    as its host's agent saw it, the odd ranks out and the stalled rank named again over every
    rank (``iterations``, then each host's own counts, which are fresher), and one line per host
    in ``hosts``. Pure function."""
    remote = {rank.rank: rank for host in hosts for rank in host.ranks}
    counts = dict(iterations or {})
    for host in hosts:
        counts.update(host.iterations)
    ranks = tuple(sorted([rank for rank in diagnosis.ranks if rank.rank not in remote] + list(remote.values()),
                         key=lambda rank: rank.rank))
    return dataclasses.replace(diagnosis, ranks=ranks, odd_ranks=find_odd_ranks(ranks, leader=0),
                               named=name_stalled_rank(ranks, iterations=counts or None),
                               hosts=tuple(host.line() for host in hosts))
