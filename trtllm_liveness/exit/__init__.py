"""What happens when the process ends after a fatal failure.

- :mod:`._process_ending`: :class:`ProcessEnding`, the one owner of the process's ending (the exit
  decision, the outcome record, the termination message, the quarantine's wait, the threads the
  ending awaits, a registry of cleanups run once in stage order), reached through
  :func:`process_ending`;
- :mod:`._exit_guard`: :class:`FatalExitGuard`, a graceful shutdown once, then a bounded exit with a
  non-zero status (69 for a host that must be recycled);
- :mod:`._outcome`: the engine's outcome record for ``trtllm-liveness launch``, whose launcher's own
  status cannot be trusted;
- :mod:`._termination_log`: the fatal reason where Kubernetes reads a container's termination
  message.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ._exit_guard import FatalExitGuard as FatalExitGuard
    from ._exit_guard import add_exit_cleanup as add_exit_cleanup
    from ._exit_guard import interrupt_self_once as interrupt_self_once
    from ._outcome import Outcome as Outcome
    from ._outcome import mark_clean as mark_clean
    from ._outcome import mark_running as mark_running
    from ._outcome import read_outcomes as read_outcomes
    from ._outcome import record_outcome as record_outcome
    from ._process_ending import ProcessEnding as ProcessEnding
    from ._process_ending import Stage as Stage
    from ._process_ending import process_ending as process_ending
    from ._termination_log import write_termination_message as write_termination_message

__all__ = [
    "FatalExitGuard",
    "Outcome",
    "ProcessEnding",
    "Stage",
    "add_exit_cleanup",
    "interrupt_self_once",
    "mark_clean",
    "mark_running",
    "process_ending",
    "read_outcomes",
    "record_outcome",
    "write_termination_message",
]

_SOURCES = {
    "FatalExitGuard": "_exit_guard",
    "add_exit_cleanup": "_exit_guard",
    "interrupt_self_once": "_exit_guard",
    "Outcome": "_outcome",
    "record_outcome": "_outcome",
    "read_outcomes": "_outcome",
    "mark_running": "_outcome",
    "mark_clean": "_outcome",
    "ProcessEnding": "_process_ending",
    "Stage": "_process_ending",
    "process_ending": "_process_ending",
    "write_termination_message": "_termination_log",
}

if not TYPE_CHECKING:
    from .._lazy import lazy_exports

    __getattr__, __dir__ = lazy_exports(__name__, _SOURCES, globals())
