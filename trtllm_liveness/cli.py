"""The ``trtllm-liveness`` command: a demo, and tools for the operator.

Subcommands:
    demo    start real worker processes, inject a fault, print the detection timeline
    watch   block until one of the given processes dies or wedges
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from ._errors import LivenessError
from ._events import EventKind, WorkerEvent
from ._identity import ProcessIdentity, capture_identity
from ._monitor import WorkerProcessMonitor

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_DIED = 3
EXIT_WEDGED = 4
EXIT_INTERRUPTED = 130


def _out(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


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
            _out(f"watching {len(identities)} worker processes; SIGKILL rank {victim.rank} (pid {victim.pid})")
            t0 = time.monotonic()
            os.kill(victim.pid, signal.SIGKILL)
            got = detected.wait(10.0)
            if not got:
                _out("fault NOT detected within 10 s")
                return EXIT_FAILED
            when, event = seen[0]
            _out(f"t0        +0.000 ms  SIGKILL sent to pid {victim.pid}")
            _out(f"detected  +{(when - t0) * 1e3:.3f} ms  {event.message}")
            if args.json:
                _out(json.dumps({"detect_ms": (when - t0) * 1e3, "event": event.to_dict()}))
            return EXIT_OK
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
            child.wait(5)


# ------------------------------------------------------------------------- watch


def _parse_pids(values: Sequence[str]) -> list[int]:
    pids = []
    for value in values:
        try:
            pid = int(value)
        except ValueError:
            raise SystemExit(_usage_error(f"not a pid: {value!r}")) from None
        if pid <= 1:
            raise SystemExit(_usage_error(f"refusing pid {pid}"))
        pids.append(pid)
    return pids


def _usage_error(text: str) -> int:
    _err(text)
    return EXIT_USAGE


def _cmd_watch(args: argparse.Namespace) -> int:
    pids = _parse_pids(args.pids)
    identities: list[ProcessIdentity] = []
    for rank, pid in enumerate(pids):
        try:
            identities.append(capture_identity(rank, pid))
        except LivenessError as exc:
            _err(f"cannot watch pid {pid}: {exc}")
            return EXIT_USAGE
    got = threading.Event()
    events: list[WorkerEvent] = []

    def on_event(event: WorkerEvent) -> None:
        events.append(event)
        got.set()

    with WorkerProcessMonitor(d_state_timeout_s=args.d_state_timeout, scan_interval_s=args.scan_interval) as monitor:
        monitor.subscribe(on_event)
        monitor.register(identities)
        monitor.start()
        _out(f"watching {len(identities)} process(es): {' '.join(map(str, pids))}")
        try:
            while not got.wait(1.0):
                pass
        except KeyboardInterrupt:
            _out("interrupted")
            return EXIT_INTERRUPTED
    event = events[0]
    _out(json.dumps(event.to_dict()) if args.json else event.message)
    return EXIT_DIED if event.kind is EventKind.DIED else EXIT_WEDGED


# ------------------------------------------------------------------------- entry point


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``trtllm-liveness`` command."""
    parser = argparse.ArgumentParser(prog="trtllm-liveness", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run real workers, inject a fault, print the detection timeline")
    demo.add_argument("--workers", type=int, default=4, help="number of worker processes (default 4)")
    demo.add_argument("--rank", type=int, default=1, help="rank to kill (default 1)")
    demo.add_argument("--json", action="store_true", help="also print the result as one JSON object")
    demo.set_defaults(func=_cmd_demo_processes)

    watch = sub.add_parser("watch", help="block until one of the processes dies or wedges")
    watch.add_argument("pids", nargs="+", help="process ids to watch")
    watch.add_argument("--d-state-timeout", type=float, default=None, metavar="S",
                       help="report a process wedged after a thread is in D state this long")
    watch.add_argument("--scan-interval", type=float, default=1.0, metavar="S",
                       help="how often to sample thread states (default 1 s)")
    watch.add_argument("--json", action="store_true", help="print the event as JSON")
    watch.set_defaults(func=_cmd_watch)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        status: int = args.func(args)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    return status


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
