"""``trtllm-liveness watch``: block until one of the given processes dies or wedges.

The pids are verified by start time and watched by a :class:`~trtllm_liveness.monitor.WorkerProcessMonitor`
(pidfds; with ``--d-state-timeout`` also their threads' ``D`` state); no signal is ever sent.
"""

from __future__ import annotations

import argparse
import threading
import time
from typing import Any

from .._errors import AccessDenied, LivenessError, ProcessGone
from .._events import EventKind, WorkerEvent, WorkerState
from ..monitor._monitor import WorkerProcessMonitor
from ..process import _procfs
from ..process._identity import ProcessIdentity, capture_identity
from ._arg_types import add_command, pid_arg, seconds_arg
from ._exit_status import EXIT_DIED, EXIT_STATUS_HELP, EXIT_WEDGED
from ._output import Progress, error_status, print_result, printable

__all__ = ["add_watch_parser", "run_watch"]

_WATCH_DESCRIPTION = """\
Block until one of the processes dies, or (with --d-state-timeout) has a thread in D without a
context switch for that long, or becomes unkillable; then print the event (one JSON object with
--json) and exit 3 (died) or 4 (wedged/unkillable). The pids are verified by start time, so a
recycled pid is never mistaken for the process. No signal is ever sent.
"""


def add_watch_parser(sub: Any) -> None:
    """Add the ``watch`` subcommand to ``sub`` (argparse subparsers)."""
    watch = add_command(sub, "watch", run_watch, help="block until one of the processes dies or wedges",
                        description=_WATCH_DESCRIPTION, epilog=EXIT_STATUS_HELP)
    watch.add_argument("pids", nargs="+", type=pid_arg, metavar="PID", help="process ids to watch")
    watch.add_argument("--d-state-timeout", type=seconds_arg(allow_zero=False), default=None, metavar="S",
                       help="report a process wedged once a thread is in D without a context switch this long "
                            "(default: deaths only)")
    watch.add_argument("--scan-interval", type=seconds_arg(allow_zero=False), default=None, metavar="S",
                       help="how often to sample thread states (default min(1, S/5))")
    watch.add_argument("--json", action="store_true", help="print the event as one JSON object")


def run_watch(args: argparse.Namespace) -> int:
    """Run ``watch``; returns the exit status."""
    pids: list[int] = args.pids
    if len(set(pids)) != len(pids):
        return error_status("a pid is given more than once")
    identities: list[ProcessIdentity] = []
    names: dict[int, str] = {}  # pid -> comm, read at the start: the event's line names the process
    for rank, pid in enumerate(pids):
        try:
            identities.append(capture_identity(rank, pid))
        except LivenessError as exc:
            return error_status(_describe_pid_error(pid, exc))
        info = _procfs.stat_or_none(pid)
        names[pid] = "" if info is None else info.comm
    timeout: float | None = args.d_state_timeout
    interval: float = args.scan_interval or (min(1.0, max(0.05, timeout / 5)) if timeout else 1.0)
    got = threading.Event()
    events: list[WorkerEvent] = []

    def on_event(event: WorkerEvent) -> None:
        events.append(event)
        got.set()

    progress = Progress(every_s=60.0)
    with WorkerProcessMonitor(d_state_timeout_s=timeout, scan_interval_s=interval) as monitor:
        monitor.subscribe(on_event)
        monitor.register(identities)
        for status in monitor.statuses():
            if status.state in (WorkerState.UNMONITORED_OTHER_NAMESPACE, WorkerState.UNMONITORED_REMOTE):
                return error_status(f"cannot watch pid {status.identity.pid}: {status.detail}")
        monitor.start()
        what = "death" if timeout is None else f"death, or a thread in D without a context switch for {timeout:g}s"
        progress.line(f"watching {len(identities)} process(es) ({' '.join(map(str, pids))}) for {what}; "
                      "Ctrl-C to stop")
        started = time.monotonic()
        try:  # Ctrl-C: the command's "interrupted" (see _main), after the progress line is finished
            while not got.wait(1.0):
                progress.tick(f"watching {len(identities)} process(es): all alive after "
                              f"{time.monotonic() - started:.0f}s")
        finally:
            progress.done()
    event = events[0]
    print_result(args.json, event.to_dict(), [event.describe(_process_label(event.identity.pid, names))])
    return EXIT_DIED if event.kind is EventKind.DIED else EXIT_WEDGED


def _process_label(pid: int, names: dict[int, str]) -> str:
    # watch takes any pids, not only MPI ranks: name the process, not a "rank".
    name = names.get(pid, "")
    return f"process {pid} ({printable(name)})" if name else f"process {pid}"


def _describe_pid_error(pid: int, exc: LivenessError) -> str:
    if isinstance(exc, AccessDenied):
        return f"permission denied reading /proc/{pid}: run as root or as the process owner"
    if isinstance(exc, ProcessGone):
        return f"no such process: pid {pid}"
    return f"cannot inspect pid {pid}: {exc}"
