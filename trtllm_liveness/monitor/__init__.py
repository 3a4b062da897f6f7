"""Watching ranks: deaths, wedges and stalls become events, each delivered exactly once.

The flow: identities are registered with :class:`WorkerProcessMonitor` (:mod:`._monitor`), which
opens one :mod:`._watched_rank` record per rank (:mod:`._registration`) and keeps it in its rank
table (:mod:`._rank_table`); the watcher thread (:mod:`._watcher`) sleeps on every rank's pidfd and
a wakeup, and on its tick samples thread states for ``D``
(:mod:`trtllm_liveness.process._thread_sampler`), which become wedge verdicts (:mod:`._wedge`);
ranks without a pidfd are re-read from ``/proc`` (:mod:`._procfs_fallback`); remote ranks' reports
from their hosts' agents are merged in by :mod:`._remote_reports`; every state change is an event
handed to the subscribers by :mod:`._delivery`, in order, once, outside locks.
:class:`StallDetector` (:mod:`._stall_timer`) is the timer for "alive but making no progress", and
:class:`StalledSince` what the statuses show while the engine is stalled. :mod:`._progress_clock`
is the engine's progress, the second signal of the verdicts a state or a silence alone could fake:
a rank stopped by a signal (:mod:`._stopped_rank`) and a silent host
(:mod:`trtllm_liveness.multihost._host_silence`).
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ._delivery import EventLog
    from ._monitor import WorkerProcessMonitor
    from ._stall_timer import ProgressSource, StallDetector, StalledSince, StallInfo
    from ._watcher import PidfdWatcher
    from ._wedge import WedgeTracker

__all__ = ["EventLog", "PidfdWatcher", "ProgressSource", "StallDetector", "StallInfo", "StalledSince", "WedgeTracker",
           "WorkerProcessMonitor"]

_SOURCES = {
    "._delivery": ("EventLog",),
    "._monitor": ("WorkerProcessMonitor",),
    "._stall_timer": ("ProgressSource", "StallDetector", "StallInfo", "StalledSince"),
    "._watcher": ("PidfdWatcher",),
    "._wedge": ("WedgeTracker",),
}

if not TYPE_CHECKING:
    from .._lazy import lazy_exports

    __getattr__, __dir__ = lazy_exports(__name__, _SOURCES, globals())
