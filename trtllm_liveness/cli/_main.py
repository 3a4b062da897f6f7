"""The ``trtllm-liveness`` command: a demo, and tools for the operator.

Subcommands:
    scan    diagnose processes now: thread states, time in D, SIGKILL pending, zombies, what to do
    watch   block until one of the given processes dies or wedges
    demo            the reference MPI executor with liveness on: a real fault in a worker, the timeline
    demo-processes  the monitor alone on plain processes
    doctor  what the installed TensorRT-LLM allows the extension to cover (hooks found or missing)
    autoload  install, remove or show the .pth that loads the import hook in every interpreter
    quarantine  show (a node health check) or clear the host's quarantine after a wedged worker
    launch      run mpirun/srun; exit non-zero whenever the engine recorded a fatal error

Results go to stdout (one JSON object with ``--json``); progress and errors go to stderr, errors
as one line starting with ``trtllm-liveness:``.

``scan`` and ``watch`` never import ``reference/`` (the demo's executor and its MPI stack): the
``demo`` subcommand's arguments are added, and its module imported, only when it is the command.
``doctor`` imports the TensorRT-LLM integration only when it runs.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import NoReturn

from .._errors import AccessDenied, LivenessError, ProcessGone
from .._events import EventKind, WorkerEvent, WorkerState
from ..diagnose import _scan
from ..monitor._monitor import WorkerProcessMonitor
from ..process import _procfs
from ..process._identity import ProcessIdentity, capture_identity
from ..process._mm_read import DEFAULT_TIMEOUT_S as DEFAULT_READ_TIMEOUT_S
from ..process._mm_read import MmReader, SkippedRead
from ._arg_types import int_arg, package_version, parent_arg, pid_arg, seconds_arg
from ._launch_command import add_launch_parser
from ._output import Progress, out, print_report, printable
from ._quarantine_command import add_quarantine_parser

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_DIED = 3
EXIT_WEDGED = 4
EXIT_INTERRUPTED = 130

EXIT_STATUS_HELP = """\
exit status:
  0    nothing to report (scan: every process healthy)
  1    runtime failure (scan: no process matched the filter, or a /proc entry was unreadable)
  2    bad arguments, or a pid that does not exist or cannot be watched
  3    a process died (watch), or a scanned process is a zombie or gone (scan)
  4    a process is wedged in D or unkillable (watch), or stuck in D, unkillable or stopped (scan)
  130  interrupted (Ctrl-C)
  doctor: 0 covered, 1 degraded, 3 inert, 4 tensorrt_llm not installed (see 'doctor --help')
  quarantine status: 0 OK, 1 quarantined, 2 unknown (see 'quarantine --help')
"""

DOCTOR_STATUS_HELP = """\
exit status:
  0    covered: every upstream name this TensorRT-LLM's route needs is present
  1    degraded: the extension attaches, but some coverage is lost (listed under 'not covered')
  2    bad arguments
  3    inert: the extension cannot attach (no proxy class), or tensorrt_llm fails to import (error named)
  4    tensorrt_llm is not installed (not importable from this interpreter)
"""


def _err(text: str) -> None:
    sys.stderr.write(f"trtllm-liveness: {text}\n")
    sys.stderr.flush()


# ------------------------------------------------------------------------- demo (core only)


def _cmd_demo_processes(args: argparse.Namespace) -> int:
    """Demo on plain processes: SIGKILL one of N sleepers and time the monitor's event."""
    children = [
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
        for _ in range(args.workers)
    ]
    detected = threading.Event()
    seen: list[tuple[float, WorkerEvent]] = []

    def on_event(event: WorkerEvent) -> None:
        seen.append((time.monotonic(), event))
        detected.set()

    try:
        time.sleep(0.05)  # let the interpreters exist long enough to have a stable /proc entry
        identities = [capture_identity(rank, child.pid) for rank, child in enumerate(children)]
        with WorkerProcessMonitor() as monitor:
            monitor.subscribe(on_event)
            monitor.register(identities)
            monitor.start()
            victim = identities[args.rank % len(identities)]
            out(f"watching {len(identities)} worker processes; SIGKILL rank {victim.rank} (pid {victim.pid})")
            t0 = time.monotonic()
            os.kill(victim.pid, signal.SIGKILL)
            got = detected.wait(10.0)
            if not got:
                out("fault NOT detected within 10 s")
                return EXIT_FAILED
            when, event = seen[0]
            out(f"t0        +0.000 ms  SIGKILL sent to pid {victim.pid}")
            out(f"detected  +{(when - t0) * 1e3:.3f} ms  {event.message}")
            if args.json:
                out(json.dumps({"detect_ms": (when - t0) * 1e3, "event": event.to_dict()}))
            return EXIT_OK
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
            child.wait(5)


