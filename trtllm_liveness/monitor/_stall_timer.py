"""StallDetector: "alive, not dead, not in D, but making no progress", detected by a timer.

An engine is **stalled** when at least one request is pending and it has made no progress for
``timeout_s`` (docs/stalls.md says what counts as progress, and why an idle engine never stalls).
Progress is whatever the owner reports with :meth:`StallDetector.note_progress`; the clock starts
when a request becomes pending on an idle engine (:meth:`StallDetector.note_submitted`).

Event-driven, not a poll: one thread (owned here, with its condition variable as its only wakeup)
sleeps until the earliest moment a stall is possible (last progress + timeout) and, while the
engine is idle or already stalled, until it is woken. Progress only moves that moment later, so
noting it is one short lock and never wakes the thread, except to end a stall; a submission wakes
it only where it waits for work. Progress the owner
can only sample (``probe``: output seen by a count, not told) is read at each of the thread's
decisions, at most :data:`PROBE_INTERVAL_S` apart while a request is pending or a stall is under
way. The callbacks run in
that thread, one at a time and never under the lock: ``on_stall`` exactly once per stall, then
``on_resume`` exactly once when it ends (unless the detector is closed first).

Standard library only.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from .._events import RankStatus, WorkerState

__all__ = ["ProgressSource", "StallDetector", "StallInfo", "StalledSince"]

logger = logging.getLogger(__name__)

_RECHECK_S = 60.0
"""Bound on each wait of the timer where only a wakeup can change its decision (idle, stalled):
each bound passed is one re-evaluation, which decides the same."""
PROBE_INTERVAL_S = 1.0
"""Bound on each wait of a timer with a ``probe`` while work is pending or a stall is under way:
sampled progress is dated at most this late."""


class ProgressSource:
    """Names of what counted as progress (``StallInfo.last_progress_source``)."""

    OUTPUT = "output"  # a response of a request reached the proxy
    ITERATION = "iteration"  # a rank reported an executor iteration
    SUBMITTED = "submitted"  # a request became pending on an idle engine (the clock starts)
    STARTED = "started"  # the detector started


@dataclass(frozen=True)
class StallInfo:
    """One stall of an engine.

    Attributes:
        number: 1 for the engine's first stall, then 2, ...
        timeout_s: the configured bound.
        last_progress_at: ``time.monotonic()`` of the last progress before the stall.
        last_progress_source: what that progress was (:class:`ProgressSource`).
        detected_at / detected_wall: when the stall was declared (monotonic / ``time.time()``).
        pending: how many requests were pending then.
        ended_at: monotonic time progress resumed, once it did.
    """

    number: int
    timeout_s: float
    last_progress_at: float
    last_progress_source: str
    detected_at: float
    detected_wall: float
    pending: int
    ended_at: float | None = None

    @property
    def overshoot_s(self) -> float:
        """How long after ``last_progress_at + timeout_s`` the stall was declared."""
        return self.detected_at - (self.last_progress_at + self.timeout_s)

    @property
    def quiet_s(self) -> float:
        """Seconds without progress when the stall was declared."""
        return self.detected_at - self.last_progress_at

    def describe(self) -> str:
        """One line for logs and errors."""
        return (f"no progress for {self.quiet_s:.2f}s with {self.pending} request(s) pending "
                f"(stall_timeout_s={self.timeout_s:g}; last progress: {self.last_progress_source})")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (times as seconds; ``since_wall`` is the wall time of the last progress)."""
        return {
            "number": self.number,
            "timeout_s": self.timeout_s,
            "quiet_s": round(self.quiet_s, 6),
            "last_progress_source": self.last_progress_source,
            "since_wall": self.detected_wall - self.quiet_s,
            "detected_wall": self.detected_wall,
            "pending": self.pending,
            "ended": self.ended_at is not None,
        }


