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
    from ._exit_guard import FatalExitGuard, add_exit_cleanup, interrupt_self_once
    from ._outcome import Outcome, mark_clean, mark_running, read_outcomes, record_outcome
    from ._process_ending import ProcessEnding, Stage, process_ending
    from ._termination_log import write_termination_message

__all__ = ["FatalExitGuard", "Outcome", "ProcessEnding", "Stage", "add_exit_cleanup", "interrupt_self_once",
           "mark_clean", "mark_running", "process_ending", "read_outcomes", "record_outcome",
           "write_termination_message"]

_SOURCES = {
    "._exit_guard": ("FatalExitGuard", "add_exit_cleanup", "interrupt_self_once"),
    "._outcome": ("Outcome", "mark_clean", "mark_running", "read_outcomes", "record_outcome"),
    "._process_ending": ("ProcessEnding", "Stage", "process_ending"),
    "._termination_log": ("write_termination_message",),
}

if not TYPE_CHECKING:
    from .._lazy import lazy_exports

    __getattr__, __dir__ = lazy_exports(__name__, _SOURCES, globals())
