"""Argument types of the ``trtllm-liveness`` command: each parses one word or raises
``argparse.ArgumentTypeError`` with a one-line reason (the CLI turns it into exit status 2); and
:func:`add_command`, how every subcommand adds its parser."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from typing import Any

from ..process import _procfs

__all__ = ["JSON_HELP", "add_command", "int_arg", "parent_arg", "pid_arg", "seconds_arg"]

JSON_HELP = "print the result as one JSON object"


def add_command(sub: Any, name: str, run: Callable[[argparse.Namespace], int], **texts: str) -> argparse.ArgumentParser:
    """Add subcommand ``name`` to ``sub`` (argparse subparsers), handled by ``run``; ``texts`` are its
    ``help``, ``description`` and ``epilog``, printed as written (their line breaks kept)."""
    parser: argparse.ArgumentParser = sub.add_parser(name, formatter_class=argparse.RawDescriptionHelpFormatter,
                                                     **texts)
    parser.set_defaults(func=run)
    return parser


def pid_arg(value: str) -> int:
    try:
        pid = int(value, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a pid: {value!r}") from None
    if pid <= 0:
        raise argparse.ArgumentTypeError(f"not a pid: {value!r} (must be a positive integer)")
    if pid == 1:
        # In a container's own PID namespace, PID 1 is often the server itself (no init in the
        # image): then it is what the operator means. The host's init, or tini & co, never is.
        role = _procfs.pid1_role()
        if role == "host-init":
            raise argparse.ArgumentTypeError("refusing pid 1: the host's init is never a worker")
        if role == "container-init":
            raise argparse.ArgumentTypeError("refusing pid 1: it is this container's init program, not the "
                                             "server; select the server by --parent 1 or by its pid")
    if pid == os.getpid():
        raise argparse.ArgumentTypeError(f"refusing pid {pid}: that is this command itself")
    return pid


def parent_arg(value: str) -> int:
    # Descendants of a container's PID 1 (an init or the server) are the container's processes;
    # descendants of the host's init would be every process of the host.
    try:
        return pid_arg(value)
    except argparse.ArgumentTypeError:
        if value.strip() == "1" and _procfs.pid1_role() != "host-init":
            return 1
        raise


def seconds_arg(*, allow_zero: bool) -> Callable[[str], float]:
    def parse(value: str) -> float:
        try:
            seconds = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number of seconds: {value!r}") from None
        if not math.isfinite(seconds) or seconds < 0 or (seconds == 0 and not allow_zero) or seconds > 86400:
            bound = ">= 0" if allow_zero else "> 0"
            raise argparse.ArgumentTypeError(f"seconds must be {bound} and at most 86400, got {value!r}")
        return seconds

    return parse


def int_arg(low: int, high: int) -> Callable[[str], int]:
    def parse(value: str) -> int:
        try:
            number = int(value, 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {value!r}") from None
        if not low <= number <= high:
            raise argparse.ArgumentTypeError(f"must be between {low} and {high}, got {number}")
        return number

    return parse
