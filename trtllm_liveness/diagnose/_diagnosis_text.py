"""Text of a diagnosis: the scan's table (``trtllm-liveness scan --stacks``), the fatal ERROR line
with its evidence, and the fatal verdict's snapshot as one WARNING line and as a typed record.

Kept apart from the CLI so that the CLI only wires it in. Text chosen by the target (thread names,
file names) goes through the caller's ``clean`` function before it reaches a terminal.

**The fatal line and the snapshot**: docs/diagnosis.md ("The two lines") says when each is
written, what it carries and where the snapshot goes. The line's evidence is
:func:`~._stalled_rank.stalled_rank_now`'s; the snapshot's WARNING line is :func:`snapshot_record`
then :meth:`~trtllm_liveness.exit._snapshot_record.FatalSnapshot.summary`. Imports nothing heavy:
the fatal path loads it at the engine's start.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from .._events import EventKind, WorkerEvent
from ..exit._snapshot_record import MAIN_FRAMES, FatalSnapshot, RankSnapshot
from ._diagnosis_record import StalledRank
from ._stack_records import StackStatus

if TYPE_CHECKING:
    from ._diagnosis_record import Diagnosis, RankDiagnosis

MAX_FRAMES = 12
"""Innermost frames shown per thread; the JSON form has them all."""


def _cpu(fraction: float | None) -> str:
    return "-" if fraction is None else f"{fraction * 100:.0f}%"


def rank_lines(rank: RankDiagnosis, clean: Callable[[str], str] = str) -> list[str]:
    """The lines shown under one process of the scan table: per-thread activity, then stacks."""
    lines: list[str] = []
    stuck = rank.stuck_in
    head = f"  rank {rank.rank}: {rank.activity.value}"
    if stuck is not None:
        head += f"; main thread in {clean(stuck.describe())}"
    lines.append(head)
    if rank.threads:
        lines.append(f"    {'TID':<8} {'NAME':<16} {'ACTIVITY':<9} {'CPU':>5} WCHAN")
        for thread in rank.threads:
            lines.append(f"    {thread.tid:<8} {clean(thread.name)[:16]:<16} {thread.activity.value:<9} "
                         f"{_cpu(thread.cpu_fraction):>5} {thread.wchan or '-'}")
    stacks = rank.stacks
    if stacks is None:
        return lines
    if stacks.source is not None:
        other = f" ({clean(stacks.other_source)})" if stacks.other_source else ""
        lines.append(f"  stacks from {stacks.source.value}{other}")
    if stacks.status is not StackStatus.TAKEN:
        lines.append(f"  stacks: {stacks.status.value}: {clean(stacks.detail)}")
        return lines
    for stack in stacks.threads:
        flags = ", ".join(flag for flag, on in (("active", stack.active), ("holds the GIL", stack.owns_gil)) if on)
        lines.append(f"  python thread {stack.tid if stack.tid is not None else '?'} "
                     f"({clean(stack.name) or '?'}){': ' + flags if flags else ''}")
        for frame in stack.frames[:MAX_FRAMES]:
            lines.append(f"    {clean(frame.describe())}")
        if len(stack.frames) > MAX_FRAMES:
            lines.append(f"    ... {len(stack.frames) - MAX_FRAMES} outer frame(s)")
    return lines


def summary_lines(diagnosis: Diagnosis) -> list[str]:
    """The lines after the scan's summary: the odd ranks out, or why none is named."""
    named = [f"STALLED RANK ({diagnosis.named.basis.value}): {diagnosis.named.evidence}"] if diagnosis.named else []
    if not diagnosis.odd_ranks:
        return [f"diagnosis: {len(diagnosis.ranks)} rank(s) over {diagnosis.window_s:.2f}s CPU window, "
                "no odd rank out", *named]
    return [f"ODD RANK OUT ({odd.aspect}): {odd.reason}" for odd in diagnosis.odd_ranks] + named


STATES_ONLY = "from the ranks' thread states now; the snapshot follows"
"""What the fatal line says of its evidence: read from ``/proc`` at once, not the snapshot's."""


