"""RemoteDelivery: remote ranks' events handed to the monitor's subscribers off the hub's thread.

The hub applies what the agents report to the engine's monitor at once, under its lock, so the
monitor's states and its failure are never behind the hub (a health check or a shutdown reads them
right after), but without calling a subscriber there
(``apply_remote_many(..., deliver=False)``). A subscriber acts on a failure and may ask the hub for
every host's snapshot or stop (:meth:`~._hub.AgentHub.snapshot`, :meth:`~._hub.AgentHub.stop_hosts`),
which only the hub's thread can answer; so this class's one thread calls them
(:meth:`~trtllm_liveness.monitor.WorkerProcessMonitor.deliver`) once the hub says there may be something to
deliver. The monitor's event log keeps its promise whoever delivers: every event once, in order,
never two calls at a time; a thread that calls ``check()`` or ``flush()`` meanwhile delivers too.
"""

from __future__ import annotations

import logging
import threading

from ..monitor._monitor import WorkerProcessMonitor

logger = logging.getLogger(__name__)

__all__ = ["RemoteDelivery"]

_IDLE_WAIT_S = 5.0  # the longest single wait of the idle thread (it rechecks, then waits again)


class RemoteDelivery:
    """One thread delivering the monitor's events each time :meth:`poke` is called."""

    def __init__(self, monitor: WorkerProcessMonitor) -> None:
        self._monitor = monitor
        self._cond = threading.Condition()
        self._due = False
        self._closing = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the thread (raises where no thread can start: the hub then does not start)."""
        thread = threading.Thread(target=self._run, name="trtllm-liveness-hub-delivery", daemon=True)
        thread.start()
        self._thread = thread

    def poke(self) -> None:
        """There may be events to deliver; never blocks on the monitor or a subscriber. After
        :meth:`close`, a no-op: the next ``check()`` or ``flush()`` of the engine delivers them."""
        with self._cond:
            self._due = True
            self._cond.notify_all()

    def close(self, timeout_s: float) -> None:
        """Deliver what is due, then end the thread, joined within ``timeout_s`` (a subscriber still
        busy then finishes in it, named in one WARNING). Idempotent."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            return
        thread.join(timeout_s)
        if thread.is_alive():
            logger.warning("liveness: agent hub: a subscriber of the monitor was still handling a remote rank's "
                           "event when the hub closed; it finishes in its own thread")

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._due and not self._closing:
                    self._cond.wait(_IDLE_WAIT_S)  # bounded; poke() and close() notify at once
                due, self._due = self._due, False
                closing = self._closing
            if due:
                try:
                    self._monitor.deliver()
                except Exception:
                    logger.exception("liveness: agent hub: delivering a remote rank's event failed")
            if closing:
                return
