"""``trtllm-liveness autoload``: install, remove or show the .pth that loads the import hook.

The file itself is :mod:`trtllm_liveness.integrations.trtllm_autoload`'s, imported when the
command runs.
"""

from __future__ import annotations

import argparse
from typing import Any

from ._arg_types import add_command
from ._exit_status import EXIT_DIED, EXIT_FAILED, EXIT_OK
from ._output import out

__all__ = ["add_autoload_parser", "run_autoload"]

_AUTOLOAD_DESCRIPTION = """\
Manage the .pth file that loads the TensorRT-LLM import hook in every Python process of this
environment (it then follows TRTLLM_WORKER_LIVENESS; off unless set). The line does nothing once
the package is uninstalled; 'remove' deletes the file (pip uninstall does not).

exit status:
  0    install/remove done; status: installed and current
  1    status: not installed
  2    bad arguments
  3    status: a file with another content (an older line): run 'install' to rewrite it
"""


def add_autoload_parser(sub: Any) -> None:
    """Add the ``autoload`` subcommand to ``sub`` (argparse subparsers)."""
    autoload = add_command(sub, "autoload", run_autoload, description=_AUTOLOAD_DESCRIPTION,
                           help="install, remove or show the autoload .pth of this environment")
    autoload.add_argument("action", choices=["install", "remove", "status"])
    autoload.add_argument("--site", metavar="DIR", default=None,
                          help="site-packages directory (default: this interpreter's purelib)")


def run_autoload(args: argparse.Namespace) -> int:
    """Run ``autoload install|remove|status``; returns the exit status."""
    from ..integrations import trtllm_autoload as autoload

    if args.action == "install":
        out(f"installed {autoload.write_pth(args.site)}")
        return EXIT_OK
    if args.action == "remove":
        removed = autoload.remove_pth(args.site)
        out(f"removed {removed}" if removed else "not installed: nothing to remove")
        return EXIT_OK
    path, state = autoload.pth_status(args.site)
    if state is None:
        out(f"not installed ({path} absent)")
        return EXIT_FAILED
    out(f"{'installed' if state == 'current' else 'outdated'}: {path}")
    return EXIT_OK if state == "current" else EXIT_DIED
