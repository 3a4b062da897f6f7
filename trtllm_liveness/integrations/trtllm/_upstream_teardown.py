"""Upstream's own teardown once the workers are gone: nothing left in it to wait for.

Upstream's ``shutdown()`` waits on what only the workers end (docs/upstream-contract.md, "Result
dispatch and teardown after a death")::

    worker futures (upstream holds mirrors)   <- failed by the fatal path, and by
                                                  release_upstream_waits() once the bounded stop ran
    dispatch thread, in a receive on the      <- once the bounded stop ended the ranks, the end
    result queue (the leader's end marker        marker is sent in the leader's place
    never comes from a dead or stopped leader)   (:func:`end_dispatch`)
    1.2.x: the session's pool-thread join     <- ends by itself once every rank is gone; left only
                                                  by a rank that cannot be ended (wedged)

Nothing of the extension runs per response batch. How :class:`ForgottenResults` drops a response
still in flight for a request the fatal path failed and forgot (no ``KeyError`` in upstream's
thread): docs/upstream-contract.md, the paragraph on ``_upstream_teardown.py``.

:func:`run_upstream_shutdown` runs upstream's ``shutdown()`` (which ends by re-raising what its
error queue holds: the engine's own failure is no news, DEBUG); :func:`abandon_session` is what the
bounded shutdown does when upstream's is still blocked after all.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
import types
from collections.abc import Callable
from typing import Any

from ..._events import WorkerFailedError
from ...stop._stop_report import StopOutcome, StopReport
from .._pool_manager_watch import manager_thread
from ._features import log_once, warn_once
from ._state import EngineLiveness

logger = logging.getLogger(__name__.rpartition(".")[0])

DISPATCH_END_S = 1.5
"""How long :func:`end_dispatch` tries: the proxy's socket takes a new peer only once the old
one's connection is gone, which its I/O thread notices a moment after the leader's exit."""
_MARKER_RETRY_S = 0.1

_SIGNALLED = (StopOutcome.EXITED_AFTER_TERM, StopOutcome.EXITED_AFTER_KILL, StopOutcome.UNKILLABLE)

_DROPPED: Any = types.SimpleNamespace(queue=types.SimpleNamespace(put=lambda item: None), abort=lambda: None)
"""What a response for a forgotten request finds: a result whose queue drops it."""


class EngineStoppedError(RuntimeError):
    """What the worker futures upstream still waits on are failed with once the bounded stop of
    ``shutdown()`` ended their ranks (no rank can complete them any more)."""


class ForgottenResults(dict[Any, Any]):
    """Upstream's ``_results`` (client id -> result), put in its place when the engine starts: the
    dict it replaced, nothing added (a missing id raises ``KeyError`` as upstream's does). The fatal
    path turns it into a :class:`FailedResults` (:func:`forget_late_responses`) before it forgets
    the requests it failed."""


class FailedResults(ForgottenResults):
    """The table of an engine that failed: a missing id is a request the extension failed and
    forgot. 1.2's dispatch loop's lookup of it gets a result that drops the response (nothing is
    stored: a forgotten request never counts as pending again), and its ``pop`` of a finished
    request gone meanwhile (the sweep ran between its lookup and its pop) finds nothing to raise."""

    def __missing__(self, key: Any) -> Any:
        return _DROPPED

    def pop(self, key: Any, default: Any = None) -> Any:
        return super().pop(key, default)


def forget_late_responses(results: object) -> None:
    """The fatal path's first step on the table (before any request is forgotten): a response
    still in flight for a forgotten request is dropped from now on. A table that is not a
    :class:`ForgottenResults` (upstream's was not a plain dict) is left as it is."""
    if isinstance(results, ForgottenResults) and not isinstance(results, FailedResults):
        results.__class__ = FailedResults


def forget_results(proxy: Any) -> None:
    """Put a :class:`ForgottenResults` in the place of upstream's ``_results`` (a plain dict, before
    any request: upstream's constructor just returned). Anything else is left as it is."""
    results = getattr(proxy, "_results", None)
    if type(results) is dict:
        proxy._results = ForgottenResults(results)


def end_dispatch(proxy: Any) -> bool:
    """End upstream's dispatch thread (``dispatch_result_thread``) with the end marker the leader
    sends as it exits (``None``), sent by a client of upstream's own queue class (its framing and
    signing) to the result queue's address; True once the thread ended (or never ran). A PULL
    result queue (postprocess workers) takes the client at once; a PAIR one only once the leader's
    connection is gone, so this is called after the ranks were stopped, and the marker is sent
    again every ``_MARKER_RETRY_S`` until the thread ends, for :data:`DISPATCH_END_S` at most. A
    leader that cannot be ended keeps its connection: the thread stays in its receive, and
    upstream's close of that socket (which would raise in the receive, or abort in libzmq) is then
    skipped. Never raises."""
    thread = getattr(proxy, "dispatch_result_thread", None)
    if not isinstance(thread, threading.Thread) or not thread.is_alive():
        return True
    queue = getattr(proxy, "result_queue", None)
    inner = getattr(queue, "queue", queue)  # 1.2's FusedIpcQueue wraps the ZeroMqQueue as .queue
    address = getattr(inner, "address", None)
    if address is None:
        log_once(logging.DEBUG, "end-marker", type(queue).__qualname__, "liveness: result queue %s has no "
                 "address: its dispatch thread is ended only by upstream", type(queue).__qualname__)
        return False
    deadline = time.monotonic() + DISPATCH_END_S
    while thread.is_alive() and time.monotonic() < deadline:
        try:
            _send_end_marker(inner, address, thread)
        except Exception:
            logger.debug("liveness: sending the dispatch thread's end marker failed", exc_info=True)
            thread.join(_MARKER_RETRY_S)
    if not thread.is_alive():
        return True
    for holder in {id(queue): queue, id(inner): inner}.values():  # the thread is still in its receive
        with contextlib.suppress(Exception):
            holder.close = lambda: None  # type: ignore[union-attr]
    logger.debug("liveness: upstream's dispatch thread still receives after %.1fs of end markers; its socket "
                 "is left open", DISPATCH_END_S)
    return False


def _send_end_marker(inner: Any, address: Any, thread: threading.Thread) -> None:
    """One try: a new client of the queue's class sends the marker and stays connected while the
    thread is given ``_MARKER_RETRY_S`` to end (closing it drops a marker not yet delivered)."""
    import zmq

    pull = getattr(inner, "socket_type", None) == zmq.PULL
    client: Any = None
    try:
        client = type(inner)(address, is_server=False, socket_type=zmq.PUSH if pull else zmq.PAIR,
                             name="trtllm_liveness_end_marker",
                             use_hmac_encryption=getattr(inner, "use_hmac_encryption", True))
        client.put_noblock(None, retry=0)
        thread.join(_MARKER_RETRY_S)
    finally:
        socket, context = getattr(client, "socket", None), getattr(client, "context", None)
        if socket is not None:
            socket.close(linger=0)
        if context is not None:
            context.term()


def release_upstream_waits(proxy: Any, state: EngineLiveness, report: StopReport | None) -> None:
    """After the bounded stop of ``shutdown()`` (``report``): once the engine failed, or once the stop
    had to signal a rank (it did not leave by itself), nothing will ever complete a worker future
    or send the leader's end marker, so the futures upstream still waits on are failed (with the
    engine's fatal error, else :class:`EngineStoppedError`) and the dispatch thread is ended
    (:func:`end_dispatch`). Ranks that all left by themselves sent their end marker: nothing is
    done then. Blocks at most :data:`DISPATCH_END_S`; never raises."""
    fatal = state.fatal_path.fatal
    if fatal is None and (report is None or not any(worker.outcome in _SIGNALLED for worker in report.workers)):
        return
    state.fail_worker_futures(fatal if fatal is not None else EngineStoppedError(
        "the engine's ranks were stopped by the bounded shutdown"))
    end_dispatch(proxy)


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
        if current is state.fatal_path.fatal or isinstance(current, (EngineStoppedError, WorkerFailedError)):
            return True
        cause = getattr(current, "root_cause", None)  # upstream main's EngineDeadError
        current = cause if isinstance(cause, BaseException) else current.__cause__
    return False


def abandon_session(proxy: Any, state: EngineLiveness) -> None:
    """Upstream's ``shutdown()`` is still blocked after the workers were stopped: give up its
    session without waiting. main: ``abandon()``. 1.2.x has none; what it would add is the
    release of mpi4py's exit join of the pool thread, which the extension does itself: only when
    that cannot be done, one INFO note per process. A session the proxy does not own is left to
    its owner."""
    if not owns_session(proxy, state):
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


def release_exit_joins(proxy: Any, state: EngineLiveness) -> bool:
    """Let the interpreter exit although the dead world never ends mpi4py's pool thread; True when
    nothing of that thread is left in the exit joins (released now or before), False otherwise.

    main: ``_mark_engine_dead`` calls ``mpi_session.release_exit_joins()``. 1.2.x: nothing does,
    so the pool thread is removed from mpi4py's exit-join table here, feature-detected, only for
    a session the proxy owns (created itself). Idempotent: logs at INFO when it released something;
    once it succeeded, ``state.exit_join_released`` says so (the pool's thread may no longer be
    reachable later: mpi4py drops it from the executor when its shutdown begins)."""
    if state.exit_join_released:
        return True
    session = getattr(proxy, "mpi_session", None)
    if session is None or callable(getattr(session, "release_exit_joins", None)):
        return True
    if not owns_session(proxy, state):
        return False
    core = sys.modules.get("mpi4py.futures._core")
    table = getattr(core, "THREADS_QUEUES", None)
    thread = manager_thread(session)
    if table is None or thread is None:
        warn_once("exit-join", type(session).__qualname__, "liveness: no mpi4py exit-join table to release for "
                  "%s (another mpi4py layout): the interpreter's exit may wait for the dead world's pool thread "
                  "unless exit_on_fatal", type(session).__qualname__)
        return False
    try:
        released = table.pop(thread, None) is not None
        # mpi4py's manager thread is not a daemon where threading has _register_atexit, so
        # threading's own shutdown joins it too (through _shutdown_locks): a wedged world never
        # lets it end. Upstream main's _abandon_mpi_pool_threads drops that lock the same way.
        locks = getattr(threading, "_shutdown_locks", None)
        locks_lock = getattr(threading, "_shutdown_locks_lock", None)
        if locks is None or locks_lock is None:
            if not thread.is_alive():
                state.exit_join_released = True  # an ended thread is joined at once
                return True
            # CPython 3.13+ tracks non-daemon threads in C: nothing here can release that join.
            warn_once("exit-join", "threading", "liveness: this Python joins mpi4py's pool thread at exit in a way "
                      "the extension cannot release: after a death the interpreter may wait for the dead world "
                      "at exit unless exit_on_fatal")
            return False
        lock = getattr(thread, "_tstate_lock", None)  # None once the thread ended
        if lock is not None:
            with locks_lock:  # threading's own lock for that set (Thread.start adds to it)
                released = lock in locks or released
                locks.discard(lock)
    except Exception:
        logger.debug("liveness: releasing mpi4py's exit join failed", exc_info=True)
        return False
    if released:
        logger.info("liveness: released mpi4py's exit join of %s (the world is dead)", thread.name)
    state.exit_join_released = True
    return True


def owns_session(proxy: object, state: EngineLiveness) -> bool:
    """Whether the proxy created its MPI session (upstream's ``_owns_mpi_session`` where it has one)."""
    owns = getattr(proxy, "_owns_mpi_session", None)
    return owns if isinstance(owns, bool) else state.owns_session
