"""Ending worker processes with a deadline that always holds (:mod:`._bounded_stop`).

:func:`stop_processes` signals each verified process (SIGTERM, then SIGKILL after a grace), waits on
pidfds, and returns a :class:`StopReport` (:mod:`._stop_report`): who stopped, how, and who could
not be ended (:class:`UnkillableWorker`, a process wedged in the kernel, in ``D`` or looping in ``R``
with SIGKILL pending; sampled with its kernel stacks by :mod:`._survivor`) instead of waiting on it.
Each input is first verified into a target (:mod:`._stop_targets`); the process-wide ledger
(:mod:`._signal_ledger`) sends a given signal to a given process once across concurrent calls.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ._bounded_stop import stop_processes
    from ._stop_report import StopOutcome, StoppedWorker, StopReport, UnkillableWorker

__all__ = ["StopOutcome", "StopReport", "StoppedWorker", "UnkillableWorker", "stop_processes"]

_SOURCES = {
    "._bounded_stop": ("stop_processes",),
    "._stop_report": ("StopOutcome", "StopReport", "StoppedWorker", "UnkillableWorker"),
}

if not TYPE_CHECKING:
    from .._lazy import lazy_exports

    __getattr__, __dir__ = lazy_exports(__name__, _SOURCES, globals())
