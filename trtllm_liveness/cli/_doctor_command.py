"""``trtllm-liveness doctor``: what the installed TensorRT-LLM lets the extension cover.

The check itself is :mod:`trtllm_liveness.integrations.trtllm._doctor`, imported only when the
command runs (``--help`` must not load the integration).
"""

from __future__ import annotations

import argparse
from typing import Any

from ._arg_types import JSON_HELP, add_command
from ._output import print_result

__all__ = ["DOCTOR_STATUS_HELP", "add_doctor_parser", "run_doctor"]

DOCTOR_STATUS_HELP = """\
exit status:
  0    covered: every upstream name this TensorRT-LLM's route needs is present
  1    degraded: the extension attaches, but some coverage is lost (listed under 'not covered')
  2    bad arguments
  3    inert: the extension cannot attach (no proxy class), or tensorrt_llm fails to import (error named)
  4    tensorrt_llm is not installed (not importable from this interpreter)
  5    TRTLLM_WORKER_LIVENESS is invalid (the 'settings:' line names the key): every engine start would fail
"""


def add_doctor_parser(sub: Any) -> None:
    """Add the ``doctor`` subcommand to ``sub`` (argparse subparsers)."""
    doctor = add_command(sub, "doctor", run_doctor, help="what the installed TensorRT-LLM lets the extension cover",
                         description="Check the tensorrt_llm this interpreter would import: each upstream name "
                         "the extension uses, found or missing, and the resulting coverage (docs/doctor.md).",
                         epilog=DOCTOR_STATUS_HELP)
    doctor.add_argument("--json", action="store_true", help=JSON_HELP)


def run_doctor(args: argparse.Namespace) -> int:
    """Run ``doctor``; returns the coverage's exit status."""
    from ..integrations.trtllm import _doctor  # not at import: --help must not load the integration

    report = _doctor.diagnose()
    print_result(args.json, report.to_dict(), _doctor.format_report(report))
    return report.exit_status
