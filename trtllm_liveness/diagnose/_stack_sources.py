"""Which source takes each rank's Python stacks, and both run under one deadline.

``py-spy`` (:mod:`._py_spy`) is richer (OS thread ids, names, GIL flags, and it reads a stopped
rank) and needs nothing in the rank, but needs ptrace rights and reads the rank's memory under its
mmap lock. The rank's own ``faulthandler`` dump (:mod:`._faulthandler_stacks`) needs neither, but
needs the hook registered at the rank's start and a rank that can run its handler. With
``source="auto"``, per rank:

====================================  =======================  ===============================
rank                                  stacks from              the other one not used because
====================================  =======================  ===============================
a thread in ``D``                     faulthandler             py-spy could hang on the mm lock
stopped (``T``)                       py-spy (if installed)    a stopped rank runs no handler
py-spy missing or not permitted       faulthandler             missing / the kernel's reason
otherwise                             py-spy; on failure,      faulthandler not needed, or
                                      faulthandler             py-spy's error
====================================  =======================  ===============================

Every result says its ``source`` and, in ``other``, why the other source was not used.
Standard library only.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ..process import _procfs
from ._faulthandler_stacks import DumpRequests
from ._py_spy import DEFAULT_STACKS_TIMEOUT_S, NO_PY_SPY, ptrace_access, take_stacks
from ._stack_records import RankStacks, StackSource, StackStatus

__all__ = ["SourceChoice", "StackTarget", "take_rank_stacks"]


class SourceChoice(str, enum.Enum):
    """Which stack source a snapshot may use."""

    AUTO = "auto"  # py-spy where permitted, else (or when it fails) the rank's faulthandler dump
    PY_SPY = "py-spy"
    FAULTHANDLER = "faulthandler"


@dataclass(frozen=True)
class StackTarget:
    """One rank to take stacks of: its pid, its start time (None: unknown, no faulthandler dump,
    which is only sent to a verified process) and its threads' states as last read."""

    pid: int
    start_time: int | None
    states: Mapping[int, str] = field(default_factory=dict)

    @property
    def d_tids(self) -> list[int]:
        return list(_procfs.uninterruptible_tids(self.states))

    @property
    def stopped(self) -> bool:
        return self.states.get(self.pid, "") in _procfs.STOPPED_STATES


_D_REASON = "a thread is in D: py-spy reads its memory and could hang on its mm lock"


def take_rank_stacks(targets: Sequence[StackTarget], *, source: SourceChoice | str = SourceChoice.AUTO,
                     timeout_s: float = DEFAULT_STACKS_TIMEOUT_S, py_spy: str | None = None) -> dict[int, RankStacks]:
    """Each target's stacks from the source chosen as the module docstring says.

    ``py_spy`` is the executable (None: not installed). Both sources start at once; a rank whose
    ``py-spy`` failed gets its faulthandler dump in the time left. Blocks at most ``timeout_s``
    plus ``py-spy``'s kill wait and a one-time ``--help`` probe. Never raises for a rank.
    Raises ``ValueError`` for an unknown ``source``. Thread-safe.
    """
    choice = SourceChoice(source)
    deadline = time.monotonic() + timeout_s
    by_spy: list[StackTarget] = []
    by_dump: dict[int, str] = {}  # pid -> why py-spy is not used
    done: dict[int, RankStacks] = {}
    for target in targets:
        if choice is SourceChoice.FAULTHANDLER:
            by_dump[target.pid] = "not asked for"
        elif target.d_tids:
            if choice is SourceChoice.PY_SPY:
                done[target.pid] = RankStacks(StackStatus.SKIPPED_TASK_IN_D, _d_detail(target),
                                              source=StackSource.PY_SPY)
            else:
                by_dump[target.pid] = _D_REASON
        elif choice is SourceChoice.PY_SPY or target.stopped:
            by_spy.append(target)
        elif py_spy is None:
            by_dump[target.pid] = "py-spy is not installed"
        else:
            permitted, why = ptrace_access(target.pid)
            if permitted is False:
                by_dump[target.pid] = f"py-spy not permitted: {why}"
            else:
                by_spy.append(target)
    dumps = DumpRequests([(target.pid, target.start_time) for target in targets if target.pid in by_dump], deadline)
    spied = take_stacks([target.pid for target in by_spy], timeout_s=max(0.0, deadline - time.monotonic()),
                        py_spy=py_spy or "") if by_spy and py_spy is not None else {}
    for target in by_spy:
        result = spied.get(target.pid, NO_PY_SPY)  # absent: py-spy asked for explicitly but not installed
        if result.status is StackStatus.FAILED and choice is SourceChoice.AUTO and not target.stopped:
            late = DumpRequests([(target.pid, target.start_time)], deadline).collect()[target.pid]
            result = late.with_source(StackSource.FAULTHANDLER, f"py-spy failed: {result.detail}")
        elif target.stopped and choice is SourceChoice.AUTO:
            result = result.with_source(result.source, "a stopped rank cannot run its faulthandler dump")
        done[target.pid] = result
    done.update({pid: stacks.with_source(StackSource.FAULTHANDLER, by_dump[pid])
                 for pid, stacks in dumps.collect().items()})
    return {target.pid: done[target.pid] for target in targets}


def _d_detail(target: StackTarget) -> str:
    shown = " ".join(map(str, target.d_tids[:4]))
    return f"stacks skipped: task in D (thread {shown}); {_D_REASON}"
