"""Procfs fallback: ranks that could not get a pidfd (ENOSYS, EPERM, EMFILE) are re-read instead.

The watcher polls them every ``interval_s`` (its epoll timeout then includes this tick), and every
synchronous check polls them too. A read that fails for another reason than the process being
gone (EMFILE, EACCES) is not evidence of death: the rank is tried again at the next poll.
"""

from __future__ import annotations

from .._errors import AccessDenied, ProcessGone, ProcessZombie
from .._events import WorkerState
from ..process import _pidfd
from ._watched_rank import WatchedRank, cause_of, with_oom_cause


class ProcfsFallback:
    """The ranks watched by procfs reads; guarded by the monitor's lock (not thread-safe itself)."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._records: list[WatchedRank] = []

    def __bool__(self) -> bool:
        return bool(self._records)

    def add(self, record: WatchedRank) -> None:
        self._records.append(record)

    def discard(self, record: WatchedRank) -> None:
        if record in self._records:
            self._records.remove(record)

    def clear(self) -> None:
        self._records.clear()

    def poll(self) -> list[WatchedRank]:
        """Re-read every rank once; return those found dead now (their state is set)."""
        died = []
        for record in list(self._records):
            try:
                _pidfd.verify_start_time(record.identity.pid, record.observed_start_time)
            except ProcessGone as exc:
                state = WorkerState.ZOMBIE if isinstance(exc, ProcessZombie) else WorkerState.EXITED
                record.set_state(state, with_oom_cause(record, cause_of(exc, at_registration=False), None))
                self._records.remove(record)
                died.append(record)
            except (OSError, ValueError, AccessDenied):
                continue  # cannot tell this time (EMFILE, EACCES): try again at the next poll
        return died
