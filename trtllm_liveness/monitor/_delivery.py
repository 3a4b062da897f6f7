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
"""

from __future__ import annotations

import logging
import threading
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
    active: bool = True


class EventLog:
    """The fatal events so far, in order, and who has been given which. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
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
            if not self._subscriptions:
                return
            subscriptions = list(self._subscriptions)
        for subscription in subscriptions:
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
            try:
                for event in batch:
                    if not subscription.active:
                        break
                    _call(subscription.callback, event)
            finally:
                with self._lock:
                    subscription.delivering = False


def _call(callback: Subscriber, event: WorkerEvent) -> None:
    try:
        callback(event)
    except BaseException:
        # SystemExit/KeyboardInterrupt too: raised in the watcher thread they would end it (and
        # wedge detection with it) and drop the rest of the batch for every later subscriber.
        logger.exception("liveness subscriber %r raised; ignored", callback)
