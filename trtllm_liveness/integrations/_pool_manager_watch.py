"""Fail the start-up futures when mpi4py's pool manager thread dies, so a failed spawn cannot hang.

``mpi4py.futures.MPIPoolExecutor`` runs ``MPI_Comm_spawn`` and all traffic with its workers on one
manager thread. When the spawn raises (PRRTE or PMIx could not start, no ``prte`` on PATH, a
session directory that cannot be made), that thread dies with a traceback on stderr and nothing
else happens (mpi4py 4.1 marks the pool broken only when an *initializer* fails): the submitted
futures stay pending, and TensorRT-LLM's start-up loop, which only asks whether a future is done,
waits forever. Measured here with a real spawn failure: the proxy never returns.

:class:`PoolManagerWatch` joins that thread (no polling once it is found) and, if it ends while the
watch is armed, fails every future still pending with :class:`PoolManagerDiedError`. Upstream's own
loop then reports "Executor worker died during initialization" within its 1 s poll, and the mixin
raises this error in its place. Everything here is duck-typed on mpi4py's private layout
(``executor._pool.thread``); where it differs, the watch logs once and does nothing.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from ..exit._process_ending import OwnedThreads
from ._futures import fail_pending

logger = logging.getLogger(__name__)

_FIND_INTERVAL_S = 0.01  # the pool (and its thread) appears on the first submit
_JOIN_SLICE_S = 0.1  # how soon disarm() is noticed while joining


class PoolManagerDiedError(RuntimeError):
    """The MPI pool's manager thread ended before the workers were up (the spawn failed)."""


def manager_thread(session: Any) -> threading.Thread | None:
    """mpi4py's pool manager thread of ``session`` (``mpi_pool._pool.thread``), where it has one."""
    pool = getattr(getattr(session, "mpi_pool", None), "_pool", None)
    thread = getattr(pool, "thread", None)
    return thread if isinstance(thread, threading.Thread) else None


class PoolManagerWatch:
    """Watches ``session.mpi_pool``'s manager thread while armed; see the module docstring.

    ``futures`` returns the futures to fail (read when the thread dies, since the proxy stores them
    only after ``submit`` returns); ``error`` holds the error they failed with, set before they fail.
    The watch thread belongs to the ``threads`` given to :meth:`start` (the engine's): its bound
    ends with :meth:`disarm`, which joins it; the owner's join then finds it ended, or names it.
    """

    def __init__(self, session: Any, futures: Callable[[], Sequence[Future[Any]] | None]) -> None:
        self._session = session
        self._futures = futures
        self._disarmed = threading.Event()
        self.error: PoolManagerDiedError | None = None
        self._thread: threading.Thread | None = None

    def start(self, threads: OwnedThreads) -> PoolManagerWatch:
        # Bound 0: joined by disarm(); the owner's later join only checks that it ended.
        self._thread = threads.start(self._run, name="liveness-pool-manager-watch", bound_s=0.0)
        return self

    def disarm(self, timeout: float = 1.0) -> None:
        """Stop watching (start-up is over, or shutdown begins); joins the watch thread, bounded."""
        self._disarmed.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _run(self) -> None:
        manager = None
        while manager is None:
            if self._disarmed.wait(_FIND_INTERVAL_S):
                return
            manager = manager_thread(self._session)
            if manager is None and self._futures():
                # Submitted, yet no mpi4py pool thread: another session kind (MpiCommSession under
                # mpirun) or another mpi4py layout. Nothing to watch.
                logger.info("liveness: no mpi4py pool manager thread to watch in this MPI session")
                return
        while manager.is_alive() and not self._disarmed.is_set():
            manager.join(_JOIN_SLICE_S)
        if self._disarmed.is_set():
            return
        futures = self._futures()
        while not futures and not self._disarmed.wait(_FIND_INTERVAL_S):
            futures = self._futures()
        pending = [f for f in futures or () if not f.done()]
        error = PoolManagerDiedError(
            f"the MPI pool's manager thread ({manager.name}) ended before the workers became ready: "
            f"MPI_Comm_spawn failed (its traceback is on stderr); failing {len(pending)} pending "
            "worker futures instead of waiting forever")
        self.error = error
        logger.error("liveness: %s", error)
        fail_pending(pending, error)
