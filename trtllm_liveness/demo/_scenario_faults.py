"""The faults a scenario injects into a rank from outside, and the kernel's floor on a kill.

The harness side of the faults listed in :mod:`._scenario_child`: a signal through a pidfd opened
and verified against the victim's start time (``kill``, ``segv``, ``stop``), the cgroup v1 freezer
(``wedge``), or a trigger file that the victim rank's own fault hook waits for (``exit0``, ``oom``,
``fuse``: see ``_executor_worker``). For the signals that end a process, :class:`PidfdFloor` times
the same kill on a bare pidfd in a process of its own. :func:`kill_watcher` makes the liveness
monitor's watcher thread die first (the ``watcher_fault`` option). Every wait is bounded.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from ..process import _pidfd
from ..process._identity import ProcessIdentity
from ..stop._bounded_stop import stop_processes
from ._cgroup_faults import FreezerGroup
from ._executor_worker import read_announced_identities
from ._scenario_endings import emit
from ._scenario_executor import bounded
from ._scenario_records import ResultInProgress, ScenarioOptions, Victim, WatcherFaultOutcome

__all__ = ["PidfdFloor", "alive", "announce_ranks", "inject", "kill_watcher", "settle_ranks", "victims_of"]

_SIGNALS = {"kill": signal.SIGKILL, "segv": signal.SIGSEGV, "stop": signal.SIGSTOP}


def alive(identity: ProcessIdentity) -> bool:
    """Whether the rank ``identity`` names still runs (its pid with its start time)."""
    try:
        _pidfd.verify_start_time(identity.pid, identity.start_time)
    except Exception:
        return False
    return True


def announce_ranks(opts: ScenarioOptions, announce: str, draft: ResultInProgress,
                   identities: list[ProcessIdentity]) -> None:
    """Add the identities the ranks wrote to ``announce`` to ``identities``; note their pids in
    ``draft`` and print them (the parent's progress line)."""
    identities.extend(read_announced_identities(announce, opts.workers, 10))
    draft.update(pids=tuple(identity.pid for identity in identities))
    emit({"pids": list(draft.result.pids), "iteration": draft.result.iteration})


def settle_ranks(identities: list[ProcessIdentity], draft: ResultInProgress, end: bool,
                 *cleanups: Callable[[], Any]) -> None:
    """Note the ranks still alive in ``draft`` (``survivors``). First, if ``end`` (the executor
    would wait forever, or its build or shutdown did not finish), the harness ends the ranks
    itself and runs each of ``cleanups`` bounded (:func:`~._scenario_executor.bounded`)."""
    if end:
        stop_processes(identities, grace_s=0.0, kill_s=2.0)
        for cleanup in cleanups:
            bounded(cleanup)
    draft.update(survivors=tuple(identity.pid for identity in identities if alive(identity)))


def victims_of(opts: ScenarioOptions, identities: list[ProcessIdentity],
               draft: ResultInProgress) -> list[ProcessIdentity]:
    """The identities of the ranks ``opts`` hits (``fault_ranks``, else ``fault_rank``), noted in ``draft``."""
    victims = [identities[rank] for rank in (opts.fault_ranks or (opts.fault_rank,))]
    draft.update(victims=tuple(Victim(v.rank, v.pid) for v in victims))
    return victims


# The floor's timer: a bare process blocked in poll() on the victim's pidfd (inherited), printing
# time.monotonic() (system-wide) when it turns readable. A process of its own, not a thread here:
# a thread would wait for the GIL behind the very watcher it is the baseline for (up to the 5 ms
# switch interval), and measure the scenario's scheduling instead of the kernel's.
_FLOOR_TIMER = (
    "import select, sys, time\n"
    "fd, timeout_ms = int(sys.argv[1]), int(sys.argv[2])\n"
    "poller = select.poll()\n"
    "poller.register(fd, select.POLLIN)\n"
    "print('armed', flush=True)\n"
    "ready = poller.poll(timeout_ms)\n"
    "print(repr(time.monotonic()) if ready else 'none', flush=True)\n"
)


class PidfdFloor:
    """The kernel's floor on one kill: signal -> a bare pidfd on the victim readable, timed by a
    separate process blocked in ``poll()`` on it (see ``_FLOOR_TIMER``). The pidfd is the one the
    harness opened and verified against the start time just before the signal, so it times the
    very kill the package is detecting. Every wait is bounded; :meth:`close` is idempotent."""

    def __init__(self, pidfd: int, timeout_s: float = 10.0) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-S", "-c", _FLOOR_TIMER, str(pidfd), str(int(timeout_s * 1000))],
            pass_fds=(pidfd,), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
        self.armed = self._line(5.0) == "armed"

    def _line(self, timeout: float) -> str | None:
        assert self._proc.stdout is not None
        ready, _, _ = select.select([self._proc.stdout], [], [], timeout)
        return self._proc.stdout.readline().decode().strip() if ready else None

    def elapsed_ms(self, t0: float, timeout: float = 2.0) -> float | None:
        """Signal (``t0``) -> readable in ms, waiting up to ``timeout``; None if it never became so."""
        try:
            line = self._line(timeout) if self.armed else None
            return round((float(line) - t0) * 1e3, 3) if line and line != "none" else None
        except ValueError:
            return None
        finally:
            self.close()

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
        with contextlib.suppress(Exception):
            self._proc.wait(5)
        if self._proc.stdout is not None:
            self._proc.stdout.close()


def inject(opts: ScenarioOptions, victims: list[ProcessIdentity], freezer: FreezerGroup | None,
           announce: str, timed: bool = True) -> tuple[float, PidfdFloor | None]:
    """Inject the fault; returns its time (``time.monotonic()``, system-wide) and, if ``timed``, for
    the signals that end a process, the floor timer on the first victim."""
    if opts.fault == "wedge":
        assert freezer is not None
        t0 = time.monotonic()
        freezer.freeze([v.pid for v in victims])
        return t0, None
    if opts.fault in ("exit0", "oom", "fuse"):
        # The victim rank itself does it (see _executor_worker._arm_fault) and records when.
        record = os.path.join(announce, "fault.json")
        with open(os.path.join(announce, "trigger"), "w"):
            pass
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError), open(record) as handle:
                return float(json.load(handle)["at"]), None
            time.sleep(0.001)
        raise TimeoutError("the fault-injection hook did not fire within 10 s")
    fds: list[int] = []
    try:
        for victim in victims:  # opened and verified first: never a recycled pid
            fds.append(_pidfd.open_verified_pidfd(victim.pid, victim.start_time))
        floor = PidfdFloor(fds[0]) if timed and opts.fault in ("kill", "segv") else None
        t0 = time.monotonic()
        for fd in fds:
            _pidfd.send_signal(fd, _SIGNALS[opts.fault])
        return t0, floor
    finally:
        for fd in fds:
            os.close(fd)


def kill_watcher(proxy: Any) -> WatcherFaultOutcome:
    """Make the monitor's watcher thread die (a tick raises once), as a bug or resource error would."""
    monitor = proxy.liveness_monitor if hasattr(proxy, "liveness_monitor") else proxy._liveness_monitor

    def broken_tick(*args: Any) -> None:
        del monitor._watch_handle  # raise once; the class's method is back for anyone else
        raise RuntimeError("injected watcher failure")

    monitor._watch_handle = broken_tick
    monitor._watcher.wake()
    deadline = time.monotonic() + 10
    while monitor.watcher_alive and time.monotonic() < deadline:
        time.sleep(0.005)
    return WatcherFaultOutcome(alive_at_fault=bool(monitor.watcher_alive), error=repr(monitor.watcher_error))
