"""The ``trtllm-liveness`` command: one module per subcommand, the parser and dispatch in
:mod:`._main`, argument types in :mod:`._arg_types`, output helpers in :mod:`._output`.

Imported only when the command runs: nothing here loads with the package.
"""

from __future__ import annotations

from ._main import EXIT_STATUS_HELP, build_parser, main

__all__ = ["EXIT_STATUS_HELP", "build_parser", "main"]
