"""Upstream's own teardown once the workers are gone: nothing left in it to wait for.

Upstream's ``shutdown()`` waits on what only the workers end (docs/upstream-contract.md, "Result
dispatch and teardown after a death")::

    worker futures (upstream holds mirrors)   <- failed by the fatal path, and by
                                                  release_upstream_waits() once the bounded stop ran
    dispatch thread, in a receive on the      <- it waits in the DispatchGate instead: result socket
    result queue (the leader's end marker        or the gate's wakeup; a closed gate ends the thread
    never comes from a dead or stopped leader)   (the fatal path closes it, as does the bounded stop)
    1.2.x: the session's pool-thread join     <- ends by itself once every rank is gone; left only
                                                  by a rank that cannot be ended (wedged)

The gate closes BEFORE the fatal path fails and forgets the pending requests, and a dispatch in
progress finishes first: no response in flight is dispatched after that, so the 1.2-era lookup
``_results[client_id]`` never meets a request the extension forgot (a ``KeyError`` logged at ERROR
in upstream's thread), and the thread's join returns at once.

:func:`run_upstream_shutdown` runs upstream's ``shutdown()`` (which ends by re-raising what its
error queue holds: the engine's own failure is no news, DEBUG); :func:`abandon_session` is what the
bounded shutdown does when upstream's is still blocked after all.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
from collections.abc import Callable
from typing import Any

from ..._events import WorkerFailedError
from ...stop._stop_report import StopOutcome, StopReport
from .._futures import fail_pending
from ._fatal import release_exit_joins
from ._features import log_once
from ._state import EngineLiveness

logger = logging.getLogger(__name__.rpartition(".")[0])

DISPATCH_WAIT_S = 0.5
"""How long closing the gate waits for a dispatch under way (one batch already received)."""

_WAIT_TICK_MS = 1000
"""The gate's poll timeout: the wakeup ends a wait at once; the tick only bounds each poll."""

_ZMQ_EVENTS = 15
_ZMQ_POLLIN = 1
"""libzmq's ``ZMQ_EVENTS`` option and ``ZMQ_POLLIN`` bit (zmq.h), as plain ints: pyzmq's enums
cost more per response batch than the check itself."""

_SIGNALLED = (StopOutcome.EXITED_AFTER_TERM, StopOutcome.EXITED_AFTER_KILL, StopOutcome.UNKILLABLE)


class EngineStoppedError(RuntimeError):
    """What the worker futures upstream still waits on are failed with once the bounded stop of
    ``shutdown()`` ended their ranks (no rank can complete them any more)."""


