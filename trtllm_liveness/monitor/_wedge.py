"""Wedge verdicts: successive thread samples of one rank become "wedged" after a timeout.

A thread that stays in ``D`` (uninterruptible sleep) for ``d_state_timeout_s`` makes its worker
wedged; one in ``D`` with SIGKILL pending on two scans makes it unkillable (:class:`WedgeTracker`).
The samples come from :class:`~trtllm_liveness.process._thread_sampler.ThreadSampler`;
:class:`WedgeScan` says when the watcher takes them.
"""

from __future__ import annotations

import time

from .._events import EventKind
from ..process._thread_sampler import DStateSample

__all__ = ["WedgeScan", "WedgeTracker"]


class WedgeTracker:
    """Turns successive samples of one process into at most one WEDGED and one UNKILLABLE verdict.

    WEDGED: one thread has been in ``D`` on every sample for at least ``timeout_s`` (tracked per
    thread, so several threads each dipping into ``D`` briefly, as under heavy I/O, do not add
    up). UNKILLABLE: ``D`` with SIGKILL pending on two consecutive samples, i.e. it survived
    SIGKILL for at least one sampling interval (a process that is merely exiting passes through
    ``D`` briefly and must not be flagged). Not thread-safe: one owner samples it.
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.d_since_by_tid: dict[int, float] = {}
        self.kill_pending_scans = 0
        self.reported: set[EventKind] = set()
        self.last_sample: DStateSample | None = None

    @property
    def d_since(self) -> float | None:
        """Monotonic time since which the longest-stuck thread has been in ``D``, or None."""
        return min(self.d_since_by_tid.values()) if self.d_since_by_tid else None

    def observe(self, sample: DStateSample | None, now: float) -> EventKind | None:
        """Feed one sample taken at monotonic time ``now``; return a newly reached verdict."""
        self.last_sample = sample
        if sample is None:
            self.d_since_by_tid.clear()
            self.kill_pending_scans = 0
            return None
        self.d_since_by_tid = {tid: self.d_since_by_tid.get(tid, now) for tid in sample.d_tids}
        self.kill_pending_scans = self.kill_pending_scans + 1 if sample.kill_pending else 0
        if self.kill_pending_scans >= 2 and EventKind.UNKILLABLE not in self.reported:
            self.reported.add(EventKind.UNKILLABLE)
            return EventKind.UNKILLABLE
        if self.d_seconds(now) >= self.timeout_s and not self.reported:
            self.reported.add(EventKind.WEDGED)
            return EventKind.WEDGED
        return None

    def d_seconds(self, now: float) -> float:
        """How long the longest-stuck thread has been seen in ``D`` (0 when none is)."""
        since = self.d_since
        return 0.0 if since is None else now - since

    def stuck_tid(self) -> int | None:
        """The thread that has been in ``D`` longest, if any."""
        if not self.d_since_by_tid:
            return None
        return min(self.d_since_by_tid, key=lambda tid: (self.d_since_by_tid[tid], tid))


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

    def take_due(self, now: float) -> bool:
        """Whether a scan is due at monotonic ``now``; if so the next one is scheduled."""
        if now < self.next_at:
            return False
        self.next_at = now + self.interval_s
        return True
