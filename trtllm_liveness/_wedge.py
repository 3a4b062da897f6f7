"""Uninterruptible-sleep (``D``) detection, per thread, with a timeout.

A worker wedged in the GPU driver, NCCL or RDMA often has its *main* thread in ``S`` while one
helper thread is stuck in ``D``; torchrun's check reads only the main thread and misses it. Here
every thread of ``/proc/<pid>/task`` is sampled. A thread in ``D`` with SIGKILL pending cannot die
until the kernel lets go: that is "unkillable".
"""

from __future__ import annotations

from dataclasses import dataclass

from . import _procfs
from ._events import EventKind


@dataclass(frozen=True)
class DStateSample:
    """The threads of one process found in ``D`` at one instant."""

    d_tids: tuple[int, ...]
    kill_pending: bool
    wchan: str


def sample_d_state(pid: int) -> DStateSample | None:
    """Sample ``pid``'s threads; None when no thread is in ``D``.

    Raises ``FileNotFoundError``/``ProcessLookupError`` when the process is gone. Costs one
    ``listdir`` and one small read per thread; the signal mask and wait channel are read only
    when a ``D`` thread is found.
    """
    states = _procfs.read_thread_states(pid)
    d_tids = tuple(sorted(tid for tid, state in states.items() if state in _procfs.UNINTERRUPTIBLE_STATES))
    if not d_tids:
        return None
    kill_pending = _procfs.sigkill_pending(pid) or any(
        _safe_thread_kill_pending(pid, tid) for tid in d_tids
    )
    return DStateSample(d_tids, kill_pending, _procfs.read_wchan(pid, d_tids[0]))


def _safe_thread_kill_pending(pid: int, tid: int) -> bool:
    try:
        return _procfs.sigkill_pending(pid, tid)
    except (FileNotFoundError, ProcessLookupError):
        return False


class WedgeTracker:
    """Turns successive samples of one process into at most one WEDGED and one UNKILLABLE verdict.

    WEDGED: some thread has been in ``D`` on every sample for at least ``timeout_s``.
    UNKILLABLE: ``D`` with SIGKILL pending on two consecutive samples, i.e. it survived SIGKILL
    for at least one sampling interval (a process that is merely exiting passes through ``D``
    briefly and must not be flagged). Not thread-safe: one owner samples it.
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.d_since: float | None = None
        self.kill_pending_scans = 0
        self.reported: set[EventKind] = set()
        self.last_sample: DStateSample | None = None

    def observe(self, sample: DStateSample | None, now: float) -> EventKind | None:
        """Feed one sample taken at monotonic time ``now``; return a newly reached verdict."""
        self.last_sample = sample
        if sample is None:
            self.d_since = None
            self.kill_pending_scans = 0
            return None
        if self.d_since is None:
            self.d_since = now
        self.kill_pending_scans = self.kill_pending_scans + 1 if sample.kill_pending else 0
        if self.kill_pending_scans >= 2 and EventKind.UNKILLABLE not in self.reported:
            self.reported.add(EventKind.UNKILLABLE)
            return EventKind.UNKILLABLE
        if now - self.d_since >= self.timeout_s and not self.reported:
            self.reported.add(EventKind.WEDGED)
            return EventKind.WEDGED
        return None

    def d_seconds(self, now: float) -> float:
        """How long the process has been seen in ``D`` (0 when it is not)."""
        return 0.0 if self.d_since is None else now - self.d_since
