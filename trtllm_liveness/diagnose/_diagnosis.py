"""Where is every rank stuck? A bounded snapshot of local processes for an operator.

:func:`diagnose` builds on :func:`._scan.scan` (per thread: state, wait channel, time in ``D``,
SIGKILL pending, the process verdict; command lines read through
:class:`~trtllm_liveness.process._mm_read.MmReader`) and adds what a scan does not measure:

- **CPU time over a short window** per thread (``utime + stime`` of ``task/<tid>/stat``, read just
  before and just after the scan's samples), which classifies each thread as spinning, running,
  sleeping, in ``D``, stopped or exited (:class:`Activity`). A rank that spins in a collective
  whose peer is gone looks alive to every other check.
- **Python stacks** of each rank under one deadline for all ranks, from ``py-spy dump
  --nonblocking`` where it is installed (extra ``diagnose``) and permitted (:mod:`._py_spy`; the
  target is never paused), else from the rank's own ``faulthandler`` dump registered at its start
  (:mod:`._faulthandler_stacks`: no ptrace needed); :mod:`._stack_sources` picks per rank and
  each result says its source and why the other was not used.
- **The odd rank out** (:class:`OddRankOut`): the one rank whose activity, innermost Python
  function or main-thread wait channel differs from what every other rank shares.
- **The rank a stall is named after** (``named``, :mod:`._stalled_rank`): gone, stopped or in
  ``D`` first, then behind in executor iterations, then spinning while the others sleep.

Never hangs on a wedged rank: ``py-spy`` reads the target's memory, which can block on the
target's mmap lock like a ``cmdline`` read, so ``py-spy`` is never run on a rank with a thread in
``D`` (its dump handler may be, unless the main thread is in ``D``); :mod:`._py_spy` bounds and,
if need be, abandons each ``py-spy`` it starts.

Standard library only; signals only the ``py-spy`` children it started and, for their dumps, the
verified ranks whose dump handler is registered.
"""

from __future__ import annotations

import enum
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..process import _procfs
from ..process._identity import ProcessIdentity, local_hostname, local_pid_namespace
from ..process._mm_read import DEFAULT_TIMEOUT_S, MmReader
from . import _scan
from ._py_spy import DEFAULT_STACKS_TIMEOUT_S, find_py_spy, take_stacks
from ._stack_records import RankStacks, StackFrame, StackStatus
from ._stack_sources import SourceChoice, StackTarget, take_rank_stacks
from ._stalled_rank import DEFAULT_CPU_WINDOW_S, Condition, RankEvidence, StalledRank, in_d_detail, name_stalled_rank

# find_py_spy and take_stacks (the stacks, :mod:`._py_spy`) are re-exported for callers of diagnose.
__all__ = ["DEFAULT_WINDOW_S", "Activity", "Diagnosis", "OddRankOut", "RankDiagnosis", "ThreadDiagnosis", "diagnose",
           "find_odd_ranks", "find_py_spy", "rank_evidence", "stalled_rank_of", "take_stacks"]

logger = logging.getLogger(__name__)

DEFAULT_WINDOW_S = 0.2
"""CPU-time window: ticks are 10 ms at ``CLK_TCK`` 100, so 0.2 s resolves 5% of a core."""
SPIN_FRACTION = 0.5
"""A thread on CPU for at least this share of the window is spinning."""
RUNNING_FRACTION = 0.05

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_STOPPED = frozenset("Tt")
_EXITED = frozenset("ZX")


class Activity(str, enum.Enum):
    """What one thread (or, worst of its threads, one rank) did over the window."""

    SPINNING = "spinning"  # on CPU (or runnable) through the window
    RUNNING = "running"  # some CPU, not continuously
    SLEEPING = "sleeping"
    IN_D = "in-d"
    STOPPED = "stopped"
    EXITED = "exited"
    UNKNOWN = "unknown"


# Rank-level activity is its most telling thread's: a rank with one thread in D is "in D".
_RANK_ORDER = (Activity.IN_D, Activity.STOPPED, Activity.SPINNING, Activity.RUNNING, Activity.SLEEPING,
               Activity.EXITED, Activity.UNKNOWN)


@dataclass(frozen=True)
class ThreadDiagnosis:
    """One thread: the scan's view (state, wchan, D time, SIGKILL) plus its CPU use over the window.

    ``cpu_fraction`` is the share of one core used over the window (None when the thread was not
    there at both CPU samples).
    """

    tid: int
    name: str
    state: str
    activity: Activity
    cpu_fraction: float | None
    wchan: str
    d_seconds: float
    kill_pending: bool

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"tid": self.tid, "name": self.name, "state": self.state, "activity": self.activity.value,
                "cpu_fraction": None if self.cpu_fraction is None else round(self.cpu_fraction, 3),
                "wchan": self.wchan, "d_seconds": round(self.d_seconds, 3), "sigkill_pending": self.kill_pending}


