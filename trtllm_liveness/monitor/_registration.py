"""Registration: turn one identity into the :class:`~._watched_rank.WatchedRank` that watches it.

A local rank is watched through a pidfd opened after verifying its start time (the watcher sleeps
on it); when ``pidfd_open`` fails (ENOSYS, EPERM, EMFILE) it is polled from procfs instead. A rank
of another host or PID namespace is kept as unmonitored, not dead; one already gone, a zombie or a
reused PID is recorded dead at once. With wedge detection on, an alive rank also gets its
:class:`~._wedge.WedgeTracker` and :class:`~..process._thread_sampler.ThreadSampler`.

The caller (the monitor, under its lock) owns what comes back: it hands a record's ``pidfd`` to
the watcher and an alive ``procfs`` record to the fallback poll.
"""

from __future__ import annotations

import errno
import logging

from .._errors import AccessDenied, ProcessGone, ProcessZombie
from .._events import MonitorMethod, WorkerState
from ..process import _pidfd, _procfs
from ..process._identity import ProcessIdentity, local_hostname, local_pid_namespace
from ..process._oom import OomCounters, OomProbe
from ..process._thread_sampler import ThreadSampler
from ._watched_rank import WatchedRank, cause_of
from ._wedge import WedgeTracker

__all__ = ["open_watched_rank"]

logger = logging.getLogger(__name__)


def open_watched_rank(identity: ProcessIdentity, *, pidfd_capable: bool, procfs_interval_s: float,
                      d_state_timeout_s: float | None, oom_counters: OomCounters) -> WatchedRank:
    """The record that watches ``identity``: with ``pidfd`` set (the caller watches it), or
    ``method`` ``procfs`` and alive (the caller polls it), or already dead or unmonitored.

    ``oom_counters`` shares each memory cgroup's resolution and OOM counter across one ``register``
    call (workers of one job share a cgroup). Blocks only for procfs reads and ``pidfd_open``.
    """
    if identity.hostname != local_hostname():
        return WatchedRank(identity, WorkerState.UNMONITORED_REMOTE, MonitorMethod.NONE,
                           detail=f"on host {identity.hostname}, not {local_hostname()}")
    if identity.pid_namespace is not None and identity.pid_namespace != local_pid_namespace():
        return WatchedRank(identity, WorkerState.UNMONITORED_OTHER_NAMESPACE, MonitorMethod.NONE,
                           detail=f"PID namespace {identity.pid_namespace}, not {local_pid_namespace()}")
    notes = []
    if identity.pid_namespace is None:
        notes.append("PID namespace unknown (assumed this one)")
    fallback_reason = "pidfd unsupported"
    if pidfd_capable:
        try:
            fd = _pidfd.open_verified_pidfd(identity.pid, identity.start_time)
        except (ProcessGone, AccessDenied) as exc:
            return _dead_at_registration(identity, exc, MonitorMethod.PIDFD)
        except (OSError, ValueError) as exc:
            code = getattr(exc, "errno", None)
            fallback_reason = f"pidfd_open failed: {errno.errorcode.get(code or 0, str(exc))}"
            logger.warning("rank %d (pid %d): %s; polling procfs every %.2fs instead",
                           identity.rank, identity.pid, fallback_reason, procfs_interval_s)
        else:
            observed = identity.start_time
            if observed is None:  # the start time behind the pidfd just opened, read now (only sampling needs it)
                observed = _procfs.start_time_or_none(identity.pid)
                seen = "unreadable" if observed is None else str(observed)
                notes.append(f"start time unverified (observed {seen}; never signalled)")
            record = _alive_record(identity, MonitorMethod.PIDFD, observed, oom_counters, "; ".join(notes),
                                   d_state_timeout_s)
            record.pidfd = fd
            return record
    try:
        info = _pidfd.verify_start_time(identity.pid, identity.start_time)
    except (ProcessGone, AccessDenied) as exc:
        return _dead_at_registration(identity, exc, MonitorMethod.PROCFS)
    except (OSError, ValueError) as exc:
        # Cannot read procfs now either (EMFILE): not evidence of death. Poll until it works.
        fallback_reason += f"; not yet verified ({exc})"
        observed = identity.start_time
    else:
        observed = info.start_time
    if identity.start_time is None:
        notes.append("start time unverified (never signalled)")
    return _alive_record(identity, MonitorMethod.PROCFS, observed, oom_counters, "; ".join([fallback_reason, *notes]),
                         d_state_timeout_s)


def _alive_record(identity: ProcessIdentity, method: MonitorMethod, observed: int | None,
                  oom_counters: OomCounters, detail: str, d_state_timeout_s: float | None) -> WatchedRank:
    wedge = WedgeTracker(d_state_timeout_s) if d_state_timeout_s else None
    sampler = ThreadSampler(identity.pid, observed) if wedge is not None and observed is not None else None
    return WatchedRank(identity, WorkerState.ALIVE, method, detail=detail, observed_start_time=observed,
                       wedge=wedge, sampler=sampler, oom=OomProbe.capture(identity.pid, oom_counters))


def _dead_at_registration(identity: ProcessIdentity, exc: Exception, method: MonitorMethod) -> WatchedRank:
    if isinstance(exc, AccessDenied):
        # Cannot read it, so cannot verify it: not ours to judge dead; keep it unmonitored.
        return WatchedRank(identity, WorkerState.UNMONITORED_OTHER_NAMESPACE, MonitorMethod.NONE,
                           detail="access denied to /proc entry")
    state = WorkerState.ZOMBIE if isinstance(exc, ProcessZombie) else WorkerState.EXITED
    return WatchedRank(identity, state, method, detail=cause_of(exc, at_registration=True))
