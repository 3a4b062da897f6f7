"""FatalExitGuard: after an engine death, shut down gracefully once, then exit non-zero, bounded.

Serving processes must not outlive a dead engine. ``trtllm-serve``'s ``/health`` raises SIGINT only
while ``doing_shutdown`` is False, which is never the case after a killed rank (the executor's
``pre_shutdown()`` already set it; TensorRT-LLM issue #18663), so the server answers 503 forever and
the orchestrator never restarts it. Dynamo's older monitor exited with status 0 in some paths. This
guard closes both holes: the first fatal event starts the graceful shutdown exactly once, a
watchdog ends the process with a non-zero status if that has not finished within ``timeout_s``,
and an ``atexit`` hook turns a clean interpreter exit into the same non-zero status.

Python offers no way to change the exit status of a normal interpreter exit except ending the
process from inside it (``os._exit``), which skips every ``atexit`` hook not yet run: the
executor's ``shutdown()``, MPI session-directory removal, metrics flushes. So the hook first runs
the others itself (once each, in their usual order) and only then ends the process, bounded by the
watchdog.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)


# Bound on running the other atexit hooks when the watchdog is off (timeout_s=None): a hook blocked
# on a dead peer (an upstream shutdown() sending to a killed rank) must not keep the process alive.
ATEXIT_HOOKS_BOUND_S = 10.0

_SIGINT_LOCK = threading.Lock()
_sigint_sent = False


def interrupt_self_once() -> bool:
    """Send SIGINT to this process unless a guard of this process already did; True if sent now.

    Process-wide: several engines (each with its guard) in one process start ONE graceful
    shutdown. SIGINT is what uvicorn/trtllm-serve and most asyncio servers treat as "shut down
    gracefully"; a second one makes uvicorn skip its graceful shutdown ("force exit"). Never blocks.
    """
    global _sigint_sent
    with _SIGINT_LOCK:
        if _sigint_sent:
            return False
        _sigint_sent = True
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
    # /proc/<pid>/status is the thread group leader's, i.e. the main thread's signal mask.
    try:
        with open(f"/proc/{os.getpid()}/status") as status:
            for line in status:
                if line.startswith("SigBlk:"):
                    return bool(int(line.split()[1], 16) & (1 << (signal.SIGINT - 1)))
    except (OSError, ValueError, IndexError):
        pass
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
        exit_fn: how to end the process (``os._exit``); replaceable for tests.

    Raises ``ValueError`` for ``exit_code`` 0 or a negative ``timeout_s``. Thread-safe;
    :meth:`trigger` may be called from any thread, any number of times, and never blocks.
    """

    def __init__(
        self,
        *,
        graceful: Callable[[], None] | None = None,
        timeout_s: float | None = 30.0,
        exit_code: int = 1,
        exit_fn: Callable[[int], object] = os._exit,
    ) -> None:
        if exit_code == 0:
            raise ValueError("exit_code must be non-zero: an engine death is a failure")
        if timeout_s is not None and timeout_s < 0:
            raise ValueError("timeout_s must be >= 0 or None")
        self._graceful = graceful or _interrupt_self
        self._timeout_s = timeout_s
        self._exit_code = exit_code
        self._exit_fn = exit_fn
        self._lock = threading.Lock()
        self._reason: object = None
        self._triggered = threading.Event()
        self._disarmed = False

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
        """The status the process will exit with after a fatal event."""
        return self._exit_code

    def trigger(self, reason: object) -> bool:
        """Start the graceful shutdown and arm the watchdog; True only for the first call.

        Returns at once: the graceful action and the watchdog run in daemon threads.
        """
        with self._lock:
            if self._triggered.is_set() or self._disarmed:
                return False
            self._reason = reason
            self._triggered.set()
        # Log the event's own one-line message (rank, pid, host, cause): this line may be the last
        # the process writes, since the exit can overtake the monitor's own log line.
        logger.critical(
            "fatal engine error: %s; shutting down, exit status %d", getattr(reason, "message", reason), self._exit_code
        )
        atexit.register(self._force_exit_status)
        self._keep_exit_hook_first()
        threading.Thread(target=self._run_graceful, name="trtllm-liveness-graceful", daemon=True).start()
        if self._timeout_s is not None:
            timer = threading.Timer(self._timeout_s, self._watchdog_expired)
            timer.name = "trtllm-liveness-exit-watchdog"
            timer.daemon = True
            timer.start()
        return True

    def disarm(self) -> None:
        """Never act again (for owners that handle the exit themselves)."""
        with self._lock:
            self._disarmed = True

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
            self._timeout_s, self._exit_code,
        )
        self._end()

    def _keep_exit_hook_first(self) -> None:
        # atexit runs hooks last-registered first. Ours must run before every other one, or the
        # hooks that ran before it would run again when it runs the rest: threading's exit hooks
        # run just before atexit's (after the main program returned), so move ours to the top then.
        register = getattr(threading, "_register_atexit", None)
        if register is None:
            return
        try:
            register(self._move_exit_hook_to_top)
        except RuntimeError:  # threading's shutdown has begun: the hook registered just now is on top
            pass

    def _move_exit_hook_to_top(self) -> None:
        atexit.unregister(self._force_exit_status)
        atexit.register(self._force_exit_status)

    def _force_exit_status(self) -> None:
        # Runs at normal interpreter exit: the main program returned (status 0) after a fatal
        # event. The orchestrator must see a failure, or it will not restart the worker.
        if self._disarmed:
            return
        atexit.unregister(self._force_exit_status)
        if self._timeout_s is None:
            timer = threading.Timer(ATEXIT_HOOKS_BOUND_S, self._atexit_hooks_expired)
            timer.name = "trtllm-liveness-atexit-watchdog"
            timer.daemon = True
            timer.start()
        self._run_other_exit_hooks()
        self._end()

    @staticmethod
    def _run_other_exit_hooks() -> None:
        # CPython's own runner: each remaining hook once, last-registered first, an exception in
        # one printed and the rest still run; it clears the registry, so none runs twice.
        run = getattr(atexit, "_run_exitfuncs", None)
        if run is None:  # another interpreter: ending at once is still better than status 0
            logger.warning("cannot run the other atexit hooks on this interpreter; they are skipped")
            return
        run()

    def _atexit_hooks_expired(self) -> None:
        logger.critical(
            "atexit hooks did not finish within %.1fs after the fatal error; exiting with status %d",
            ATEXIT_HOOKS_BOUND_S, self._exit_code,
        )
        self._end()

    def _end(self) -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # a closed stream must not keep us from exiting
                pass
        logging.shutdown()
        self._exit_fn(self._exit_code)