def instant_evidence(verdict: StalledRank | None) -> str:
    """The fatal line's evidence from :func:`~._stalled_rank.stalled_rank_now`'s verdict."""
    if verdict is None:
        return f"no local rank is gone, stopped, in D or behind ({STATES_ONLY})"
    return f"{verdict.evidence} ({STATES_ONLY})"


def fatal_line(event: WorkerEvent, evidence: str) -> str:
    """The fatal ERROR line's text: the event's message in today's form with ``evidence``
    appended: ``engine stalled (named: MPI worker rank R (pid P) on host H; evidence: ...): cause``
    for a stall (the evidence the stall's cause already carried is not repeated), and
    ``<message>; evidence: ...`` for a death, a wedge, a lost host and an unkillable rank."""
    if event.kind is EventKind.STALLED:
        named = f"MPI worker {event.identity.describe()}; evidence: {evidence}"
        cause = event.cause
        head = evidence.partition(f" ({STATES_ONLY})")[0]
        if head and f"; {head}" in cause:
            cause = cause.replace(f"; {head}", "", 1)
        return WorkerEvent(event.kind, event.identity, cause, event.detected_at, event.wall_time, event.tid,
                           event.wchan, event.fault_at).describe(named)
    return f"{event.message}; evidence: {evidence}"


def _rank_snapshot(rank: RankDiagnosis, hostname: str, iterations: int | None) -> RankSnapshot:
    main = rank.main_thread
    stacks = rank.stacks
    if stacks is None:
        source = "not asked"
    elif stacks.status is StackStatus.TAKEN and stacks.source is not None:
        source = stacks.source.value
    else:
        source = stacks.status.value
    frames: tuple[str, ...] = ()
    if stacks is not None:
        main_stack = stacks.main_thread(rank.pid)
        if main_stack is not None:
            frames = tuple(frame.describe() for frame in main_stack.frames[:MAIN_FRAMES])
    state = main.state if main is not None else ("" if rank.report is None else rank.report.state)
    return RankSnapshot(rank.rank, rank.pid, hostname, state, main.wchan if main is not None else "",
                        rank.activity.value, iterations, source, frames)


def snapshot_record(diagnosis: Diagnosis, reason: str, *, hosts: Mapping[int, str],
                    iterations: Mapping[int, int] | None = None) -> FatalSnapshot:
    """The fatal verdict's ``diagnosis`` as the typed record the WARNING line, the outcome record
    and the termination message carry. ``hosts`` maps rank numbers to host names; ``iterations``
    the executor iterations each rank reported."""
    counts = iterations or {}
    odd = diagnosis.odd_rank_out
    named, named_rank = ((diagnosis.named.evidence, diagnosis.named.rank) if diagnosis.named is not None else
                         (odd.reason, odd.rank) if odd is not None else ("", None))
    return FatalSnapshot(reason, diagnosis.taken_at, diagnosis.elapsed_ms, named,
                         tuple(_rank_snapshot(rank, hosts.get(rank.rank, ""), counts.get(rank.rank))
                               for rank in diagnosis.ranks), named_rank)


def snapshot_lines(snapshot: FatalSnapshot | None) -> list[str]:
    """``snapshot`` for a terminal (``trtllm-liveness demo``): the rank the evidence names, with its
    host, then every rank (state, wait channel, CPU class, iterations, stack source)."""
    if snapshot is None:
        return ["  snapshot: none taken (liveness off, or the stall was not seen)"]
    named = snapshot.rank(snapshot.named_rank) if snapshot.named_rank is not None else None
    if named is not None:
        head = f"  stalled rank: rank {named.rank} (pid {named.pid}) on host {named.hostname}: {snapshot.named}"
    else:
        head = "  stalled rank: none named by the evidence" + (f" ({snapshot.named})" if snapshot.named else "")
    lines = [head, f"  snapshot ({snapshot.elapsed_ms:.0f} ms, before any stop):"]
    lines += [f"    {rank.describe()}" for rank in snapshot.ranks]
    return lines