# ------------------------------------------------------------------------- argument types


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad argument costs the operator one line, not a usage dump."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see --help)\n")


def _describe_pid_error(pid: int, exc: LivenessError) -> str:
    if isinstance(exc, AccessDenied):
        return f"permission denied reading /proc/{pid}: run as root or as the process owner"
    if isinstance(exc, ProcessGone):
        return f"no such process: pid {pid}"
    return f"cannot inspect pid {pid}: {exc}"


# ------------------------------------------------------------------------- watch


def _cmd_watch(args: argparse.Namespace) -> int:
    pids: list[int] = args.pids
    if len(set(pids)) != len(pids):
        return _usage_error("a pid is given more than once")
    identities: list[ProcessIdentity] = []
    names: dict[int, str] = {}  # pid -> comm, read at the start: the event's line names the process
    for rank, pid in enumerate(pids):
        try:
            identities.append(capture_identity(rank, pid))
        except LivenessError as exc:
            return _usage_error(_describe_pid_error(pid, exc))
        try:
            names[pid] = _procfs.read_stat(pid).comm
        except (OSError, ValueError):
            names[pid] = ""
    timeout: float | None = args.d_state_timeout
    interval: float = args.scan_interval or (min(1.0, max(0.05, timeout / 5)) if timeout else 1.0)
    got = threading.Event()
    events: list[WorkerEvent] = []

    def on_event(event: WorkerEvent) -> None:
        events.append(event)
        got.set()

    progress = Progress(sys.stderr, every_s=60.0)
    with WorkerProcessMonitor(d_state_timeout_s=timeout, scan_interval_s=interval) as monitor:
        monitor.subscribe(on_event)
        monitor.register(identities)
        for status in monitor.statuses():
            if status.state in (WorkerState.UNMONITORED_OTHER_NAMESPACE, WorkerState.UNMONITORED_REMOTE):
                return _usage_error(f"cannot watch pid {status.identity.pid}: {status.detail}")
        monitor.start()
        what = "death" if timeout is None else f"death, or a thread in D for {timeout:g}s"
        progress.line(f"watching {len(identities)} process(es) ({' '.join(map(str, pids))}) for {what}; "
                      "Ctrl-C to stop")
        started = time.monotonic()
        try:
            while not got.wait(1.0):
                progress.tick(f"watching {len(identities)} process(es): all alive after "
                              f"{time.monotonic() - started:.0f}s")
        except KeyboardInterrupt:
            progress.done()
            _err("interrupted")
            return EXIT_INTERRUPTED
        progress.done()
    event = events[0]
    out(json.dumps(event.to_dict()) if args.json else event.describe(_process_label(event.identity.pid, names)))
    return EXIT_DIED if event.kind is EventKind.DIED else EXIT_WEDGED


def _process_label(pid: int, names: dict[int, str]) -> str:
    # watch takes any pids, not only MPI ranks: name the process, not a "rank".
    name = names.get(pid, "")
    return f"process {pid} ({printable(name)})" if name else f"process {pid}"


# ------------------------------------------------------------------------- scan


