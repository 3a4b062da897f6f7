"""Wedge verdicts: successive thread samples of one rank become "wedged" after a timeout.

The rule is the Linux kernel's own hung-task rule (``kernel/hung_task.c``), as docs/diagnosis.md
("When ``D`` is a wedge") states it: when a thread is *stuck*, when its clock restarts, and when
its worker is wedged or unkillable (:class:`WedgeTracker`). The samples come from
:class:`~trtllm_liveness.process._thread_sampler.ThreadSampler`; :class:`WedgeScan` says when the
watcher takes them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from .._events import EventKind
from ..process._thread_sampler import DStateSample

__all__ = ["WedgeScan", "WedgeTracker"]


@dataclass(frozen=True)
class _StuckClock:
    """Since when one thread has been in ``D`` without a context switch, and its count then."""

    since: float  # monotonic: the sample that first saw it in D with this count
    switches: int | None  # None: unreadable, so the next sample restarts the clock


class WedgeTracker:
    """Turns successive samples of one process into at most one WEDGED and one UNKILLABLE verdict.

    WEDGED: one thread has been *stuck* (in ``D`` on every sample, its context-switch count
    unchanged) for at least ``timeout_s``. Tracked per thread, so several threads each dipping
    into ``D`` briefly, as under heavy I/O, do not add up, and a thread that sleeps in ``D`` again
    and again while it makes progress (slow I/O) never gets there. UNKILLABLE: SIGKILL pending on
    two consecutive samples and a thread in ``D`` at both that never ran in between, i.e. it
    survived SIGKILL for at least one sampling interval without acting on anything (a process that
    is merely exiting passes through ``D`` briefly, and a task that keeps switching is acting). Not
    thread-safe: one owner samples it (the monitor's watcher, under the monitor's lock).
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.clocks: dict[int, _StuckClock] = {}  # each thread in D at the last sample
        self.reported: set[EventKind] = set()
        self.last_sample: DStateSample | None = None
        self.unkillable_tid: int | None = None  # the last sample met the UNKILLABLE rule with this thread

    @property
    def stuck_since(self) -> float | None:
        """Monotonic time since which the longest-stuck thread has been in ``D`` without a context
        switch (the sample that first saw it so), or None."""
        return min(clock.since for clock in self.clocks.values()) if self.clocks else None

    def observe(self, sample: DStateSample | None, now: float) -> EventKind | None:
        """Feed one sample taken at monotonic time ``now``; return a newly reached verdict."""
        before, self.last_sample = self.last_sample, sample
        if sample is None:
            self.clocks.clear()
            self.unkillable_tid = None
            return None
        held = sample.held_since(before) if before is not None else ()
        self.clocks = {tid: self.clocks[tid] if tid in held and tid in self.clocks else _StuckClock(now, switches)
                       for tid, switches in zip(sample.d_tids, sample.switches, strict=True)}
        killed_twice = sample.kill_pending and before is not None and before.kill_pending
        self.unkillable_tid = min(held, key=self._order) if killed_twice and held else None
        if self.unkillable_tid is not None and EventKind.UNKILLABLE not in self.reported:
            self.reported.add(EventKind.UNKILLABLE)
            return EventKind.UNKILLABLE
        if self.stuck_seconds(now) >= self.timeout_s and not self.reported:
            self.reported.add(EventKind.WEDGED)
            return EventKind.WEDGED
        return None

    def stuck_seconds(self, now: float) -> float:
        """How long the longest-stuck thread has been seen in ``D`` without a context switch (0 when
        none is)."""
        since = self.stuck_since
        return 0.0 if since is None else now - since

    def stuck_tid(self) -> int | None:
        """The thread that has been stuck longest, if any."""
        return min(self.clocks, key=self._order) if self.clocks else None

    def _order(self, tid: int) -> tuple[float, int]:
        return self.clocks[tid].since, tid


class WedgeScan:
    """When the watcher samples thread states for wedges: the ``D``-state timeout each rank's
    :class:`WedgeTracker` gets, whether verdicts are armed, and when the next scan is due.
    Guarded by the monitor's lock (``enabled`` may be read without it)."""

    def __init__(self, timeout_s: float | None, interval_s: float, *, armed: bool) -> None:
        self.timeout_s = timeout_s if timeout_s is not None and timeout_s > 0 else None
        self.interval_s = interval_s
        self.armed = armed
        self.next_at = 0.0  # monotonic

    @property
    def enabled(self) -> bool:
        """Whether wedge verdicts are being made: armed, with a timeout."""
        return self.armed and self.timeout_s is not None

    def arm(self, timeout_s: float | None) -> bool:
        """Arm; a positive ``timeout_s`` replaces the timeout, 0 or less turns detection off. The
        next scan is due at once. False (nothing changed) when already armed and no timeout given."""
        if timeout_s is None and self.armed:
            return False
        self.armed = True
        if timeout_s is not None:
            self.timeout_s = timeout_s if timeout_s > 0 else None
        self.next_at = time.monotonic()
        return True

    def not_before(self, began: float) -> None:
        """Keep the next scan at least one interval after a scan that began at monotonic ``began``."""
        self.next_at = max(self.next_at, began + self.interval_s)

    def take_due(self, now: float) -> bool:
        """Whether a scan is due at monotonic ``now``; if so the next one is scheduled."""
        if now < self.next_at:
            return False
        self.next_at = now + self.interval_s
        return True
