"""Ending worker processes with a deadline that always holds (:mod:`._bounded_stop`).

:func:`stop_processes` signals each verified process (SIGTERM, then SIGKILL after a grace), waits on
pidfds, and returns a :class:`StopReport`: who stopped, how, and who could not be ended
(:class:`UnkillableWorker`, a process wedged in the kernel) instead of waiting on it.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ._bounded_stop import StopOutcome as StopOutcome
    from ._bounded_stop import StoppedWorker as StoppedWorker
    from ._bounded_stop import StopReport as StopReport
    from ._bounded_stop import UnkillableWorker as UnkillableWorker
    from ._bounded_stop import stop_processes as stop_processes

__all__ = [
    "StopOutcome",
    "StopReport",
    "StoppedWorker",
    "UnkillableWorker",
    "stop_processes",
]

_SOURCES = {
    "stop_processes": "_bounded_stop",
    "StopReport": "_bounded_stop",
    "StopOutcome": "_bounded_stop",
    "StoppedWorker": "_bounded_stop",
    "UnkillableWorker": "_bounded_stop",
}

if not TYPE_CHECKING:
    from .._lazy import lazy_exports

    __getattr__, __dir__ = lazy_exports(__name__, _SOURCES, globals())