@dataclass(frozen=True)
class StalledSince:
    """A stalled engine as the monitor shows it (``WorkerProcessMonitor.set_stalled``): since when,
    ``since`` (monotonic) and ``since_wall`` (``time.time()``), and ``detail`` (why). A stall is a
    fact about the engine, not one process: every local rank otherwise ``alive`` shows it."""

    since: float
    since_wall: float
    detail: str

    def over(self, status: RankStatus) -> RankStatus:
        """``status`` as shown while stalled: an ``alive`` rank reads ``stalled`` since the stall
        began, with its detail; any other state is left as it is."""
        if status.state is not WorkerState.ALIVE:
            return status
        return replace(status, state=WorkerState.STALLED, since=self.since, since_wall=self.since_wall,
                       detail=self.detail)


class StallDetector:
    """The stall timer of one engine; see the module docstring.

    Args:
        timeout_s: seconds without progress (with a request pending) that make a stall; > 0.
        pending: returns how many requests are pending now; called from the detector's thread,
            so it must not block (``len()`` of the proxy's results dict).
        on_stall: called once per stall with its :class:`StallInfo`.
        on_resume: called once when that stall ends, with the ended :class:`StallInfo`.
        probe: returns the monotonic time of the latest progress only sampling shows (output, see
            :meth:`~trtllm_liveness.monitor._progress_clock.ProgressClock.sample_output`); called
            from the detector's thread under its lock, so it must not block.

    Thread-safe: every public method may be called from any thread, concurrently with the timer.
    """

    def __init__(self, timeout_s: float, pending: Callable[[], int], *,
                 on_stall: Callable[[StallInfo], None],
                 on_resume: Callable[[StallInfo], None] | None = None,
                 probe: Callable[[], float] | None = None) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.timeout_s = float(timeout_s)
        self._pending = pending
        self._on_stall = on_stall
        self._on_resume = on_resume
        self._probe = probe
        self._probed_at = -PROBE_INTERVAL_S
        self._cond = threading.Condition(threading.Lock())
        self._last = time.monotonic()
        self._last_source = ProgressSource.STARTED
        self._current: StallInfo | None = None
        self._idle = False  # the timer found nothing pending and waits for work
        # Each registered request writes a new number here, without the lock: a number the timer
        # has not seen tells it a request came while it looked at pending() or waited.
        self._submission_numbers = itertools.count(1)
        self._submission = 0
        self._count = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="trtllm-liveness-stall", daemon=True)
        self._started = False

    # ----------------------------------------------------------------- public

    def start(self) -> StallDetector:
        """Start the timer thread (the clock starts now); idempotent. Returns self."""
        with self._cond:
            if self._started or self._closed:
                return self
            self._started = True
            self._last = time.monotonic()
            self._thread.start()  # under the lock: close() never joins a thread not yet started
        return self

    def note_progress(self, source: str = ProgressSource.OUTPUT, at: float | None = None) -> None:
        """The engine made progress at ``at`` (monotonic; default now). Never blocks beyond a
        short lock; wakes the timer only to end a stall. A time in the future counts as now."""
        now = time.monotonic()
        when = now if at is None or at > now else at
        with self._cond:
            if when > self._last:
                self._last = when
                self._last_source = source
                if self._current is not None:
                    self._cond.notify()

    def note_submitted(self, *, was_idle: bool) -> None:
        """A request is being submitted (before it is registered); ``was_idle``: no request was
        pending just before it. Only then does the clock restart (a new request is not progress of
        a stalled engine); a stall under way then ends too (with nothing pending, it was over).
        Wakes the timer only where it waits for work or a stall is under way: one waiting for its
        deadline finds the later one when it comes (a wake-up per request would cost the request
        path a switch of threads)."""
        if not was_idle:
            return  # a busy engine's request: the clock runs on (note_registered wakes an idle timer)
        now = time.monotonic()
        with self._cond:
            if now > self._last:
                self._last = now
                self._last_source = ProgressSource.SUBMITTED
            if self._idle or self._current is not None:
                self._cond.notify()

    def note_registered(self) -> None:
        """A submitted request is registered (``pending()`` counts it). Writes a new submission
        number, then wakes the timer if it waits for work: either the timer's last look at the
        number finds it new, or this call finds the timer idle (see :meth:`_step_locked`)."""
        self._submission = next(self._submission_numbers)
        if self._idle:
            with self._cond:
                self._cond.notify()

    @property
    def current(self) -> StallInfo | None:
        """The stall under way, or None."""
        return self._current

    @property
    def stalls(self) -> int:
        """How many stalls were declared so far."""
        return self._count

    @property
    def last_progress(self) -> tuple[float, str]:
        """(monotonic time, source) of the last progress noted."""
        with self._cond:
            return self._last, self._last_source

    def close(self, timeout: float = 1.0) -> None:
        """Stop the timer: no callback starts after the timer thread saw this (one already
        running may finish; the thread is joined for at most ``timeout`` seconds, never from a
        callback). Idempotent."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            started = self._started
        if started and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    # ----------------------------------------------------------------- timer thread

    def _run(self) -> None:
        while True:
            fire: Callable[[], None] | None = None
            with self._cond:
                if self._closed:
                    return
                fire = self._step_locked()
                if self._closed:  # close() came while the timer waited: no callback after it
                    return
            if fire is not None:
                try:
                    fire()
                except Exception:
                    logger.exception("liveness: a stall callback raised")

    def _sample_locked(self, now: float, decision: bool) -> float:
        """Read the probe at a decision (the deadline reached, a stall under way) and otherwise at
        most once per :data:`PROBE_INTERVAL_S` (a submission's wake-up is no reason to read it);
        the bound on the timer's next wait."""
        if self._probe is None:
            return _RECHECK_S
        if decision or now - self._probed_at >= PROBE_INTERVAL_S:
            self._probed_at = now
            try:
                at = self._probe()
            except Exception:
                logger.debug("liveness: the stall detector's probe raised", exc_info=True)
                at = 0.0
            if at > self._last:
                self._last = at
                self._last_source = ProgressSource.OUTPUT
        return PROBE_INTERVAL_S

    def _step_locked(self) -> Callable[[], None] | None:
        """One decision of the timer, under the lock: wait, or return the callback to run."""
        current = self._current
        bound = self._sample_locked(time.monotonic(), current is not None
                                    or time.monotonic() >= self._last + self.timeout_s)
        if current is not None:
            if self._last > current.last_progress_at:
                ended = replace(current, ended_at=self._last)
                self._current = None
                on_resume = self._on_resume
                return None if on_resume is None else (lambda: on_resume(ended))
            self._cond.wait(bound)  # stalled: until progress (or close) wakes us
            return None
        now = time.monotonic()
        deadline = self._last + self.timeout_s
        if now < deadline:
            self._cond.wait(min(deadline - now, bound))
            return None
        seen = self._submission
        try:
            pending = int(self._pending())
        except Exception:
            logger.exception("liveness: the stall detector's pending() raised; taken as idle")
            pending = 0
        if pending <= 0:
            # Idle: never a stall. Wait until a request (note_submitted, note_registered) wakes
            # us. Idle is set before the last look at the submission number: a request registered
            # after that look reads idle and wakes us. One registered since `seen` was taken may
            # have been missed by pending(): its clock starts now (a stall only later, never false).
            self._idle = True
            if self._submission == seen:
                self._cond.wait(_RECHECK_S)
            self._idle = False
            woke = time.monotonic()
            if self._submission != seen and woke > self._last:
                self._last, self._last_source = woke, ProgressSource.SUBMITTED
            return None
        self._count += 1
        info = StallInfo(number=self._count, timeout_s=self.timeout_s, last_progress_at=self._last,
                         last_progress_source=self._last_source, detected_at=now, detected_wall=time.time(),
                         pending=pending)
        self._current = info
        on_stall = self._on_stall
        return lambda: on_stall(info)