@dataclass(frozen=True)
class RankDiagnosis:
    """One rank: its scan verdict, its threads, its activity and (maybe) its Python stacks.

    ``stacks`` is None when stacks were not asked for. ``report`` is the scan's report (None for a
    rank that was not scanned: remote, or its PID reused before the snapshot). ``host`` names the
    rank's host when its host's agent took it (multi-host), else is empty.
    """

    rank: int
    pid: int
    verdict: _scan.Verdict | None  # None: not scanned here (another host or PID namespace)
    detail: str
    activity: Activity
    threads: tuple[ThreadDiagnosis, ...]
    stacks: RankStacks | None
    report: _scan.ProcessReport | None = None
    host: str = ""  # the rank's host where its snapshot was taken by that host's agent; "" here

    @property
    def main_thread(self) -> ThreadDiagnosis | None:
        """The thread whose id is the pid."""
        return next((thread for thread in self.threads if thread.tid == self.pid), None)

    @property
    def stuck_in(self) -> StackFrame | None:
        """Where the main thread's Python code is (see :attr:`ThreadStack.stuck_in`), if known."""
        if self.stacks is None:
            return None
        main = self.stacks.main_thread(self.pid)
        return None if main is None else main.stuck_in

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        stuck = self.stuck_in
        verdict = None if self.verdict is None else self.verdict.value
        return {"rank": self.rank, "pid": self.pid, "host": self.host, "verdict": verdict, "detail": self.detail,
                "activity": self.activity.value, "stuck_in": None if stuck is None else stuck.describe(),
                "threads": [thread.to_dict() for thread in self.threads],
                "stacks": None if self.stacks is None else self.stacks.to_dict()}


@dataclass(frozen=True)
class OddRankOut:
    """One rank that differs, in ``aspect``, from what all the other ranks share."""

    rank: int
    pid: int
    aspect: str  # "activity", "python" (innermost Python function), "wchan" (main thread's)
    value: str
    others_value: str
    others: tuple[int, ...]

    @property
    def reason(self) -> str:
        """One line for people."""
        ranks = ", ".join(map(str, self.others))
        if self.aspect == "activity":
            return f"rank {self.rank} is {self.value} while ranks {ranks} are {self.others_value}"
        if self.aspect == "python":
            return f"rank {self.rank} is in {self.value} while ranks {ranks} are in {self.others_value}"
        return f"rank {self.rank} waits in {self.value or 'no wait channel'} while ranks {ranks} wait in " \
               f"{self.others_value or 'no wait channel'}"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"rank": self.rank, "pid": self.pid, "aspect": self.aspect, "value": self.value,
                "others_value": self.others_value, "others": list(self.others), "reason": self.reason}


@dataclass(frozen=True)
class Diagnosis:
    """A snapshot of every rank; ``odd_ranks`` holds one entry per aspect that singles a rank out."""

    taken_at: float  # wall clock (time.time())
    window_s: float  # the CPU window actually measured
    elapsed_ms: float
    ranks: tuple[RankDiagnosis, ...]
    odd_ranks: tuple[OddRankOut, ...]
    scan: _scan.ScanResult
    py_spy: str  # the py-spy used, "" when none (or stacks not asked for)
    named: StalledRank | None = None  # the rank a stall of these ranks is named after, if any
    hosts: tuple[str, ...] = ()  # one line per remote host whose agent was asked (multi-host)

    @property
    def odd_rank_out(self) -> OddRankOut | None:
        """The most telling finding (activity before Python function before wait channel)."""
        return self.odd_ranks[0] if self.odd_ranks else None

    def rank(self, pid: int) -> RankDiagnosis | None:
        """The diagnosis of the rank with this pid."""
        return next((rank for rank in self.ranks if rank.pid == pid), None)

    def summary(self) -> str:
        """One line per finding, for a log record."""
        parts = [f"rank {r.rank} (pid {r.pid}{f' on host {r.host}' if r.host else ''}) {r.activity.value}"
                 + (f" in {r.stuck_in.describe()}" if r.stuck_in is not None else "") for r in self.ranks]
        odd = self.odd_rank_out
        named = f"; stalled rank: {self.named.evidence}" if self.named is not None else ""
        return "; ".join(parts) + (f"; odd rank out: {odd.reason}" if odd is not None else "") + named

    def to_dict(self, *, include_scan: bool = True) -> dict[str, Any]:
        """JSON-ready form (``include_scan=False`` when the caller prints the scan itself)."""
        data: dict[str, Any] = {
            "taken_at": self.taken_at, "window_s": round(self.window_s, 3), "elapsed_ms": round(self.elapsed_ms, 1),
            "py_spy": self.py_spy, "ranks": [rank.to_dict() for rank in self.ranks],
            "odd_ranks": [odd.to_dict() for odd in self.odd_ranks],
            "odd_rank_out": None if self.odd_rank_out is None else self.odd_rank_out.reason,
            "named": None if self.named is None else self.named.to_dict(), "hosts": list(self.hosts),
        }
        if include_scan:
            data["scan"] = self.scan.to_dict()
        return data


# ----------------------------------------------------------------------------- helpers


