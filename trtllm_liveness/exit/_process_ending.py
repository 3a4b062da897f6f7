"""ProcessEnding: the one owner of what happens when this process ends after a fatal failure.

One per process, reached through :func:`process_ending`. It holds, in one place, what the exit
guard, the outcome record, the termination log and the host's quarantine share:

- the exit decision: the exit guards triggered, in order (the first armed one decides the
  status; a non-restartable failure seen by any of them makes it that guard's unrestartable
  status), and the one SIGINT of the process (:meth:`ProcessEnding.claim_sigint`);
- the outcome record's process-wide part (:class:`OutcomeLedger`, used by :mod:`._outcome`);
- the termination message's claim: one message per process, the first fatal error's;
- the quarantine's ledger (:class:`QuarantineLedger`, used by the quarantine's host policy);
- the threads that must finish before the process ends (the outcome and termination-log writes,
  the quarantine's marker and actions), each with its own deadline (:class:`OwnedThreads`);
- a registry of cleanups, each run once, by stage.

Data flow::

    guard watchdog expired --+
    interpreter exit, a guard triggered (the atexit hook) --+--> end(ender): the first caller runs,
                                                               the others wait for it (bounded)
        STOP      stop what outlives the process (each engine's ranks; a rank left unkillable
                  quarantines the host: one more owned thread, and an unrestartable status)
        CLEANUP   add_exit_cleanup's cleanups, in registration order
        await     every owned thread until its deadline (read again: STOP may have started one)
        status    the deciding guard's (unrestartable where any guard saw such a failure)
        flush     stdout, stderr, logging.shutdown(); then the ender's exit_fn(status)

    interpreter exit, no guard triggered (the atexit hook) -->
        NORMAL_EXIT   the outcome's "clean" record, where one is kept
        await         every owned thread until its deadline

The atexit hook is registered once, when the process's owner is made (the first guard built, the
first engine started, the first failure recorded): hooks registered after it (the executor's own
``shutdown()``) run before it, each once. Thread-safe throughout.
"""

from __future__ import annotations

import atexit
import contextlib
import enum
import logging
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from ._snapshot_record import FatalSnapshot

logger = logging.getLogger(__name__)


class EndingGuard(Protocol):
    """What the ending reads of an exit guard (:class:`~._exit_guard.FatalExitGuard`, which imports
    this module)."""

    @property
    def disarmed(self) -> bool: ...

    @property
    def unrestartable(self) -> bool: ...

    @property
    def exit_fn(self) -> Callable[[int], object]: ...

    def status(self, unrestartable: bool) -> int: ...

__all__ = ["WRITE_BOUND_S", "OutcomeLedger", "OwnedThreads", "ProcessEnding", "QuarantineLedger", "Stage",
           "process_ending"]

WRITE_BOUND_S = 2.0
"""How long the process's ending waits for a record's write from its thread (the outcome file, the
termination message: one small local file, one ``write``)."""

SECOND_ENDER_WAIT_S = 30.0
"""How long a second thread ending the process (a watchdog while the interpreter's exit runs the
cleanups) waits for the first before it ends the process itself: a hung cleanup never keeps the
process alive past the watchdog's bound by more than this."""


class Stage(enum.IntEnum):
    """When a registered cleanup runs; see the module docstring."""

    STOP = 1
    """First, when a guard ends the process: stop what would outlive it (the engine's ranks)."""
    CLEANUP = 2
    """When a guard ends the process, after STOP: :func:`~._exit_guard.add_exit_cleanup`'s."""
    NORMAL_EXIT = 3
    """At an interpreter exit no guard decided (a clean end): records such as the outcome's."""


