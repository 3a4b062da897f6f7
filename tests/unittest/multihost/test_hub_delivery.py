"""RemoteDelivery and the monitor's ``deliver=False``: remote ranks' states applied at once by the
hub's thread (under its lock), their events given to the subscribers by the delivery's thread, raced
against the engine's own threads delivering through ``check()`` and ``flush()``."""

from __future__ import annotations

import os
import threading

import pytest

from tests.support.process_tracker import start_time_or_none
from tests.support.waits import WAIT_SCALE, wait_until
from trtllm_liveness._events import EventKind, WorkerEvent, WorkerState
from trtllm_liveness.monitor import WorkerProcessMonitor
from trtllm_liveness.multihost._hub_delivery import RemoteDelivery
from trtllm_liveness.process._identity import ProcessIdentity

pytestmark = pytest.mark.timeout(60)

BOUND_S = 10.0 * WAIT_SCALE


def remote(rank: int) -> ProcessIdentity:
    return ProcessIdentity(rank, os.getpid(), start_time_or_none(os.getpid()), "fakehostB", 1)


def test_states_at_once_events_later_and_never_in_the_applying_thread() -> None:
    """``deliver=False``: the state and the failure are there when the call returns, the log line
    too, but no subscriber was called in that thread; ``deliver()`` gives it, once."""
    with WorkerProcessMonitor() as monitor:
        callers: list[int] = []
        monitor.subscribe(lambda event: callers.append(threading.get_ident()))
        taken = monitor.apply_remote_many([(remote(4), WorkerState.EXITED, "gone")], via="agent", deliver=False)
        assert taken == 1 and callers == []
        assert monitor.failure is not None and monitor.failure.identity.rank == 4
        assert [s.state for s in monitor.statuses()] == [WorkerState.EXITED]
        done = threading.Thread(target=monitor.deliver)
        done.start()
        done.join(BOUND_S)
        monitor.deliver()  # nothing left: no second call
        assert callers == [done.ident]


def test_racing_applies_pokes_checks_and_flushes_deliver_each_event_once_in_order_one_call_at_a_time() -> None:
    """Four hub-like threads apply deaths (deliver=False) and poke; two engine-like threads call
    ``check()`` and ``flush()`` all along; the delivery closes at the end. Every event reaches the
    subscriber exactly once, in the log's order, never two calls at the same time."""
    ranks_per_thread = 25
    with WorkerProcessMonitor() as monitor:
        delivery = RemoteDelivery(monitor)
        delivery.start()
        got: list[WorkerEvent] = []
        inside = threading.Semaphore(1)
        overlaps: list[int] = []

        def subscriber(event: WorkerEvent) -> None:
            if not inside.acquire(blocking=False):
                overlaps.append(event.identity.rank)
                return
            try:
                got.append(event)
            finally:
                inside.release()

        monitor.subscribe(subscriber)
        go = threading.Barrier(6, timeout=BOUND_S)
        stop = threading.Event()

        def hub(first: int) -> None:
            go.wait()
            for rank in range(first, first + ranks_per_thread):
                monitor.apply_remote_many([(remote(rank), WorkerState.EXITED, "gone")], via="agent", deliver=False)
                delivery.poke()

        def engine(flush: bool) -> None:
            go.wait()
            while not stop.is_set():
                if flush:
                    monitor.flush(subscriber, 1.0)
                else:
                    monitor.check()

        hubs = [threading.Thread(target=hub, args=(10 + 100 * n,)) for n in range(4)]
        engines = [threading.Thread(target=engine, args=(flush,)) for flush in (False, True)]
        for thread in hubs + engines:
            thread.start()
        for thread in hubs:
            thread.join(BOUND_S)
        assert wait_until(lambda: len(got) + len(overlaps) >= 4 * ranks_per_thread, BOUND_S)
        stop.set()
        for thread in engines:
            thread.join(BOUND_S)
        delivery.close(BOUND_S)
        delivery.close(BOUND_S)  # idempotent
        delivery.poke()  # after close: nothing runs
        assert overlaps == []
        assert [event.identity.rank for event in got] == [event.identity.rank for event in monitor.events]
        assert len({event.identity.rank for event in got}) == 4 * ranks_per_thread
        assert all(event.kind is EventKind.DIED for event in got)


def test_a_subscriber_still_busy_at_close_is_left_to_finish_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    with WorkerProcessMonitor() as monitor:
        delivery = RemoteDelivery(monitor)
        delivery.start()
        release = threading.Event()
        entered = threading.Event()

        def slow(event: WorkerEvent) -> None:
            entered.set()
            release.wait(BOUND_S)

        monitor.subscribe(slow)
        monitor.apply_remote_many([(remote(4), WorkerState.EXITED, "gone")], via="agent", deliver=False)
        delivery.poke()
        assert entered.wait(BOUND_S)
        delivery.close(0.05)
        release.set()
        warnings = [r for r in caplog.records if r.levelname == "WARNING" and "still handling" in r.getMessage()]
        assert len(warnings) == 1
