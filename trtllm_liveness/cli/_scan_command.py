"""``trtllm-liveness scan``: diagnose processes now (D state, SIGKILL pending, zombies, what to do).

The processes are given by pid or selected with filters (:mod:`~trtllm_liveness.diagnose._process_selection`),
sampled over a window (:mod:`~trtllm_liveness.diagnose._scan`) and, with ``--stacks``, diagnosed
(:mod:`~trtllm_liveness.diagnose._diagnosis`: CPU activity, Python stacks, odd rank out).
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from typing import Any

from ..diagnose import _process_selection, _scan
from ..process._mm_read import DEFAULT_TIMEOUT_S as DEFAULT_READ_TIMEOUT_S
from ..process._mm_read import MmReader, SkippedRead
from ._arg_types import JSON_HELP, add_command, int_arg, parent_arg, pid_arg, seconds_arg
from ._exit_status import EXIT_DIED, EXIT_FAILED, EXIT_OK, EXIT_STATUS_HELP, EXIT_WEDGED
from ._output import Progress, err, error_status, out, print_report, printable

__all__ = ["add_scan_parser", "run_scan"]

_SCAN_DESCRIPTION = """\
Diagnose processes now. Each process is sampled several times over --window; for it and each of
its threads the scan reports the state, how long a thread was seen in D (uninterruptible sleep),
whether SIGKILL is pending, the kernel wait channel, and whether it is a zombie. A thread in D on
every sample without a context switch between them is stuck (d-state; one that switches is slow
I/O making progress: ok). A process in D with SIGKILL pending across samples, not having run
between them, is UNKILLABLE: only recycling the host ends it.

Give PIDs, or select the processes of a job with filters (combined with AND):
  --name mpi4py.futures.server    name or command line contains the text
  --parent 4242                   descendants of pid 4242 (MPI workers are grandchildren of the launcher)
  --cgroup /sys/fs/cgroup/...     processes of a cgroup directory, or a path as in /proc/PID/cgroup
"""


def add_scan_parser(sub: Any) -> None:
    """Add the ``scan`` subcommand to ``sub`` (argparse subparsers)."""
    scan = add_command(sub, "scan", run_scan, description=_SCAN_DESCRIPTION, epilog=EXIT_STATUS_HELP,
                       help="diagnose processes now: D state, SIGKILL pending, zombies, what to do")
    scan.add_argument("pids", nargs="*", type=pid_arg, metavar="PID", help="process ids to scan")
    scan.add_argument("--name", metavar="SUBSTR", help="select processes whose name or command line contains SUBSTR")
    scan.add_argument("--parent", type=parent_arg, metavar="PID", help="select the descendants of PID")
    scan.add_argument("--cgroup", metavar="PATH", help="select the processes of a cgroup (directory or cgroup path)")
    scan.add_argument("--window", type=seconds_arg(allow_zero=True), default=1.0, metavar="S",
                      help="sample over this many seconds to confirm a thread seen in D (default 1; 0 takes "
                      "one sample); when the first sample sees no thread in D, the scan ends there")
    scan.add_argument("--samples", type=int_arg(1, 10000), default=5, metavar="N",
                      help="number of samples over the window (default 5)")
    scan.add_argument("--threads", action="store_true", help="list every thread, also of healthy processes")
    scan.add_argument("--read-timeout", type=seconds_arg(allow_zero=False), default=DEFAULT_READ_TIMEOUT_S,
                      metavar="S", help="give up reading a command line after S seconds (its mm lock is held; "
                      f"default {DEFAULT_READ_TIMEOUT_S:g}); a process with a thread in D is not read")
    scan.add_argument("--stacks", action="store_true", help="also: each thread spinning/sleeping (CPU over "
                      "0.2 s), Python stacks by py-spy (extra 'diagnose'; none for a process in D), odd rank out")
    scan.add_argument("--json", action="store_true", help=JSON_HELP)


def run_scan(args: argparse.Namespace) -> int:
    """Run ``scan``; returns the exit status."""
    filters = {"name": args.name, "parent": args.parent, "cgroup": args.cgroup}
    given = {key: value for key, value in filters.items() if value is not None}
    if args.pids and given:
        return error_status("give PIDs or a filter (--name/--parent/--cgroup), not both")
    if not args.pids and not given:
        return error_status("give PIDs to scan, or a filter: --name SUBSTR, --parent PID or --cgroup PATH")
    if args.pids:
        # No pre-check: a gone pid is reported gone (status 3) beside the others, and a process
        # of another user is scanned as far as /proc lets this user read it (its stat and status
        # are world-readable; what is not is reported per field).
        pids: list[int] = list(dict.fromkeys(args.pids))
    # One reader for the selection and the scan: one bound on helper threads stuck on mm locks.
    reader = MmReader(args.read_timeout)
    selection_skipped: tuple[SkippedRead, ...] = ()
    if not args.pids:
        selection = _process_selection.select(**given, reader=reader)
        pids = list(selection.pids)
        selection_skipped = selection.skipped
        for skip in selection_skipped:
            err(f"pid {skip.pid} not matched by its command line: {skip.detail}; scan it by pid")
        if not pids:
            described = " ".join(f"--{key} {value}" for key, value in given.items())
            return error_status(f"no process matches {described}", EXIT_FAILED)
    samples = 1 if args.window == 0 else args.samples
    progress = Progress()
    if args.window >= 1.0:
        progress.line(f"sampling {len(pids)} process(es) for up to {args.window:g}s ({samples} samples; "
                      "ends after the first when no thread is in D)...")
    diagnosis: _diagnosis.Diagnosis | None = None
    try:
        if args.stacks:  # imported only here: py-spy runs, CPU classification, odd rank out
            from ..diagnose import _diagnosis, _diagnosis_text
            diagnosis = _diagnosis.diagnose(pids, window_s=args.window, scan_samples=samples, reader=reader,
                                            cpu_window_s=min(args.window, _diagnosis.DEFAULT_WINDOW_S))
        result = diagnosis.scan if diagnosis is not None else _scan.scan(
            pids, window_s=args.window, samples=samples, reader=reader)
    finally:
        reader.close()
    progress.done()
    if args.json:
        data = result.to_dict()
        data["selection_skipped"] = [skip.to_dict() for skip in selection_skipped]
        if diagnosis is not None:
            data["diagnosis"] = diagnosis.to_dict(include_scan=False)
        out(json.dumps(data))
    else:
        for report in result.processes:
            print_report(report, all_threads=args.threads)
            rank = None if diagnosis is None else diagnosis.rank(report.pid)
            for line in [] if rank is None else _diagnosis_text.rank_lines(rank, printable):
                out(line)
        counts = Counter(report.verdict.value for report in result.processes)
        summary = ", ".join(f"{count} {verdict}" for verdict, count in counts.items())
        out(f"summary: {len(result.processes)} process(es) over {result.window_s:g}s, {result.samples} "
             f"sample(s): {summary}")
        unkillable = result.unkillable
        if unkillable:
            out(f"ACTION: {len(unkillable)} unkillable process(es) (pid {' '.join(str(r.pid) for r in unkillable)}): "
                 f"{_scan.RECYCLE_ADVICE}")
        for line in [] if diagnosis is None else _diagnosis_text.summary_lines(diagnosis):
            out(line)
    verdicts = [report.verdict for report in result.processes]
    if any(verdict.is_stuck for verdict in verdicts):
        return EXIT_WEDGED
    if any(verdict.is_dead for verdict in verdicts):
        return EXIT_DIED
    if any(verdict is _scan.Verdict.ACCESS_DENIED for verdict in verdicts):
        return EXIT_FAILED
    return EXIT_OK
