"""``trtllm-liveness demo`` and ``demo-processes``: see a fault detected.

``demo`` runs the reference MPI executor (:mod:`trtllm_liveness.demo`) with liveness on and injects
a fault into a worker; its own arguments, and ``demo/`` with its MPI stack, are loaded only when it
is the command (:func:`add_demo_arguments`). ``demo-processes`` is the monitor alone on plain
processes, core only.
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
from typing import Any

from .._events import WorkerEvent
from ..monitor._monitor import WorkerProcessMonitor
from ..process._identity import capture_identity
from ._arg_types import add_command, int_arg
from ._exit_status import EXIT_FAILED, EXIT_OK
from ._output import error_status, out

__all__ = ["add_demo_arguments", "add_demo_parsers", "run_demo", "run_demo_processes"]


def add_demo_parsers(sub: Any) -> None:
    """Add the ``demo`` and ``demo-processes`` subcommands to ``sub`` (argparse subparsers), ``demo``
    without its own arguments (see :func:`add_demo_arguments`)."""
    demo = sub.add_parser(
        "demo",
        help="reference MPI executor with liveness on: inject a fault into a worker, print the timeline",
        description="Run the reference MPI executor (TensorRT-LLM's proxy/worker protocol over real mpi4py "
        "workers) with liveness on, stream requests, inject a fault into one rank and print the timeline: "
        "fault, detection, health false, requests failed, shutdown done. With --compare, the same fault first "
        "with the extension off (cut after --compare-bound seconds: what upstream does alone), then on, side "
        "by side. Needs the 'mpi' extra.",
    )
    demo.set_defaults(func=run_demo)

    plain = add_command(sub, "demo-processes", run_demo_processes,
                        help="the monitor alone: SIGKILL one of N plain processes")
    plain.add_argument("--workers", type=int_arg(1, 256), default=4, help="number of worker processes (default 4)")
    plain.add_argument("--rank", type=int_arg(0, 255), default=1, help="rank to kill (default 1)")
    plain.add_argument("--json", action="store_true", help="also print the result as one JSON object")


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the executor demo's own arguments to the ``demo`` parser; this imports ``demo/`` (and so
    its MPI stack), which is why :func:`~._main.main` asks for it only when ``demo`` is the command."""
    try:
        from ..demo import _demo_run as demo
    except ImportError as exc:  # mpi extra missing: the demo explains at run time
        parser.set_defaults(demo_import_error=str(exc))
        return
    demo.add_arguments(parser)


def run_demo(args: argparse.Namespace) -> int:
    """Run ``demo``: the reference MPI executor with a fault; returns the exit status."""
    error = getattr(args, "demo_import_error", None)
    if error is not None:
        return error_status(f"demo needs the 'mpi' extra (pip install 'trtllm-liveness[mpi]'): {error}")

    from ..demo import _demo_run as demo

    return demo.run(args)


def run_demo_processes(args: argparse.Namespace) -> int:
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