class OwnedThreads:
    """Named daemon threads, each with a deadline, joined by their owner. Thread-safe.

    :meth:`start` starts one (None when no thread can be started: interpreter shutdown, thread
    limit); :meth:`join` waits for each until its own deadline and returns the names of those still
    alive (a thread blocked in the kernel or on a dead peer is left, never waited for longer).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._threads: list[tuple[threading.Thread, float]] = []

    def start(self, target: Callable[..., object], *, name: str, bound_s: float,
              args: tuple[object, ...] = ()) -> threading.Thread | None:
        """Start ``target(*args)`` in a daemon thread called ``name`` that should end within
        ``bound_s`` seconds (its deadline for :meth:`join`). Never blocks."""
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        deadline = time.monotonic() + bound_s
        try:
            thread.start()
        except RuntimeError as exc:
            logger.warning("could not start thread %s: %s", name, exc)
            return None
        with self._lock:
            self._threads = [(t, d) for t, d in self._threads if t.is_alive()]
            self._threads.append((thread, deadline))
        return thread

    def join(self) -> list[str]:
        """Join every thread started so far (also those started meanwhile) until its deadline;
        returns the names of those still alive. Blocks at most until the latest deadline."""
        me = threading.current_thread()
        joined: set[threading.Thread] = set()
        while True:
            with self._lock:
                pending = [(t, d) for t, d in self._threads if t not in joined and t is not me]
            if not pending:
                break
            for thread, deadline in pending:
                thread.join(max(0.0, deadline - time.monotonic()))
                joined.add(thread)
        with self._lock:
            left = [t.name for t, _ in self._threads if t.is_alive() and t is not me]
            self._threads = [(t, d) for t, d in self._threads if t.is_alive()]
        return left


@dataclass(eq=False)
class OutcomeLedger:
    """The outcome record's process-wide part (:mod:`._outcome`). ``lock`` guards the file and is held
    while it is written (``running``, ``clean_at_exit``); ``record_lock`` guards the failure, its
    snapshot and the pipe, and is never held across a file's I/O, so the fatal path never waits on
    a file system. Where both are taken, ``lock`` first."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    record_lock: threading.Lock = field(default_factory=threading.Lock)
    failed: bool = False  # this process recorded a failure: sticky
    running: int = 0  # engines started and not yet shut down healthy
    clean_at_exit: bool = False  # the NORMAL_EXIT cleanup that records "clean" is registered
    failure: dict[str, object] = field(default_factory=dict)  # the failure record written (its fields)
    snapshot: FatalSnapshot | None = None  # the failure's snapshot, added once, kept for a rewrite of the record
    pipe_fd: int | None = None  # the outcome pipe's write end: None until an engine starts, -1 for none
    pipe_identity: tuple[int | None, int | None] = (None, None)  # this process's start time, PID namespace
    unrestartable_sent: bool = False  # the failure's turn to unrestartable was written to the pipe: once


