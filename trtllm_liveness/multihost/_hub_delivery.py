"""RemoteDelivery: the hub's remote ranks' updates handed to the engine's monitor off the hub's thread.

The monitor calls its subscribers in the thread that applies an update, and a subscriber acts on a
failure: it may ask the hub for every host's snapshot or stop (:meth:`~._hub.AgentHub.snapshot`,
:meth:`~._hub.AgentHub.stop_hosts`), which only the hub's thread can answer. So the hub never
applies an update itself: it queues it here, under its own lock and in its order, and this
class's one thread applies each, in that order, with no lock of the hub held. The hub keeps
reading replies meanwhile, and a subscriber's question returns within its own bound.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Sequence
from typing import Any

from .._events import MonitorMethod, WorkerState
from ..monitor._monitor import WorkerProcessMonitor
from ..process._identity import ProcessIdentity

logger = logging.getLogger(__name__)

__all__ = ["RemoteDelivery"]

Updates = Sequence[tuple[ProcessIdentity, WorkerState, str]]


class RemoteDelivery:
    """One thread applying queued remote updates to ``monitor`` in order (started at the first)."""

    def __init__(self, monitor: WorkerProcessMonitor) -> None:
        self._monitor = monitor
        self._cond = threading.Condition()
        self._queue: collections.deque[tuple[Updates, dict[str, Any]]] = collections.deque()
        self._closing = False
        self._busy = False  # an update is being applied (taken off the queue)
        self._thread: threading.Thread | None = None

    def put(self, updates: Updates, **extra: Any) -> None:
        """Queue ``updates`` (with ``apply_remote_many``'s keyword ``extra``); never blocks on the
        monitor or a subscriber. Updates put after :meth:`close` are applied in the caller's thread."""
        with self._cond:
            if not self._closing:
                self._queue.append((list(updates), extra))
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="trtllm-liveness-hub-delivery",
                                                    daemon=True)
                    self._thread.start()
                self._cond.notify_all()
                return
        self._apply(list(updates), extra)

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until everything queued so far was applied (or ``timeout_s``); True if it was. In
        the delivery's own thread (a subscriber asking) at once: what it applies now comes later."""
        if self._thread is threading.current_thread():
            return False
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._busy, timeout_s)

    def close(self, timeout_s: float) -> None:
        """Apply what is queued, then end the thread: joined within ``timeout_s`` (a subscriber still
        busy then is left to finish in it, named in one WARNING). Idempotent."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            thread = self._thread
        if thread is None or thread is threading.current_thread():
            return
        thread.join(timeout_s)
        if thread.is_alive():
            logger.warning("liveness: agent hub: a subscriber still handles a remote rank's update %.1f s after the "
                           "hub closed; leaving it to finish", timeout_s)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._busy = False
                self._cond.notify_all()
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue:
                    return
                updates, extra = self._queue.popleft()
                self._busy = True
            self._apply(updates, extra)

    def _apply(self, updates: Updates, extra: dict[str, Any]) -> None:
        try:
            self._monitor.apply_remote_many(updates, via=MonitorMethod.AGENT, **extra)
        except Exception:
            logger.exception("liveness: agent hub: applying a remote rank's update failed")