def _cmd_scan(args: argparse.Namespace) -> int:
    filters = {"name": args.name, "parent": args.parent, "cgroup": args.cgroup}
    given = {key: value for key, value in filters.items() if value is not None}
    if args.pids and given:
        return _usage_error("give PIDs or a filter (--name/--parent/--cgroup), not both")
    if not args.pids and not given:
        return _usage_error("give PIDs to scan, or a filter: --name SUBSTR, --parent PID or --cgroup PATH")
    if args.pids:
        # No pre-check: a gone pid is reported gone (status 3) beside the others, and a process
        # of another user is scanned as far as /proc lets this user read it (its stat and status
        # are world-readable; what is not is reported per field).
        pids: list[int] = list(dict.fromkeys(args.pids))
    # One reader for the selection and the scan: one bound on helper threads stuck on mm locks.
    reader = MmReader(args.read_timeout)
    selection_skipped: tuple[SkippedRead, ...] = ()
    if not args.pids:
        selection = _scan.select(**given, reader=reader)
        pids = list(selection.pids)
        selection_skipped = selection.skipped
        for skip in selection_skipped:
            _err(f"pid {skip.pid} not matched by its command line: {skip.detail}; scan it by pid")
        if not pids:
            described = " ".join(f"--{key} {value}" for key, value in given.items())
            _err(f"no process matches {described}")
            return EXIT_FAILED
    samples = 1 if args.window == 0 else args.samples
    progress = Progress(sys.stderr)
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
        counts: dict[str, int] = {}
        for report in result.processes:
            counts[report.verdict.value] = counts.get(report.verdict.value, 0) + 1
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


# ------------------------------------------------------------------------- autoload

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


def _cmd_autoload(args: argparse.Namespace) -> int:
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


# ------------------------------------------------------------------------- doctor


def _cmd_doctor(args: argparse.Namespace) -> int:
    from ..integrations.trtllm import _doctor  # not at import: --help must not load the integration

    report = _doctor.diagnose()
    if args.json:
        out(json.dumps(report.to_dict()))
    else:
        for line in _doctor.format_report(report):
            out(line)
    return report.exit_status


# ------------------------------------------------------------------------- entry point

_MAIN_DESCRIPTION = """\
Notice and diagnose dead or wedged inference worker processes. Use 'trtllm-liveness COMMAND --help'
for the options of each command. Results go to stdout, progress and errors to stderr.
"""

_SCAN_DESCRIPTION = """\
Diagnose processes now. Each process is sampled several times over --window; for it and each of
its threads the scan reports the state, how long a thread was seen in D (uninterruptible sleep),
whether SIGKILL is pending, the kernel wait channel, and whether it is a zombie. A process in D with
SIGKILL pending across samples is UNKILLABLE: only recycling the host ends it.

Give PIDs, or select the processes of a job with filters (combined with AND):
  --name mpi4py.futures.server    name or command line contains the text
  --parent 4242                   descendants of pid 4242 (MPI workers are grandchildren of the launcher)
  --cgroup /sys/fs/cgroup/...     processes of a cgroup directory, or a path as in /proc/PID/cgroup
"""

_WATCH_DESCRIPTION = """\
Block until one of the processes dies, or (with --d-state-timeout) has a thread in D for that long,
or becomes unkillable; then print the event (one JSON object with --json) and exit 3 (died) or 4
(wedged/unkillable). The pids are verified by start time, so a recycled pid is never mistaken for
the process. No signal is ever sent.
"""


