"""The rank table: every registered rank's record and the channel it is watched through.

A local rank's channel is its pidfd, owned by the watcher thread (:mod:`._watcher`) and found here
by descriptor number, or the procfs poll (:mod:`._procfs_fallback`) when it has none. The table
turns what a channel reports into records whose state is set (an exit classified); the monitor
claims their events. Guarded by the monitor's lock: not thread-safe itself.
"""

from __future__ import annotations

from collections.abc import Iterable

from .._events import MonitorMethod, RankStatus, WorkerState
from ..process import _pidfd
from ..process._identity import ProcessIdentity
from ..process._oom import OomCounters
from ..process._thread_sampler import DStateSample, ThreadSampler
from ._procfs_fallback import ProcfsFallback
from ._registration import open_watched_rank
from ._watched_rank import SCANNED_STATES, WatchedRank, classify_exit
from ._watcher import PidfdWatcher
from ._wedge import WedgeTracker

__all__ = ["RankTable", "sample_threads"]


class RankTable:
    """Records by rank, pidfds by number and the procfs-polled ranks; guarded by the monitor's lock."""

    def __init__(self, watcher: PidfdWatcher, procfs_interval_s: float) -> None:
        self.records: dict[int, WatchedRank] = {}
        self.fallback = ProcfsFallback(procfs_interval_s)
        self._watcher = watcher
        self._by_fd: dict[int, WatchedRank] = {}

    def is_current(self, record: WatchedRank) -> bool:
        """Whether ``record`` is still its rank's (not replaced by a re-registration)."""
        return self.records.get(record.identity.rank) is record

    def add(self, identity: ProcessIdentity, *, d_state_timeout_s: float | None,
            oom_counters: OomCounters) -> WatchedRank:
        """Open ``identity``'s record (:func:`~._registration.open_watched_rank`), make it its rank's
        and hand its channel over: the pidfd to the watcher, an alive procfs record to the poll. A
        previous record of the rank must have been :meth:`forget`-ed."""
        record = open_watched_rank(identity, pidfd_capable=self._watcher.pidfd_capable,
                                   procfs_interval_s=self.fallback.interval_s,
                                   d_state_timeout_s=d_state_timeout_s, oom_counters=oom_counters)
        if record.pidfd is not None:
            self._by_fd[record.pidfd] = record
            self._watcher.add(record.pidfd)
        elif record.method is MonitorMethod.PROCFS and record.state is WorkerState.ALIVE:
            self.fallback.add(record)
        self.records[identity.rank] = record
        return record

    def forget(self, record: WatchedRank) -> None:
        """Release ``record``'s channel and sampler (its rank is being registered anew)."""
        self._close_pidfd(record)
        record.close_sampler()
        self.fallback.discard(record)

    def exited(self, ready: Iterable[int]) -> list[WatchedRank]:
        """The records whose pidfd in ``ready`` really reports an exit, classified, pidfds closed."""
        died = []
        for fd in ready:
            record = self._by_fd.get(fd)
            # Re-test the fd under the lock: another thread may have handled and closed it, and a
            # new registration may have reused the number, since epoll reported it.
            if record is None or record.pidfd != fd or not _pidfd.is_exited(fd):
                continue
            classify_exit(record)
            self._close_pidfd(record)
            died.append(record)
        return died

    def release(self) -> None:
        """At close: drop every channel (the watcher owns and closes the pidfds) and sampler."""
        for record in self.records.values():
            record.pidfd = None
            record.close_sampler()
        self._by_fd.clear()
        self.fallback.clear()

    def snapshots(self) -> list[RankStatus]:
        return [self.records[rank].snapshot() for rank in sorted(self.records)]

    def identities(self) -> list[ProcessIdentity]:
        return [self.records[rank].identity for rank in sorted(self.records)]

    def verified_identities(self) -> list[ProcessIdentity]:
        """Local identities whose start time was given and verified: the only signal targets."""
        return [r.identity for _, r in sorted(self.records.items())
                if r.method.signals and r.start_time_verified]

    def wants_scan(self) -> bool:
        """Whether any rank's threads are sampled for wedges (asked at every turn of the watcher:
        it stops at the first such rank and builds no list)."""
        return any(record.sampler is not None and record.state in SCANNED_STATES
                   for record in self.records.values())

    def scan_targets(self) -> list[tuple[WatchedRank, ThreadSampler]]:
        return [(record, record.sampler) for record in self.records.values()
                if record.sampler is not None and record.state in SCANNED_STATES]

    def rearm_wedges(self, timeout_s: float | None) -> None:
        """Give every rank a fresh :class:`WedgeTracker` (D time so far does not count), or none when
        ``timeout_s`` is None; a local rank that can be sampled and had no sampler gets one."""
        for record in self.records.values():
            if timeout_s is None:
                record.wedge = None
                continue
            record.wedge = WedgeTracker(timeout_s)
            if record.sampler is None and record.observed_start_time is not None \
                    and record.method.signals \
                    and record.state in SCANNED_STATES:
                record.sampler = ThreadSampler(record.identity.pid, record.observed_start_time)

    def _close_pidfd(self, record: WatchedRank) -> None:
        fd, record.pidfd = record.pidfd, None
        if fd is not None:
            self._by_fd.pop(fd, None)
            self._watcher.discard(fd)


def sample_threads(
    targets: Iterable[tuple[WatchedRank, ThreadSampler]],
) -> list[tuple[WatchedRank, DStateSample | None]]:
    """Sample each target's threads once (outside any lock: procfs reads). A rank that is gone (its
    pidfd or procfs poll reports the death) or unreadable now is left out."""
    samples: list[tuple[WatchedRank, DStateSample | None]] = []
    for record, sampler in targets:
        try:
            samples.append((record, sampler.sample()))
        except (OSError, ValueError):
            continue
    return samples
