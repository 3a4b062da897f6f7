"""One watched rank: its record, its state transitions and how an exit is classified.

A :class:`WatchedRank` is mutable and guarded by the monitor's lock (its sampler has its own
lock). Each state that is fatal to the engine maps to one event kind; a record reports each kind
at most once (:meth:`WatchedRank.claim_event`), which is the first half of the exactly-once
promise (the :mod:`._delivery` log is the second).
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field

from .._errors import PidReused, ProcessZombie
from .._events import EVENT_OF_STATE, EventKind, MonitorMethod, RankStatus, WorkerEvent, WorkerState
from ..process import _procfs
from ..process._identity import ProcessIdentity
from ..process._oom import OomProbe
from ..process._thread_sampler import DStateSample, ThreadSampler
from ._stopped_rank import StoppedRank
from ._wedge import WedgeTracker

SCANNED_STATES = (WorkerState.ALIVE, WorkerState.WEDGED)


@dataclass(eq=False)
class WatchedRank:
    """Mutable per-rank record; guarded by the monitor's lock (the sampler has its own).

    ``observed_start_time`` is the start time read right after the pidfd was opened: the
    identity's own when it had one (verified), else the one seen then (``start_time_verified``
    False: the process is watched, since a pidfd pins it, but never a signal target).
    """

    identity: ProcessIdentity
    state: WorkerState
    method: MonitorMethod
    since: float = field(default_factory=time.monotonic)
    since_wall: float = field(default_factory=time.time)
    detail: str = ""
    pidfd: int | None = None
    observed_start_time: int | None = None
    wedge: WedgeTracker | None = None
    sampler: ThreadSampler | None = None
    oom: OomProbe | None = None
    stopped: StoppedRank | None = None
    reported: set[EventKind] = field(default_factory=set)

    @property
    def start_time_verified(self) -> bool:
        return self.identity.start_time is not None

    def set_state(self, state: WorkerState, detail: str) -> None:
        if state is not self.state:
            self.state = state
            self.since = time.monotonic()
            self.since_wall = time.time()
        self.detail = detail

    def snapshot(self) -> RankStatus:
        return RankStatus(self.identity, self.state, self.since, self.since_wall, self.method, self.detail)

    def claim_event(self, *, tid: int | None = None, wchan: str = "",
                    fault_at: float | None = None) -> WorkerEvent | None:
        """The event for the current state if its kind was not reported yet (then it is).
        ``fault_at`` is given for remote ranks (their agent measured it); else the wedge's."""
        kind = EVENT_OF_STATE.get(self.state)
        if kind is None or kind in self.reported:
            return None
        self.reported.add(kind)
        if kind is EventKind.DIED:
            self.close_sampler()
        if fault_at is None and kind is not EventKind.DIED and self.wedge is not None:
            fault_at = self.wedge.stuck_since
        return WorkerEvent(kind, self.identity, self.detail, tid=tid, wchan=wchan, fault_at=fault_at)

    def close_sampler(self) -> None:
        if self.sampler is not None:
            self.sampler.close()

    def observe_threads(self, wedge: WedgeTracker, sample: DStateSample | None, now: float) -> tuple[int, str] | None:
        """Feed one thread sample (taken at monotonic ``now``) to ``wedge`` and set the state it
        implies. Returns the stuck thread and its wait channel when a new verdict (wedged or
        unkillable) was reached: the caller then claims its event. The detail names what
        corroborates ``D``: no context switch over the time stated."""
        was_seconds = wedge.stuck_seconds(now)
        verdict = wedge.observe(sample, now)
        if sample is None:
            if self.state is WorkerState.WEDGED:
                # The failure already raised stays (it is sticky); the view tells the truth.
                self.set_state(WorkerState.ALIVE, f"left D state after at least {was_seconds:.1f}s (was wedged)")
            return None
        if verdict is None:
            return None
        wchan = sample.wchan or "?"
        if verdict is EventKind.UNKILLABLE:
            tid = wedge.unkillable_tid or sample.d_tids[0]
            # SIGKILL was pending at the previous sample too, and this thread has not run since.
            held_s = now - wedge.clocks[tid].since if tid in wedge.clocks else 0.0
            self.set_state(WorkerState.UNKILLABLE, f"thread {tid} in D with SIGKILL pending, no context switch "
                                                   f"for {held_s:.1f}s (wchan {wchan})")
        else:
            tid = wedge.stuck_tid() or sample.d_tids[0]
            self.set_state(WorkerState.WEDGED, f"thread {tid} in D for {wedge.stuck_seconds(now):.1f}s "
                                               f"with no context switch (wchan {wchan})")
        return tid, sample.wchan


def classify_exit(record: WatchedRank) -> None:
    """Set the state of a rank whose pidfd became readable: exited (reaped) or zombie."""
    expected_start = record.observed_start_time
    info = _procfs.stat_or_none(record.identity.pid)
    if info is None:
        record.set_state(WorkerState.EXITED, with_oom_cause(record, "process exited (reaped)", None))
        return
    if expected_start is not None and info.start_time != expected_start:
        detail = "process exited (reaped; PID already reused)"
        record.set_state(WorkerState.EXITED, with_oom_cause(record, detail, None))
    elif info.exited:
        how = "" if info.exit_code is None else f", {_procfs.describe_wait_status(info.exit_code)}"
        detail = f"process exited (zombie, not yet reaped{how})"
        record.set_state(WorkerState.ZOMBIE, with_oom_cause(record, detail, info.exit_code))
    else:
        # Readable pidfd, stat still there and not a zombie: the exit is in progress.
        record.set_state(WorkerState.EXITED, with_oom_cause(record, "process exited", None))


def cause_of(exc: Exception, *, at_registration: bool) -> str:
    when = " at registration" if at_registration else ""
    if isinstance(exc, PidReused):
        return f"PID reused{when}: start time differs from the registered one (process exited)"
    if isinstance(exc, ProcessZombie):
        return f"process exited{when} (zombie, not yet reaped)"
    return f"process exited{when} (no longer exists)"


def with_oom_cause(record: WatchedRank, detail: str, wait_status: int | None) -> str:
    """Append the OOM killer as the cause when the kernel's counters say so.

    Only a SIGKILL (or an exit whose status we cannot see) can be an OOM kill.
    """
    if record.oom is None:
        return detail
    if wait_status is not None and not (os.WIFSIGNALED(wait_status) and os.WTERMSIG(wait_status) == signal.SIGKILL):
        return detail
    verdict = record.oom.verdict()
    return detail if verdict is None else f"{detail}; {verdict}"
