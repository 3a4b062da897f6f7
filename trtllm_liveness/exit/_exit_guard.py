"""FatalExitGuard: after an engine death, shut down gracefully once, then exit non-zero, bounded.

Serving processes must not outlive a dead engine. ``trtllm-serve`` after a killed rank answers 503
forever and is never restarted (docs/upstream-contract.md "trtllm-serve ``/health``", TensorRT-LLM
issue #18663); Dynamo's older monitor exited with status 0 in some paths. This guard closes both
holes: the first fatal event starts the graceful shutdown exactly once, a watchdog ends the
process with a non-zero status if that has not finished within ``timeout_s``, and an ``atexit``
hook turns a clean interpreter exit into the same non-zero status.

Python offers no way to change the exit status of a normal interpreter exit except ending the
process from inside it (``os._exit``), which skips every ``atexit`` hook not yet run. That hook
belongs to the process's one :class:`~._process_ending.ProcessEnding` and is registered once, when
it is made (at the latest when the first guard is *built*, at engine start, before the executor
registers its own ``shutdown()`` hook): hooks registered after that (the executor's ``shutdown()``,
anything registered at or after the fatal event) run first, each once, in their usual order, and a
fatal event that arrives while they run is still seen. Hooks registered before it run after it and
are skipped; cleanup that must happen anyway is registered with :func:`add_exit_cleanup` and run
once, just before the end. The first guard triggered in a process decides the exit status (several
engines, a Dynamo bridge); the ending itself (stop, cleanups, the threads it awaits, the status) is
:meth:`~._process_ending.ProcessEnding.end`'s.

A failure that is not restartable on this host (a worker wedged in ``D`` or unkillable, whose
event or error says ``restartable`` False) makes the status ``exit_code_unrestartable`` instead,
also when it comes after the first fatal event (:meth:`FatalExitGuard.mark_unrestartable`): a
Kubernetes Job's ``podFailurePolicy`` or a supervisor can then tell "restart elsewhere" from
"restart". A Deployment restarts whatever the status; the host's quarantine marker covers that.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable

from ..process import _procfs
from ._process_ending import ProcessEnding, Stage, process_ending

logger = logging.getLogger(__name__)


DEFAULT_EXIT_CODE_UNRESTARTABLE = 69
"""sysexits' ``EX_UNAVAILABLE``: distinct from 1 (any failure), 2 (usage), 14 (Open MPI's abort),
126-127 (the shell's) and 128+N (death by signal N), so "not restartable here" reads unambiguously."""


def add_exit_cleanup(cleanup: Callable[[], None]) -> None:
    """Run ``cleanup`` once, just before a guard ends the process (``os._exit`` skips the
    ``atexit`` hooks registered before the process's ending was set up). It must be quick.
    Exceptions are logged."""
    process_ending().add_cleanup(cleanup, Stage.CLEANUP)


def interrupt_self_once() -> bool:
    """Send SIGINT to this process unless a guard of this process already did; True if sent now.

    Process-wide: several engines (each with its guard) in one process start ONE graceful
    shutdown. SIGINT is what uvicorn/trtllm-serve and most asyncio servers treat as "shut down
    gracefully"; a second one makes uvicorn skip its graceful shutdown ("force exit"). Never blocks.
    """
    if not process_ending().claim_sigint():
        return False
    _send_sigint_to_main_thread()
    return True


def _send_sigint_to_main_thread() -> None:
    # Python runs signal handlers in the main thread only. POSIX lets a process-directed SIGINT
    # (os.kill) be taken by any thread that does not block it (Linux prefers the main thread, but
    # not when that one already has a signal pending); taken by another thread, it does not
    # interrupt a main thread asleep in a blocking wait (an Event, a lock, a join, a future's
    # result), whose handler then runs only when the wait ends by itself, perhaps after the
    # watchdog. Directed at the main thread, the signal ends such a wait (EINTR) at once.
    # Servers that wait in a selector with a wakeup fd (asyncio, uvicorn) are woken either way.
    # Exception: a main thread that blocks SIGINT (signals left to a sigwait() thread) gets the
    # process-directed signal, which the kernel then hands to a thread that takes it.
    main = threading.main_thread()
    pthread_kill = getattr(signal, "pthread_kill", None)
    if pthread_kill is not None and main.ident is not None and main.is_alive() and not _main_blocks_sigint():
        try:
            pthread_kill(main.ident, signal.SIGINT)
            return
        except OSError:  # the main thread is gone (only daemon threads left): any thread will do
            pass
    os.kill(os.getpid(), signal.SIGINT)


def _main_blocks_sigint() -> bool:
    # /proc/self/status is the thread group leader's, i.e. the main thread's signal mask (and,
    # unlike /proc/<getpid()>, right also where /proc belongs to another PID namespace).
    try:
        return bool(_procfs.read_status("self").blocked & _procfs.signal_bit(signal.SIGINT))
    except (OSError, ValueError):
        return False


def _interrupt_self() -> None:
    if not interrupt_self_once():
        logger.info("graceful shutdown already requested by another exit guard of this process")


class FatalExitGuard:
    """Turn the first fatal event into one graceful shutdown and a bounded, non-zero exit.

    Args:
        graceful: called once, in a daemon thread, to start the graceful shutdown (default:
            send SIGINT to this process, as ``trtllm-serve``'s ``/health`` intends to).
        timeout_s: seconds after the trigger at which the process is ended with ``exit_code``
            if it is still running; ``None`` disables the watchdog (the atexit hook stays).
        exit_code: the status the process exits with after a fatal event; must be non-zero.
        exit_code_unrestartable: the status instead when a non-restartable failure was seen
            (``reason.restartable`` False, or :meth:`mark_unrestartable`); None: ``exit_code``.
        exit_fn: how to end the process (``os._exit``); replaceable for tests.

    Raises ``ValueError`` for an exit code 0 or a negative ``timeout_s``. Thread-safe;
    :meth:`trigger` may be called from any thread, any number of times, and never blocks.
    """

    def __init__(
        self,
        *,
        graceful: Callable[[], None] | None = None,
        timeout_s: float | None = 30.0,
        exit_code: int = 1,
        exit_code_unrestartable: int | None = None,
        exit_fn: Callable[[int], object] = os._exit,
    ) -> None:
        if exit_code == 0 or exit_code_unrestartable == 0:
            raise ValueError("exit_code must be non-zero: an engine death is a failure")
        if timeout_s is not None and timeout_s < 0:
            raise ValueError("timeout_s must be >= 0 or None")
        self._graceful = graceful or _interrupt_self
        self._timeout_s = timeout_s
        self._base_exit_code = exit_code
        self._unrestartable_code = exit_code if exit_code_unrestartable is None else exit_code_unrestartable
        self._unrestartable = False
        self._exit_fn = exit_fn
        self._lock = threading.Lock()
        self._reason: object = None
        self._triggered = threading.Event()
        self._disarmed = False
        self._watchdog: threading.Timer | None = None
        # Made now at the latest (engine start): its atexit hook then runs after the executor's.
        self._ending: ProcessEnding = process_ending()

    @property
    def triggered(self) -> bool:
        """Whether a fatal event has been seen."""
        return self._triggered.is_set()

    @property
    def reason(self) -> object:
        """What triggered the guard (usually a :class:`~trtllm_liveness.WorkerEvent`)."""
        return self._reason

    @property
    def exit_code(self) -> int:
        """The status the process will exit with after a fatal event (``exit_code_unrestartable``
        once a non-restartable failure was seen)."""
        return self._unrestartable_code if self._unrestartable else self._base_exit_code

    @property
    def unrestartable(self) -> bool:
        """Whether a non-restartable failure was seen (the exit status says so)."""
        return self._unrestartable

    @property
    def disarmed(self) -> bool:
        """Whether :meth:`disarm` was called (the guard then never acts)."""
        return self._disarmed

    @property
    def exit_fn(self) -> Callable[[int], object]:
        """How this guard ends the process (``os._exit`` unless replaced)."""
        return self._exit_fn

    def status(self, unrestartable: bool) -> int:
        """The status this guard exits with, for a process that saw a non-restartable failure or not."""
        return self._unrestartable_code if unrestartable else self._base_exit_code

    def mark_unrestartable(self) -> None:
        """A non-restartable failure was seen (also after the first trigger, say a rank left
        unkillable by the bounded stop after a death): exit with ``exit_code_unrestartable``.
        Never blocks; does not trigger the guard."""
        self._unrestartable = True

    def trigger(self, reason: object) -> bool:
        """Start the graceful shutdown and arm the watchdog; True only for the first call.

        Returns at once: the graceful action and the watchdog run in daemon threads.
        """
        with self._lock:
            if getattr(reason, "restartable", True) is False and not self._disarmed:
                # Also for a later event (a wedge after a death): the status must say so.
                self._unrestartable = True
            if self._triggered.is_set() or self._disarmed:
                return False
            self._reason = reason
            self._triggered.set()
        self._ending.guard_triggered(self)
        # Log the event's own one-line message (rank, pid, host, cause): this line may be the last
        # the process writes, since the exit can overtake the monitor's own log line.
        logger.critical(
            "fatal engine error: %s; shutting down, exit status %d", getattr(reason, "message", reason), self.exit_code
        )
        try:
            threading.Thread(target=self._run_graceful, name="trtllm-liveness-graceful", daemon=True).start()
            if self._timeout_s is not None:
                self._watchdog = threading.Timer(self._timeout_s, self._watchdog_expired)
                self._watchdog.name = "trtllm-liveness-exit-watchdog"
                self._watchdog.daemon = True
                self._watchdog.start()
        except RuntimeError as exc:
            # Interpreter shutdown has begun (no new threads from then on): the final atexit hook
            # still sets the status; there is nothing left to shut down gracefully.
            logger.warning("exit guard triggered during interpreter shutdown (%s): exit status from the atexit hook",
                           exc)
        return True

    def disarm(self) -> None:
        """Never act again (for owners that handle the exit themselves); the watchdog is cancelled."""
        with self._lock:
            self._disarmed = True
            watchdog = self._watchdog
        if watchdog is not None:
            watchdog.cancel()

    def _run_graceful(self) -> None:
        try:
            self._graceful()
        except Exception:
            logger.exception("graceful shutdown after a fatal error raised; the watchdog will end the process")

    def _watchdog_expired(self) -> None:
        if self._disarmed:
            return
        logger.critical(
            "graceful shutdown did not finish within %.1fs after the fatal error; exiting with status %d",
            self._timeout_s, self.exit_code,
        )
        # The process's ending: stop, cleanups, awaited threads, then the status the first guard
        # triggered in this process decides (see ProcessEnding.end).
        self._ending.end(self)
