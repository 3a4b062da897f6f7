"""PoolManagerWatch against stand-ins with mpi4py's layout (``session.mpi_pool._pool.thread``).

The real spawn failure is in ``test_spawn_failure.py``; these cover the edges with plain threads.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import pytest

from trtllm_liveness.exit._process_ending import OwnedThreads
from trtllm_liveness.integrations._pool_manager_watch import PoolManagerDiedError, PoolManagerWatch

pytestmark = pytest.mark.timeout(30)


def _session_with_manager(target: Any) -> tuple[SimpleNamespace, threading.Thread]:
    manager = threading.Thread(target=target, name="mpi4py-manager", daemon=True)
    session = SimpleNamespace(mpi_pool=SimpleNamespace(_pool=SimpleNamespace(thread=manager)))
    return session, manager


def test_dead_manager_fails_pending_futures_and_reports_once(caplog: pytest.LogCaptureFixture) -> None:
    session, manager = _session_with_manager(lambda: None)  # dies at once, like a failed spawn
    done: Future[Any] = Future()
    done.set_result("finished before")
    pending: list[Future[Any]] = [Future(), Future()]
    with caplog.at_level(logging.ERROR, logger="trtllm_liveness"):
        watch = PoolManagerWatch(session, lambda: [done, *pending]).start(OwnedThreads())
        manager.start()
        for future in pending:
            assert isinstance(future.exception(timeout=10), PoolManagerDiedError)
        watch.disarm()
    assert done.result() == "finished before"
    assert all(future.exception() is watch.error for future in pending)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == [f"liveness: {watch.error}"]
    assert "failing 2 pending worker futures" in str(watch.error)


def test_futures_stored_after_the_manager_died_are_still_failed() -> None:
    session, manager = _session_with_manager(lambda: None)
    holder: dict[str, list[Future[Any]]] = {}
    watch = PoolManagerWatch(session, lambda: holder.get("futures")).start(OwnedThreads())
    manager.start()
    manager.join(10)
    holder["futures"] = [Future()]  # the proxy assigns mpi_futures only after submit() returns
    assert isinstance(holder["futures"][0].exception(timeout=10), PoolManagerDiedError)
    watch.disarm()


def test_disarmed_watch_leaves_futures_alone_when_the_manager_ends() -> None:
    release = threading.Event()
    session, manager = _session_with_manager(release.wait)
    future: Future[Any] = Future()
    watch = PoolManagerWatch(session, lambda: [future]).start(OwnedThreads())
    manager.start()
    watch.disarm()  # start-up succeeded
    release.set()
    manager.join(10)
    assert not watch._thread.is_alive()
    assert not future.done() and watch.error is None


def test_session_without_a_pool_is_not_watched() -> None:
    future: Future[Any] = Future()
    watch = PoolManagerWatch(SimpleNamespace(mpi_pool=None), lambda: [future]).start(OwnedThreads())
    watch._thread.join(10)  # gives up by itself once futures exist without a pool thread
    assert not watch._thread.is_alive()
    assert not future.done() and watch.error is None
    watch.disarm()


def test_disarm_before_anything_was_submitted_ends_the_watch() -> None:
    watch = PoolManagerWatch(None, lambda: None).start(OwnedThreads())
    watch.disarm()
    assert not watch._thread.is_alive()