class DispatchGate:
    """Where upstream's dispatch thread waits for its next response batch; closing it ends the thread.

    Only upstream's dispatch thread calls :meth:`dispatch`. :meth:`close` may be called from any
    thread, any number of times. The gate owns a wakeup pipe: made by the dispatch thread at its
    first wait, written once by :meth:`close`, and closed once, by whichever of the two finds no
    wait under way on it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()  # guards _closed, _pipe, _waiting
        self._dispatching = threading.Lock()  # held while upstream dispatches one received batch
        self._closed = False
        self._pipe: tuple[int, int] | None = None
        self._waiting = False
        self._poller: select.poll | None = None
        self._polled: Any = None
        self._queue: Any = None
        self._socket: Any = None

    @property
    def closed(self) -> bool:
        return self._closed

    def dispatch(self, result_queue: Any, upstream: Callable[[], Any]) -> Any:
        """One call of upstream's ``dispatch_result_task``, made once a batch can be received
        without blocking; False (upstream's thread ends) once the gate is closed. Blocks until
        one of the two. A result queue without a ZMQ socket gets upstream's own blocking receive."""
        if result_queue is not self._queue:
            self._queue, self._socket = result_queue, result_socket(result_queue)
        socket = self._socket
        if socket is None:
            log_once(logging.DEBUG, "dispatch-gate", type(result_queue).__qualname__,
                     "liveness: result queue %s has no ZMQ socket: its dispatch thread is ended only by "
                     "upstream", type(result_queue).__qualname__)
            return False if self._closed else upstream()
        if not self._wait_readable(socket):
            return False
        with self._dispatching:
            if self._closed:
                return False
            return upstream()

    def close(self, wait_s: float = DISPATCH_WAIT_S) -> None:
        """Close the gate: the dispatch thread leaves its wait now, and dispatches nothing more.
        Waits up to ``wait_s`` for a dispatch under way (of a batch already received) to finish.
        Idempotent; never raises."""
        with self._lock:
            self._closed = True
            if self._pipe is not None:
                if self._waiting:
                    with contextlib.suppress(OSError):
                        os.write(self._pipe[1], b"x")
                else:
                    self._release_pipe()
        if self._dispatching.acquire(timeout=wait_s):
            self._dispatching.release()
        else:
            logger.debug("liveness: upstream's dispatch of a response batch still runs after %.1fs", wait_s)

    def _wait_readable(self, socket: Any) -> bool:
        """True once ``socket`` has a message; False once the gate is closed. The wait is a
        ``poll()`` on the socket's ``ZMQ_FD`` and the wakeup pipe; ``ZMQ_FD`` only signals that the
        socket's state may have changed (edge-triggered), so its ``ZMQ_EVENTS`` are read before
        every wait, and a batch already waiting (the busy engine's case) needs no wait at all."""
        import zmq

        if self._closed:
            return False
        if socket.getsockopt(_ZMQ_EVENTS) & _ZMQ_POLLIN:
            return True
        with self._lock:
            if self._closed:
                return False
            if self._pipe is None:
                self._pipe = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
            if self._polled is not socket or self._poller is None:
                self._poller = select.poll()
                self._poller.register(socket.getsockopt(zmq.FD), select.POLLIN)
                self._poller.register(self._pipe[0], select.POLLIN)
                self._polled = socket
            poller = self._poller
            self._waiting = True
        try:
            while True:
                if socket.getsockopt(_ZMQ_EVENTS) & _ZMQ_POLLIN:
                    return not self._closed
                poller.poll(_WAIT_TICK_MS)
                if self._closed:
                    return False
        finally:
            with self._lock:
                self._waiting = False
                if self._closed and self._pipe is not None:
                    self._release_pipe()

    def _release_pipe(self) -> None:
        # Under self._lock, with no wait under way on the pipe.
        assert self._pipe is not None
        for fd in self._pipe:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._pipe = None
        self._poller = self._polled = None


def result_socket(result_queue: Any) -> Any:
    """The ZMQ socket behind upstream's result queue: the queue's own (``ZeroMqQueue``) or that of
    the queue it wraps (1.2's ``FusedIpcQueue.queue``); None if there is none."""
    for holder in (result_queue, getattr(result_queue, "queue", None)):
        socket = getattr(holder, "socket", None)
        if socket is not None and hasattr(socket, "getsockopt"):
            return socket
    return None


def close_dispatch(state: EngineLiveness) -> None:
    """End upstream's dispatch thread (see :class:`DispatchGate`); never blocks beyond one dispatch."""
    if state.dispatch_gate is not None:
        state.dispatch_gate.close()


def release_upstream_waits(state: EngineLiveness, report: StopReport | None) -> None:
    """After the bounded stop of ``shutdown()`` (``report``): once the engine failed, or once the stop
    had to signal a rank (it did not leave by itself), nothing will ever send on the result queue
    or complete a worker future, so the dispatch thread is ended and the futures upstream still
    waits on are failed (with the engine's fatal error, else :class:`EngineStoppedError`). Ranks
    that all left by themselves sent their end marker: nothing is done then. Never blocks beyond
    one dispatch; never raises."""
    if state.fatal is None and (report is None or not any(
            worker.outcome in _SIGNALLED for worker in report.workers)):
        return
    close_dispatch(state)
    futures = state.mpi_futures if isinstance(state.mpi_futures, list) else []
    error: BaseException = state.fatal if state.fatal is not None else EngineStoppedError(
        "the engine's ranks were stopped by the bounded shutdown")
    fail_pending(futures, error)


def run_upstream_shutdown(shutdown: Callable[[], None], state: EngineLiveness) -> None:
    """Upstream's ``shutdown()``. It ends with ``_handle_background_error()``, which raises what its
    error queue holds: after a death that is the engine's own failure (a worker future's error, or
    upstream's wrapping of it), already reported: DEBUG. Anything else: one WARNING."""
    try:
        shutdown()
    except Exception as exc:
        if _is_the_engines_failure(exc, state):
            logger.debug("liveness: upstream shutdown re-raised the engine's failure: %s", exc)
        else:
            logger.warning("liveness: upstream shutdown raised", exc_info=True)


def _is_the_engines_failure(exc: BaseException, state: EngineLiveness) -> bool:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if current is state.fatal or isinstance(current, (EngineStoppedError, WorkerFailedError)):
            return True
        cause = getattr(current, "root_cause", None)  # upstream main's EngineDeadError
        current = cause if isinstance(cause, BaseException) else current.__cause__
    return False


def abandon_session(proxy: Any, state: EngineLiveness, owned: bool) -> None:
    """Upstream's ``shutdown()`` is still blocked after the workers were stopped: give up its
    session without waiting. main: ``abandon()``. 1.2.x has none; what it would add is the
    release of mpi4py's exit join of the pool thread, which the extension does itself: only when
    that cannot be done, one INFO note per process. A session the proxy does not own is left to
    its owner."""
    if not owned:
        logger.info("liveness: the MPI session belongs to the caller; not abandoned")
        return
    session = getattr(proxy, "mpi_session", None)
    if session is None:
        return
    abandon = getattr(session, "abandon", None)
    if callable(abandon):
        with contextlib.suppress(Exception):
            abandon()
        return
    if release_exit_joins(proxy, state):
        return
    log_once(logging.INFO, "abandon", "process", "liveness: the MPI session %s has no abandon() and its pool "
             "thread's exit join could not be released: the interpreter's exit may wait for it",
             type(session).__qualname__)
