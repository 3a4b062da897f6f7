"""Stopped-rank verdicts: a rank stopped by a signal while the engine makes no progress.

docs/stalls.md ("A rank stopped by a signal, under the defaults") says why neither the state nor a
quiet engine alone is a verdict. :class:`StoppedRank` makes one only when the rank was ``T`` at
every scan for the timeout AND the engine
(:class:`~trtllm_liveness.monitor._progress_clock.ProgressClock`) made no progress for as long with
requests pending; a debugger's stop (``t``, ptrace) never counts. A gap between two scans longer
than :data:`MAX_GAP_SCANS` intervals (the watcher itself was stopped or starved) starts the count
again, so time the watcher did not see never counts.
"""

from __future__ import annotations

__all__ = ["MAX_GAP_SCANS", "StoppedRank"]

STOPPED_BY_SIGNAL = "T"
MAX_GAP_SCANS = 3.0


class StoppedRank:
    """One rank's stop, scan after scan, and at most one verdict. Not thread-safe: the monitor's
    lock guards it."""

    def __init__(self, timeout_s: float, interval_s: float) -> None:
        self.timeout_s = timeout_s
        self.max_gap_s = MAX_GAP_SCANS * interval_s
        self.since: float | None = None  # monotonic: the first scan of this stop
        self._last_at: float | None = None
        self.reported = False

    def observe(self, state: str, now: float) -> None:
        """Feed the rank's state at one scan taken at monotonic ``now``."""
        gap = self._last_at is not None and now - self._last_at > self.max_gap_s
        self._last_at = now
        if state != STOPPED_BY_SIGNAL:
            self.since = None
        elif self.since is None or gap:
            self.since = now

    def verdict(self, now: float, quiet_s: float | None, pending: int,
                quiet_needed_s: float | None = None) -> str | None:
        """The verdict's cause, once, when the rank was stopped for the timeout and the engine made
        no progress for as long (``quiet_needed_s`` where longer: after long steps) with requests
        pending (``quiet_s`` None: idle); else None."""
        if self.reported or self.since is None or quiet_s is None:
            return None
        stopped_s = now - self.since
        if stopped_s < self.timeout_s or quiet_s < max(self.timeout_s, quiet_needed_s or 0.0):
            return None
        self.reported = True
        return (f"stopped by a signal (state T) on every scan for {stopped_s:.1f}s while the engine made no progress "
                f"for {quiet_s:.1f}s with {pending} request(s) pending (stopped_timeout_s={self.timeout_s:g})")
