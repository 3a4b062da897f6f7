"""Output of the ``trtllm-liveness`` command: results on stdout, progress and errors on stderr
(an error is one line starting with ``trtllm-liveness:``), and the scan's per-process report as
text (``--json`` prints ``to_dict()`` instead)."""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any, TextIO

from ..diagnose import _scan
from ..process import _procfs
from ._exit_status import EXIT_USAGE

__all__ = ["Progress", "err", "error_status", "out", "print_report", "print_result", "printable", "stderr_line"]


def out(text: str) -> None:
    """One result line on stdout, flushed (a reader of a pipe sees it at once)."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def stderr_line(text: str) -> None:
    """One line on stderr as it is given, flushed."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def err(text: str) -> None:
    """One error line on stderr, flushed."""
    stderr_line(f"trtllm-liveness: {text}")


def print_result(as_json: bool, data: Mapping[str, Any], lines: Iterable[str] = ()) -> None:
    """A command's result: ``data`` as one JSON object with ``--json``, else ``lines``."""
    if as_json:
        out(json.dumps(data))
        return
    for line in lines:
        out(line)


def error_status(text: str, status: int = EXIT_USAGE) -> int:
    """Report an error (one line, see :func:`err`); returns ``status``, what the command exits with."""
    err(text)
    return status


class Progress:
    """A progress line on stderr: redrawn in place on a terminal, else repeated every ``every_s``."""

    def __init__(self, every_s: float = 30.0) -> None:
        self._stream: TextIO = sys.stderr
        self._tty = self._stream.isatty()
        self._every_s = every_s
        self._last = time.monotonic()
        self._drawn = False

    def line(self, text: str) -> None:
        self._finish_redraw()
        self._stream.write(f"trtllm-liveness: {text}\n")
        self._stream.flush()
        self._last = time.monotonic()

    def tick(self, text: str) -> None:
        if self._tty:
            self._stream.write(f"\r\033[Ktrtllm-liveness: {text}")
            self._stream.flush()
            self._drawn = True
        elif time.monotonic() - self._last >= self._every_s:
            self.line(text)

    def _finish_redraw(self) -> None:
        if self._drawn:
            self._stream.write("\n")
            self._drawn = False

    def done(self) -> None:
        self._finish_redraw()
        self._stream.flush()


def _thread_summary(report: _scan.ProcessReport) -> str:
    counts = Counter(thread.state for thread in report.threads)
    states = ", ".join(f"{state} {count}" for state, count in sorted(counts.items()))
    return f"{len(report.threads)} thread(s) ({states})"


def printable(text: str) -> str:
    """``text`` with control characters escaped."""
    # Command lines and thread names are chosen by whoever started the process: keep control
    # characters from reaching the operator's terminal.
    return "".join(char if char.isprintable() else f"\\x{ord(char):02x}" for char in text)


def print_report(report: _scan.ProcessReport, *, all_threads: bool) -> None:
    verdict = report.verdict.value.upper() if report.flagged else report.verdict.value
    head = f"pid {report.pid}"
    if report.comm:
        head += f" ({printable(report.comm)}) ppid {report.ppid}"
    if report.state:
        head += f" state {report.state}"
    line = f"{head}: {verdict}"
    if report.detail:
        line += f" - {report.detail}"
    if report.threads and not (all_threads or report.flagged):
        line += f"; {_thread_summary(report)}"
    out(line)
    if report.cmdline:
        out(f"  cmd: {printable(' '.join(report.cmdline))}"[:300])
    for skip in report.skipped:
        out(f"  skipped: {skip.detail}")
    if report.threads and (all_threads or report.flagged):
        out(f"    {'TID':<8} {'NAME':<16} {'STATE':<5} {'IN-D':>7} {'SIGKILL':<8} WCHAN")
        for thread in report.threads:
            in_d = f"{thread.d_seconds:.1f}s" if thread.state in _procfs.UNINTERRUPTIBLE_STATES else "-"
            pending = "pending" if thread.kill_pending else "-"
            out(f"    {thread.tid:<8} {printable(thread.name)[:16]:<16} {thread.state:<5} {in_d:>7} {pending:<8} "
                 f"{thread.wchan or '-'}")
    if report.advice:
        out(f"  action: {report.advice}")
