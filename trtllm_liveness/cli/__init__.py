"""The ``trtllm-liveness`` command: one module per subcommand (``_<name>_command.py``), the
top-level parser and dispatch in :mod:`._main`, argument types in :mod:`._arg_types`, output
helpers in :mod:`._output`, exit statuses in :mod:`._exit_status`.

Imported only when the command runs: nothing here loads with the package.
"""

from __future__ import annotations

from ._exit_status import EXIT_STATUS_HELP
from ._main import build_parser, main

__all__ = ["EXIT_STATUS_HELP", "build_parser", "main"]
