"""Exactly-once delivery of the monitor's events to its subscribers.

The monitor appends each fatal event once (per rank and kind) to an :class:`EventLog`. Each
subscription keeps a cursor into that log. Whoever has something to deliver (the watcher thread,
a thread in ``check()``, a thread in ``subscribe()``) claims the events past a subscription's
cursor under the log's lock and calls the subscriber outside it. A subscription being delivered
by one thread is skipped by the others: the deliverer loops until the cursor reaches the end of
the log, so an event appended meanwhile is still delivered, by that thread. Hence, for every
subscriber, every event exactly once and in log order, never two calls at the same time, and no
subscriber ever called under a lock; a subscriber that arrives late gets the whole log at once
(no failure is lost, vLLM's ``register_failure_callback`` rule).

:meth:`EventLog.flush` is how a thread that must act on the delivery's result (a health check,
a shutdown deciding whether the stop is clean) makes sure a subscriber has been given every event
recorded so far: it delivers what nobody delivers, and waits, bounded, for a delivery another
thread is making, without ever calling the subscriber a second time or beside that thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from .._events import WorkerEvent

logger = logging.getLogger(__name__)

Subscriber = Callable[[WorkerEvent], None]


@dataclass(eq=False)
class _Subscription:
    callback: Subscriber
    cursor: int = 0
    delivering: bool = False
    deliverer: int | None = None  # the thread delivering it, while one is
    active: bool = True


class EventLog:
    """The fatal events so far, in order, and who has been given which. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._delivered = threading.Condition(self._lock)  # notified when a delivery ends
        self._events: list[WorkerEvent] = []
        self._subscriptions: list[_Subscription] = []

    def append(self, events: list[WorkerEvent]) -> None:
        """Record new events (call :meth:`deliver` afterwards, outside any lock of the caller)."""
        if events:
            with self._lock:
                self._events.extend(events)

    @property
    def events(self) -> list[WorkerEvent]:
        with self._lock:
            return list(self._events)

    def subscribe(self, callback: Subscriber) -> None:
        """Add a subscriber and give it, in this thread, every event recorded so far."""
        subscription = _Subscription(callback)
        with self._lock:
            self._subscriptions.append(subscription)
        self._drain(subscription)

    def unsubscribe(self, callback: Subscriber) -> None:
        """Remove one subscription of ``callback`` (the oldest); later events are not given to it."""
        with self._lock:
            for subscription in self._subscriptions:
                if subscription.callback == callback:
                    subscription.active = False
                    self._subscriptions.remove(subscription)
                    return

    def clear_subscribers(self) -> None:
        with self._lock:
            for subscription in self._subscriptions:
                subscription.active = False
            self._subscriptions.clear()

    def deliver(self) -> None:
        """Give every subscriber what it has not been given yet (or leave it to its deliverer)."""
        with self._lock:
            subscriptions = list(self._subscriptions)
        for subscription in subscriptions:
            self._drain(subscription)

    def flush(self, callback: Subscriber, timeout: float) -> bool:
        """Make sure every subscription of ``callback`` has been given every event recorded so far.

        Delivers, in this thread, what no other thread is delivering; waits at most ``timeout``
        seconds for a delivery another thread is making to end. True when done (also when
        ``callback`` is not subscribed); False at the timeout, or at once when this very thread is
        inside that delivery (a subscriber that flushes itself). Never calls a subscriber twice
        for an event, nor while another thread calls it.
        """
        deadline = time.monotonic() + timeout
        me = threading.get_ident()
        while True:
            with self._lock:
                mine = [s for s in self._subscriptions if s.callback == callback]
                behind = [s for s in mine if s.active and (s.delivering or s.cursor < len(self._events))]
                if not behind:
                    return True
                idle = [s for s in behind if not s.delivering]
                if not idle:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0 or any(s.deliverer == me for s in behind):
                        return False
                    self._delivered.wait(remaining)
                    continue
            for subscription in idle:
                self._drain(subscription)

    def _drain(self, subscription: _Subscription) -> None:
        while True:
            with self._lock:
                if subscription.delivering or not subscription.active:
                    return
                if subscription.cursor >= len(self._events):
                    return
                batch = self._events[subscription.cursor:]
                subscription.cursor = len(self._events)
                subscription.delivering = True
                subscription.deliverer = threading.get_ident()
            try:
                for event in batch:
                    if not subscription.active:
                        break
                    _call(subscription.callback, event)
            finally:
                with self._lock:
                    subscription.delivering = False
                    subscription.deliverer = None
                    self._delivered.notify_all()


def _call(callback: Subscriber, event: WorkerEvent) -> None:
    try:
        callback(event)
    except BaseException:
        # SystemExit/KeyboardInterrupt too: raised in the watcher thread they would end it (and
        # wedge detection with it) and drop the rest of the batch for every later subscriber.
        logger.exception("liveness subscriber %r raised; ignored", callback)