def build_parser(*, with_demo: bool = True) -> argparse.ArgumentParser:
    """The argument parser of the ``trtllm-liveness`` command.

    ``with_demo=False`` leaves out the ``demo`` subcommand's own arguments, so that nothing of
    ``reference/`` is imported (:func:`main` passes it unless ``demo`` is the command).
    """
    parser = _Parser(prog="trtllm-liveness", description=_MAIN_DESCRIPTION, epilog=EXIT_STATUS_HELP,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"trtllm-liveness {package_version()}")
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="log the library's warnings (-v) or debug messages (-vv) to stderr")
    sub = parser.add_subparsers(dest="command", required=True,
                                metavar="{scan,watch,demo,demo-processes,doctor,autoload,quarantine,launch}")

    scan = sub.add_parser("scan", help="diagnose processes now: D state, SIGKILL pending, zombies, what to do",
                          description=_SCAN_DESCRIPTION, epilog=EXIT_STATUS_HELP,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
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
    scan.add_argument("--json", action="store_true", help="print the result as one JSON object")
    scan.set_defaults(func=_cmd_scan)

    watch = sub.add_parser("watch", help="block until one of the processes dies or wedges",
                           description=_WATCH_DESCRIPTION, epilog=EXIT_STATUS_HELP,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    watch.add_argument("pids", nargs="+", type=pid_arg, metavar="PID", help="process ids to watch")
    watch.add_argument("--d-state-timeout", type=seconds_arg(allow_zero=False), default=None, metavar="S",
                       help="report a process wedged once a thread is in D this long (default: deaths only)")
    watch.add_argument("--scan-interval", type=seconds_arg(allow_zero=False), default=None, metavar="S",
                       help="how often to sample thread states (default min(1, S/5))")
    watch.add_argument("--json", action="store_true", help="print the event as one JSON object")
    watch.set_defaults(func=_cmd_watch)

    demo = sub.add_parser(
        "demo",
        help="reference MPI executor with liveness on: inject a fault into a worker, print the timeline",
        description="Run the reference MPI executor (TensorRT-LLM's proxy/worker protocol over real mpi4py "
        "workers) with liveness on, stream requests, inject a fault into one rank and print the timeline: "
        "fault, detection, health false, requests failed, shutdown done. With --compare, the same fault first "
        "with the extension off (cut after --compare-bound seconds: what upstream does alone), then on, side "
        "by side. Needs the 'mpi' extra.",
    )
    if with_demo:
        _add_executor_demo_arguments(demo)
    demo.set_defaults(func=_cmd_demo_executor)

    plain = sub.add_parser("demo-processes", help="the monitor alone: SIGKILL one of N plain processes")
    plain.add_argument("--workers", type=int_arg(1, 256), default=4, help="number of worker processes (default 4)")
    plain.add_argument("--rank", type=int_arg(0, 255), default=1, help="rank to kill (default 1)")
    plain.add_argument("--json", action="store_true", help="also print the result as one JSON object")
    plain.set_defaults(func=_cmd_demo_processes)

    doctor = sub.add_parser("doctor", help="what the installed TensorRT-LLM lets the extension cover",
                            description="Check the tensorrt_llm this interpreter would import: each upstream name "
                            "the extension uses, found or missing, and the resulting coverage (docs/doctor.md).",
                            epilog=DOCTOR_STATUS_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    doctor.add_argument("--json", action="store_true", help="print the result as one JSON object")
    doctor.set_defaults(func=_cmd_doctor)

    autoload = sub.add_parser("autoload", help="install, remove or show the autoload .pth of this environment",
                              description=_AUTOLOAD_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    autoload.add_argument("action", choices=["install", "remove", "status"])
    autoload.add_argument("--site", metavar="DIR", default=None,
                          help="site-packages directory (default: this interpreter's purelib)")
    autoload.set_defaults(func=_cmd_autoload)

    add_quarantine_parser(sub, _Parser)
    add_launch_parser(sub, _Parser)
    return parser


def _add_executor_demo_arguments(parser: argparse.ArgumentParser) -> None:
    try:
        from ..demo import _demo_run as demo
    except ImportError as exc:  # mpi extra missing: the demo explains at run time
        parser.set_defaults(demo_import_error=str(exc))
        return
    demo.add_arguments(parser)


def _cmd_demo_executor(args: argparse.Namespace) -> int:
    error = getattr(args, "demo_import_error", None)
    if error is not None:
        _err(f"demo needs the 'mpi' extra (pip install 'trtllm-liveness[mpi]'): {error}")
        return EXIT_USAGE

    from ..demo import _demo_run as demo

    return demo.run(args)


def _usage_error(text: str) -> int:
    _err(text)
    return EXIT_USAGE


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
        _err("interrupted")
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (``| head``): stop quietly, and keep Python from complaining at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_FAILED
    except LivenessError as exc:
        _err(str(exc))
        return EXIT_FAILED
    except OSError as exc:
        _err(f"{exc.strerror or exc} ({exc.filename})" if exc.filename else str(exc))
        return EXIT_FAILED
    finally:
        if restore_logging is not None:
            restore_logging()
    return status


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