def _cpu_ticks(pid: int, tid: int) -> tuple[str, int] | None:
    """``(state, utime + stime)`` of one thread; None when gone or unreadable."""
    try:
        info = _procfs.parse_stat(_procfs.read_task_stat(pid, tid))
    except (OSError, ValueError):
        return None
    return info.state, info.cpu_ticks


def _cpu_sample(pids: Sequence[int]) -> dict[tuple[int, int], tuple[str, int]]:
    sample: dict[tuple[int, int], tuple[str, int]] = {}
    for pid in pids:
        try:
            tids = _procfs.list_tids(pid)
        except OSError:
            continue
        for tid in tids:
            ticks = _cpu_ticks(pid, tid)
            if ticks is not None:
                sample[(pid, tid)] = ticks
    return sample


_BY_STATE = {"R": Activity.RUNNING, "S": Activity.SLEEPING, "I": Activity.SLEEPING}


def _classify(state: str, before: tuple[str, int] | None, after: tuple[str, int] | None,
              window_s: float) -> tuple[Activity, float | None]:
    if state in _procfs.UNINTERRUPTIBLE_STATES:
        return Activity.IN_D, _fraction(before, after, window_s)
    if state in _STOPPED:
        return Activity.STOPPED, _fraction(before, after, window_s)
    if state in _EXITED:
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


_CONDITIONS = {Activity.IN_D: Condition.IN_D, Activity.STOPPED: Condition.STOPPED,
               Activity.SPINNING: Condition.SPINNING, Activity.SLEEPING: Condition.SLEEPING,
               Activity.RUNNING: Condition.OTHER}


def rank_evidence(rank: RankDiagnosis) -> RankEvidence:
    """What the stalled-rank naming (:mod:`._stalled_rank`) reads of one diagnosed rank."""
    if rank.verdict is None or rank.verdict is _scan.Verdict.ACCESS_DENIED:
        return RankEvidence(rank.rank, rank.pid, Condition.UNKNOWN, rank.detail)
    if rank.verdict.is_dead:
        return RankEvidence(rank.rank, rank.pid, Condition.GONE, rank.detail)
    condition = _CONDITIONS.get(rank.activity, Condition.UNKNOWN)
    if condition is Condition.IN_D:
        d_threads = [thread for thread in rank.threads if thread.activity is Activity.IN_D]
        return RankEvidence(rank.rank, rank.pid, condition,
                            in_d_detail(len(d_threads), d_threads[0].wchan if d_threads else ""))
    if condition is Condition.STOPPED:
        main = rank.main_thread
        return RankEvidence(rank.rank, rank.pid, condition, main.state if main is not None else "T")
    return RankEvidence(rank.rank, rank.pid, condition)


# ----------------------------------------------------------------------------- snapshot


def _targets(targets: Sequence[ProcessIdentity | int]
             ) -> tuple[list[tuple[int, int, int | None]], list[RankDiagnosis]]:
    """Split into local ``(rank, pid, start_time)`` to scan and ranks reported without a scan
    (remote, reused). A bare pid's start time is read now (None when unreadable)."""
    local: list[tuple[int, int, int | None]] = []
    unscanned: list[RankDiagnosis] = []
    for index, target in enumerate(targets):
        if isinstance(target, int):
            try:
                local.append((index, target, _procfs.read_start_time(target)))
            except (OSError, ValueError):
                local.append((index, target, None))
            continue
        if target.hostname != local_hostname() or (
                target.pid_namespace is not None and target.pid_namespace != local_pid_namespace()):
            unscanned.append(RankDiagnosis(target.rank, target.pid, None,
                                           f"not local (host {target.hostname}): not diagnosed here",
                                           Activity.UNKNOWN, (), None))
            continue
        if target.start_time is not None:
            try:
                start = _procfs.read_start_time(target.pid)
            except (OSError, ValueError):
                start = None
            if start != target.start_time:
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
        unscanned = [_replace_stacks(rank, RankStacks(StackStatus.SKIPPED_NOT_RUNNING, rank.detail))
                     for rank in unscanned]
    all_ranks = tuple(sorted(ranks + unscanned, key=lambda rank: rank.rank))
    diagnosis = Diagnosis(taken_at, measured, (clock() - started) * 1000, all_ranks,
                          find_odd_ranks(all_ranks, leader=leader), result, executable,
                          name_stalled_rank([rank_evidence(rank) for rank in all_ranks], iterations=iterations,
                                            leader=leader))
    logger.debug("diagnosis of %d rank(s) in %.0f ms: %s", len(all_ranks), diagnosis.elapsed_ms, diagnosis.summary())
    return diagnosis


def _replace_stacks(rank: RankDiagnosis, stacks: RankStacks) -> RankDiagnosis:
    return RankDiagnosis(rank.rank, rank.pid, rank.verdict, rank.detail, rank.activity, rank.threads, stacks,
                         rank.report, rank.host)


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
    return [_replace_stacks(rank, skipped.get(rank.pid) or taken[rank.pid]) for rank in ranks]


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
