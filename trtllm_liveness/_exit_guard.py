"""FatalExitGuard: after an engine death, shut down gracefully once, then exit non-zero, bounded.

Serving processes must not outlive a dead engine. ``trtllm-serve``'s ``/health`` raises SIGINT only
while ``doing_shutdown`` is False, which is never the case after a killed rank (the executor's
``pre_shutdown()`` already set it; TensorRT-LLM issue #18663), so the server answers 503 forever and
the orchestrator never restarts it. Dynamo's older monitor exited with status 0 in some paths. This
guard closes both holes: the first fatal event starts the graceful shutdown exactly once, a
watchdog ends the process with a non-zero status if that has not finished within ``timeout_s``,
and an ``atexit`` hook turns a clean interpreter exit into the same non-zero status.
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
    os.kill(os.getpid(), signal.SIGINT)
    return True


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

    def _force_exit_status(self) -> None:
        # Runs at normal interpreter exit: the main program returned (status 0) after a fatal
        # event. The orchestrator must see a failure, or it will not restart the worker.
        if not self._disarmed:
            self._end()

    def _end(self) -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # a closed stream must not keep us from exiting
                pass
        logging.shutdown()
        self._exit_fn(self._exit_code)
