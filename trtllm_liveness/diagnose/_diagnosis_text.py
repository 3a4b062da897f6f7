"""Plain-text rendering of a :class:`._diagnosis.Diagnosis` for ``trtllm-liveness scan --stacks``.

Kept apart from the CLI so that the CLI only wires it in. Text chosen by the target (thread names,
file names) goes through the caller's ``clean`` function before it reaches a terminal.
"""

from __future__ import annotations

from collections.abc import Callable

from ._diagnosis import Diagnosis, RankDiagnosis
from ._stack_records import StackStatus

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
        lines.append(f"  stacks from {stacks.source.value}" + (f" ({clean(stacks.other)})" if stacks.other else ""))
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
