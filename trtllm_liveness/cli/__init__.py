"""The ``trtllm-liveness`` command: one module per subcommand (``_<name>_command.py``), the
top-level parser and dispatch in :mod:`._main`, argument types in :mod:`._arg_types`, output
helpers in :mod:`._output`, exit statuses in :mod:`._exit_status`.

Imported only when the command runs: nothing here loads with the package.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ._exit_status import EXIT_STATUS_HELP
    from ._main import build_parser, main

__all__ = ["EXIT_STATUS_HELP", "build_parser", "main"]

_SOURCES = {
    "._exit_status": ("EXIT_STATUS_HELP",),
    "._main": ("build_parser", "main"),
}

if not TYPE_CHECKING:
    from .._lazy import lazy_exports

    __getattr__, __dir__ = lazy_exports(__name__, _SOURCES, globals())
