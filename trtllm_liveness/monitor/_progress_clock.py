"""ProgressClock: when the engine last made progress, and whether it has work to make it on.

The second signal of every verdict that a state or a silence alone could fake: a host whose agent
went silent is lost only once the engine, whose every step needs every rank, also stopped making
progress with requests pending (:mod:`trtllm_liveness.multihost._hub`); a rank stopped by a signal
is a fatal verdict only under the same condition (:mod:`._stopped_rank`). Progress is

- an executor iteration a rank reported (:meth:`ProgressClock.note_iteration`, with the
  iteration's own time: a beat's delay never makes the engine look quieter than it was... except
  by the beats not yet sent, at most one beat interval: the owner keeps that interval a fraction
  of every bound read here);
- a request submitted to an idle engine (:meth:`ProgressClock.note_submitted`): idle time never
  counts, so the clock of a busy engine starts when its work does;
- where no rank ever reported an iteration (1.2.x), output reaching the proxy, sampled
  (:meth:`ProgressClock.sample_output`): the ``activity`` count (the context switches of upstream's
  dispatch thread, which runs only when a response arrives) is read whenever the clock is read,
  and a change dates output at that read. Nothing runs per response; an output is dated late by
  at most the time between two reads, which makes the engine look busier, never quieter.

An idle engine (nothing pending) has no quiet time at all: :meth:`ProgressClock.quiet_s` is None.
An engine whose steps are long (a prefill of a huge prompt, a first-request autotune) is quiet for a
whole step while healthy: :meth:`ProgressClock.quiet_bound` raises a bound to 1.5 times the longest
gap between two iterations of the last 10 minutes of work, so a verdict never reads one long step as
a stopped engine. Standard library only; every method is thread-safe and never blocks beyond a short
lock.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable

__all__ = ["GAP_MARGIN", "GAP_WINDOW_S", "ProgressClock"]

GAP_WINDOW_S = 600.0
"""How long a long step raises the quiet bounds (:meth:`ProgressClock.quiet_bound`)."""
GAP_MARGIN = 1.5
"""A bound is at least this many times the longest recent gap between two iterations."""


class ProgressClock:
    """The engine's progress; see the module docstring. ``pending()`` returns how many requests
    are pending now (``len()`` of the proxy's results: atomic, never blocks); ``activity()`` a
    count that changes when output reaches the proxy (None when unknown; never blocks)."""

    def __init__(self, pending: Callable[[], int], activity: Callable[[], int | None] | None = None) -> None:
        self._pending = pending
        self._activity = activity
        self._activity_seen: int | None = None
        self._lock = threading.Lock()
        now = time.monotonic()
        self._output_at = now
        self._iteration_at = now
        self._busy_since = now
        self._output_floor = 0.0  # the last output dated before iterations took over
        self._gaps: collections.deque[tuple[float, float]] = collections.deque()  # (at, gap), gaps decreasing
        self.iterations_seen = False
        """Whether any rank ever reported an executor iteration: without iterations only output is
        progress, and a long non-streaming generation outputs nothing until it ends."""

    def sample_output(self, *, always: bool = False) -> float:
        """Read the activity count: the monotonic time of the last output known (a change since the
        last read is output now). Once ranks report iterations, they are the clock's progress and
        this returns 0.0, unless ``always`` (the stall timer's reading: output it dates late can
        only delay a stall, and keeps counting if the iteration reports stop)."""
        with self._lock:
            return self._sample_locked(always)

    def _sample_locked(self, always: bool = False) -> float:
        if self.iterations_seen and not always:
            return 0.0
        if self._activity is not None:
            try:
                count = self._activity()
            except Exception:
                count = None
            if count is not None and count != self._activity_seen:
                self._activity_seen = count
                self._output_at = time.monotonic()
        return self._output_at

    def note_iteration(self, at: float) -> None:
        """A rank's executor iteration at monotonic ``at`` (a time in the future counts as now)."""
        at = min(at, time.monotonic())
        with self._lock:
            if at > self._iteration_at:
                # A step's length: from the previous iteration (or the work's arrival on an idle engine).
                self._note_gap(at, at - max(self._iteration_at, self._busy_since))
                self._iteration_at = at
            if not self.iterations_seen:
                # Iterations take over from sampled output: the output already dated stays the floor
                # of the last progress, so what a reader saw never moves back (the steps' gaps are
                # the iterations' own).
                self.iterations_seen = True
                self._output_floor = self._output_at

    def _note_gap(self, at: float, gap: float) -> None:
        # A sliding maximum: each gap drops the shorter ones before it, which can never be the
        # longest again; the front is the longest of the window.
        while self._gaps and self._gaps[-1][1] <= gap:
            self._gaps.pop()
        self._gaps.append((at, gap))
        while self._gaps[0][0] < at - GAP_WINDOW_S:
            self._gaps.popleft()

    def longest_gap_s(self, now: float | None = None) -> float:
        """The longest gap between two iterations (a step) in the last :data:`GAP_WINDOW_S` of work."""
        horizon = (time.monotonic() if now is None else now) - GAP_WINDOW_S
        with self._lock:
            return max((gap for at, gap in self._gaps if at >= horizon), default=0.0)

    def quiet_bound(self, base_s: float, now: float | None = None) -> float:
        """``base_s``, or :data:`GAP_MARGIN` times the longest recent step where that is longer:
        how long the engine must be quiet before its quiet says more than one long step."""
        return max(base_s, GAP_MARGIN * self.longest_gap_s(now))

    def note_submitted(self, *, was_idle: bool) -> None:
        """A request was submitted; ``was_idle``: none was pending just before (the clock starts)."""
        if was_idle:
            self._busy_since = time.monotonic()

    def pending(self) -> int:
        """How many requests are pending now (0 when ``pending()`` fails)."""
        try:
            return max(0, int(self._pending()))
        except Exception:
            return 0

    def last_progress(self) -> float:
        """Monotonic time of the last progress (or of the start of the current work)."""
        with self._lock:
            return max(self._sample_locked(), self._output_floor, self._iteration_at, self._busy_since)

    def quiet_s(self, now: float | None = None) -> float | None:
        """Seconds without progress while requests are pending; None while the engine is idle."""
        if self.pending() <= 0:
            return None
        return max(0.0, (time.monotonic() if now is None else now) - self.last_progress())