@dataclass(eq=False)
class QuarantineLedger:
    """What this process recorded in the host's quarantine marker; ``lock`` guards it."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    recorded: set[tuple[int, int | None]] = field(default_factory=set)  # (pid, start time)
    actions_started: bool = False


class ProcessEnding:
    """The process's ending: see the module docstring. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._guards: list[EndingGuard] = []  # triggered, in order
        self._sigint_sent = False
        self._termination_first = ""
        self._termination_writes = 0  # 0: no termination message claimed yet
        self.termination_lock = threading.Lock()
        """Held around each termination-message write (the first, then its amendment)."""
        self.termination_written = 0
        """The sequence number of the last termination-message write made (under that lock)."""
        self._cleanups: dict[Stage, list[Callable[[], None]]] = {stage: [] for stage in Stage}
        self._ran: set[Stage] = set()
        self._ending = False
        self._ended = threading.Event()
        self.threads = OwnedThreads()
        """The threads that must finish before the process ends (awaited by every ending)."""
        self.outcome = OutcomeLedger()
        self.quarantine = QuarantineLedger()

    # ------------------------------------------------------------------ the exit decision

    def guard_triggered(self, guard: EndingGuard) -> None:
        """``guard`` saw its first fatal event: it takes part in the decision, in this order."""
        with self._lock:
            if guard not in self._guards:
                self._guards.append(guard)

    def deciding_guard(self) -> EndingGuard | None:
        """The first guard triggered and not disarmed, or None."""
        with self._lock:
            return next((guard for guard in self._guards if not guard.disarmed), None)

    def claim_sigint(self) -> bool:
        """True for the first caller of the process: it sends the one graceful SIGINT."""
        with self._lock:
            if self._sigint_sent:
                return False
            self._sigint_sent = True
            return True

    def claim_termination(self, message: str, *, amend: bool = False) -> int:
        """A termination-message write's sequence number, 0 for none: 1 for the first caller of the
        process, whose fatal error (``message``) is the termination message; for an amendment
        (``amend``), the next one where ``message`` extends that message (the same fatal error,
        with what was learnt since: its snapshot)."""
        with self._lock:
            first = self._termination_first
            claimed = bool(first) and message.startswith(first.rstrip("\n")) if amend else not self._termination_writes
            if not claimed:
                return 0
            self._termination_first = first if amend else message
            self._termination_writes += 1
            return self._termination_writes

    # ------------------------------------------------------------------ cleanups

    def add_cleanup(self, cleanup: Callable[[], None], stage: Stage = Stage.CLEANUP) -> None:
        """Run ``cleanup`` once at the ending (see :class:`Stage` for when), after those of its
        stage registered before it. The same callable is registered once per stage; one
        registered after its stage ran is not run (logged at debug level)."""
        with self._lock:
            if stage in self._ran:
                logger.debug("cleanup %r registered after its stage %s ran: not run", cleanup, stage.name)
            elif not any(known is cleanup for known in self._cleanups[stage]):
                self._cleanups[stage].append(cleanup)

    def discard_cleanup(self, cleanup: Callable[[], None], stage: Stage = Stage.CLEANUP) -> None:
        """Forget ``cleanup`` (an engine that shut down has nothing left to stop)."""
        with self._lock:
            self._cleanups[stage] = [known for known in self._cleanups[stage] if known is not cleanup]

    def _run_stage(self, stage: Stage) -> None:
        with self._lock:
            if stage in self._ran:
                return
            self._ran.add(stage)
            cleanups, self._cleanups[stage] = self._cleanups[stage], []
        for cleanup in cleanups:
            _run(cleanup)

    # ------------------------------------------------------------------ the ending

    def end(self, ender: EndingGuard) -> None:
        """End the process (the data flow of the module docstring); ``ender`` is the guard whose
        watchdog expired or the deciding guard at the interpreter's exit. The first call runs the
        stages and calls ``ender.exit_fn``; a later or concurrent call waits for it (at most
        :data:`SECOND_ENDER_WAIT_S`) and returns, or, if it has not finished by then, ends the
        process itself with the status as it stands."""
        with self._lock:
            first = not self._ending
            self._ending = True
        if not first:
            if self._ended.wait(SECOND_ENDER_WAIT_S):
                return
            logger.critical("the process's ending has not finished within %.0fs; ending the process now",
                            SECOND_ENDER_WAIT_S)
            _flush_streams()
            ender.exit_fn(self._status(ender))
            return
        try:
            self._run_stage(Stage.STOP)
            self._run_stage(Stage.CLEANUP)
            left = self.threads.join()
            if left:
                logger.warning("ending the process with threads still running past their bound: %s", ", ".join(left))
        except BaseException:  # a second Ctrl-C, a SystemExit: the status below must still be the exit's
            logger.exception("the process's ending was interrupted; ending the process now")
        status = self._status(ender)
        _flush_streams()
        with contextlib.suppress(Exception):
            logging.shutdown()
        try:
            ender.exit_fn(status)
        finally:
            self._ended.set()

    def _status(self, ender: EndingGuard) -> int:
        deciding = self.deciding_guard() or ender
        with self._lock:
            # A non-restartable failure seen by any guard of this process (the engine's, a Dynamo
            # bridge's) makes the deciding guard's status its unrestartable one.
            unrestartable = any(guard.unrestartable for guard in (*self._guards, ender) if not guard.disarmed)
        return deciding.status(unrestartable)

    def at_exit(self) -> None:
        """The interpreter's exit (the atexit hook): the deciding guard's ending where a guard was
        triggered (the main program returned after a fatal event, or one came while the later
        hooks ran); otherwise the NORMAL_EXIT cleanups and the owned threads, bounded."""
        guard = self.deciding_guard()
        if guard is not None:
            self.end(guard)
            return
        self._run_stage(Stage.NORMAL_EXIT)
        left = self.threads.join()
        if left:
            logger.warning("exiting with threads still running past their bound: %s", ", ".join(left))


def _run(cleanup: Callable[[], None]) -> None:
    # BaseException: a cleanup interrupted (KeyboardInterrupt) or exiting (SystemExit) must not skip
    # the later cleanups nor the exit status.
    try:
        cleanup()
    except BaseException:
        logger.exception("exit cleanup %r raised", cleanup)


def _flush_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed stream must not keep the process from exiting
            pass


_OWNER_LOCK = threading.Lock()
_owner: ProcessEnding | None = None


def process_ending() -> ProcessEnding:
    """This process's :class:`ProcessEnding`, made (and its atexit hook registered) on first use."""
    global _owner
    with _OWNER_LOCK:
        if _owner is None:
            _owner = ProcessEnding()
            atexit.register(_owner.at_exit)
        return _owner
