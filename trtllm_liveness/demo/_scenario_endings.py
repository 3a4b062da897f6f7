"""How a scenario process ends, and how it reports what it found.

The child prints each record as one JSON line (:func:`emit`). For the endings that are the point of
a scenario (``ending``; see :mod:`._scenario_child`): :data:`SIGINTS` counts the graceful-shutdown
SIGINTs of the exit guard as a server's handler would; :func:`serve_until_sigint` waits for one
after the fault; :class:`AtExitReport` prints the record of a script that ends without
``shutdown()`` from an ``atexit`` hook that runs after upstream's. :func:`open_fds` counts the
pidfds and descriptors the process still holds (a leak check). Every wait is bounded.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

from ._scenario_executor import fatal_fields
from ._scenario_records import EndingOutcome, ResultInProgress, ScenarioOptions

__all__ = ["SIGINTS", "AtExitReport", "emit", "open_fds", "serve_until_sigint"]


def emit(record: Mapping[str, Any]) -> None:
    """Print ``record`` as one JSON line on stdout (the parent reads the lines)."""
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def open_fds(settle_s: float = 2.0) -> dict[str, Any]:
    """The pidfds and all fds this process holds, as the record's fields ``pidfds_open`` and
    ``fds_open``; waits up to ``settle_s`` for pidfds a leaving watcher thread releases on its way out."""
    deadline = time.monotonic() + settle_s
    while True:
        gc.collect()
        links = []
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                links.append(os.readlink(f"/proc/self/fd/{name}"))
        pidfds = sum(1 for link in links if link == "anon_inode:[pidfd]")
        if pidfds == 0 or time.monotonic() >= deadline:
            return {"pidfds_open": pidfds, "fds_open": len(links)}
        time.sleep(0.02)


class _Sigints:
    """Counts SIGINTs as a server's handler would (uvicorn's sets ``should_exit``), instead of
    raising KeyboardInterrupt wherever the main thread happens to be."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.received = threading.Event()

    def install(self) -> None:
        signal.signal(signal.SIGINT, self._handler)

    def _handler(self, signum: int, frame: object) -> None:
        self.times.append(time.monotonic())
        self.received.set()


SIGINTS = _Sigints()


def serve_until_sigint(opts: ScenarioOptions, draft: ResultInProgress, t0: float) -> None:
    """A server after the fault: wait (up to ``observe_s`` after it) for the graceful-shutdown
    SIGINT; the caller then shuts down, as uvicorn's return makes trtllm-serve do."""
    SIGINTS.received.wait(max(0.0, t0 + opts.observe_s - time.monotonic()))
    first = SIGINTS.times[0] if SIGINTS.times else None
    draft.update(ending=EndingOutcome(ending=opts.ending, sigints=len(SIGINTS.times),
                                      sigint_ms=None if first is None else round((first - t0) * 1e3, 3)))


class AtExitReport:
    """For ``ending="interpreter_exit"``: prints the iteration's record when the interpreter ends.

    Registered before the executor is built: ``atexit`` runs hooks last-in first-out, so this one
    sees the state after upstream's exit hooks (``threading._register_atexit`` ones run even before).
    """

    def __init__(self, opts: ScenarioOptions) -> None:
        self.opts = opts
        self.draft: ResultInProgress | None = None
        self.proxy: Any = None
        atexit.register(self.report)

    def report(self) -> None:
        if self.draft is None:
            return
        fatal = getattr(self.proxy, "_fatal_error", None)
        # The ranks may still be on their way out: the parent checks the session, so no survivors here.
        self.draft.update(**fatal_fields(self.proxy, fatal), survivors=(), **open_fds(settle_s=0.5),
                          ending=EndingOutcome(ending=self.opts.ending, sigints=len(SIGINTS.times), at_exit=True))
        emit(self.draft.result.to_dict())
        emit({"done": True})
