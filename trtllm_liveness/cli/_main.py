"""The ``trtllm-liveness`` command: a demo, and tools for the operator.

Each subcommand lives in its own module (``_<name>_command.py``: its docstring says what the
command is for, its one-line ``help`` makes the list in ``trtllm-liveness --help``); the module's
``add_<name>_parser(sub)`` adds its parser(s) and sets ``func`` to its handler; :data:`SUBCOMMANDS`
lists them in ``--help``'s order, so a new subcommand is one line there. This module keeps the
top-level parser, the logging set-up and the dispatch.

Results go to stdout (one JSON object with ``--json``); progress and errors go to stderr, errors
as one line starting with ``trtllm-liveness:``.

``scan`` and ``watch`` never import ``demo/`` (the demo's executor and its MPI stack): the
``demo`` subcommand's arguments are added, and its module imported, only when it is the command.
``doctor`` imports the TensorRT-LLM integration only when it runs.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from .. import __version__
from .._errors import LivenessError
from ._autoload_command import add_autoload_parser
from ._config_command import add_config_parser
from ._demo_command import add_demo_arguments, add_demo_parsers
from ._doctor_command import add_doctor_parser
from ._drill_command import add_drill_parser
from ._exit_status import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_STATUS_HELP, EXIT_USAGE
from ._launch_command import add_launch_parser
from ._output import error_status
from ._quarantine_command import add_quarantine_parser
from ._scan_command import add_scan_parser
from ._watch_command import add_watch_parser

__all__ = ["EXIT_STATUS_HELP", "SUBCOMMANDS", "build_parser", "main"]

# The subcommands, in --help's order: each adds its parser(s) to the subparsers and sets ``func``.
SUBCOMMANDS: tuple[Callable[[Any], None], ...] = (
    add_scan_parser,
    add_watch_parser,
    add_demo_parsers,
    add_doctor_parser,
    add_autoload_parser,
    add_config_parser,
    add_quarantine_parser,
    add_launch_parser,
    add_drill_parser,
)


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad argument costs the operator one line, not a usage dump."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see --help)\n")


_MAIN_DESCRIPTION = """\
Notice and diagnose dead or wedged inference worker processes. Use 'trtllm-liveness COMMAND --help'
for the options of each command. Results go to stdout, progress and errors to stderr.
"""


def build_parser(*, with_demo: bool = True) -> argparse.ArgumentParser:
    """The argument parser of the ``trtllm-liveness`` command.

    ``with_demo=False`` leaves out the ``demo`` subcommand's own arguments, so that nothing of
    ``demo/`` is imported (:func:`main` passes it unless ``demo`` is the command).
    """
    parser = _Parser(prog="trtllm-liveness", description=_MAIN_DESCRIPTION, epilog=EXIT_STATUS_HELP,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"trtllm-liveness {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="log the library's warnings (-v) or debug messages (-vv) to stderr")
    sub = parser.add_subparsers(dest="command", required=True)
    for add_subcommand in SUBCOMMANDS:
        add_subcommand(sub)
    sub.metavar = "{" + ",".join(sub.choices) + "}"
    if with_demo:
        add_demo_arguments(sub.choices["demo"])
    return parser


def _configure_logging(verbosity: int) -> Callable[[], None]:
    """Route the package's log to stderr for one command; returns what undoes it (``main`` may run
    inside a caller's process, whose logging must not stay changed)."""
    # The commands print events themselves; by default the library's event logs would repeat
    # them on stderr, so only a dying watcher thread (CRITICAL) gets through unless -v is given.
    level = {0: logging.CRITICAL, 1: logging.WARNING}.get(verbosity, logging.DEBUG)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("trtllm-liveness: %(levelname)s %(name)s: %(message)s"))
    package_logger = logging.getLogger("trtllm_liveness")
    previous = package_logger.level
    package_logger.addHandler(handler)
    package_logger.setLevel(level)

    def restore() -> None:
        package_logger.removeHandler(handler)
        package_logger.setLevel(previous)

    return restore


def _command_of(argv: Sequence[str]) -> str | None:
    # The top-level options take no value (-v/--verbose, --help), so the first word that is not an
    # option is the subcommand.
    return next((word for word in argv if not word.startswith("-")), None)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (see ``EXIT_STATUS_HELP``)."""
    words = sys.argv[1:] if argv is None else list(argv)
    restore_logging: Callable[[], None] | None = None
    try:
        args = build_parser(with_demo=_command_of(words) == "demo").parse_args(words)
        restore_logging = _configure_logging(args.verbose)
        status: int = args.func(args)
    except KeyboardInterrupt:
        return error_status("interrupted", EXIT_INTERRUPTED)
    except BrokenPipeError:
        # The reader went away (``| head``): stop quietly, and keep Python from complaining at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_FAILED
    except LivenessError as exc:
        return error_status(str(exc), EXIT_FAILED)
    except OSError as exc:
        return error_status(f"{exc.strerror or exc} ({exc.filename})" if exc.filename else str(exc), EXIT_FAILED)
    finally:
        if restore_logging is not None:
            restore_logging()
    return status
