"""LivenessProxyMixin: the overrides of upstream's ``GenerationExecutorProxy``.

Each override delegates to upstream when liveness is disabled. With liveness on:

- ``__init__``: resolves the configuration, builds the engine's :class:`~._state.EngineLiveness`
  (monitor started, wedge verdicts held back until READY), then runs upstream's constructor;
- ``_start_executor_workers``: wraps ``mpi_session.submit`` so every rank runs
  :func:`~._worker_entry.liveness_worker_entry` (proxy-death watch; on 1.2.x the identity side
  channel), watches mpi4py's pool thread during the spawn, and arms the wedge timer at READY;
- ``mpi_futures`` / ``_worker_process_monitor``: upstream's attributes, backed by the state (the
  mirrors of the worker futures; the monitor shim on main);
- ``check_health``, ``submit``, ``pre_shutdown``: see each;
- the reaction to a failure (``_liveness_on_event``: the fatal path, the unrestartable note, the
  diagnosis) runs in the monitor's delivery only; ``check_health`` and a clean stop's check reach
  it through one door, ``_liveness_deliver`` (the monitor's check and flush), never beside it;
- ``shutdown``: the bounded shutdown of :mod:`._engine_shutdown`;
- upstream's result thread (``dispatch_result_task``) is not overridden: nothing of the extension
  runs per response batch (its table is a :class:`~._upstream_teardown.ForgottenResults`; the
  thread's activity is the output progress, :mod:`._engine_stall`).

The fatal path itself is :mod:`._fatal`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, ClassVar

from ..._config import LivenessConfig, StallAction
from ..._events import EventKind, RankStatus, WorkerEvent, WorkerFailedError
from ...exit._outcome import mark_running
from ...monitor._monitor import WorkerProcessMonitor
from ...process._identity import is_local
from ...stop._bounded_stop import StopReport
from .._futures import mirror_future
from .._pool_manager_watch import PoolManagerWatch
from ._engine_shutdown import abort_start, arm_exit_guard, shutdown_engine
from ._engine_stall import (
    AFTER_FATAL_DELAY_S,
    Diagnoser,
    EngineStall,
    dispatch_activity,
    pending_count,
)
from ._fatal import (
    DELIVERY_WAIT_S,
    PRE_SHUTDOWN_WAIT_S,
    check_host,
    dead_error,
    fail_request,
    note_unrestartable,
    observe_verdict,
    report_later_event,
    report_snapshot,
    run_fatal_path,
)
from ._features import detect_features, warn_missing_hooks
from ._shim import MonitorShim
from ._startup import announce, export_metrics, new_monitor, wrap_session
from ._state import STATE_ATTR, EngineLiveness, state_of
from ._upstream_teardown import forget_results, run_upstream_shutdown

if TYPE_CHECKING:
    from ...diagnose._diagnosis import Diagnosis

logger = logging.getLogger(__name__.rpartition(".")[0])


def _subscriber(ref: weakref.ReferenceType[LivenessProxyMixin]) -> Callable[[WorkerEvent], None]:
    # Holds the proxy by weakref: a monitor must not keep a dropped engine alive.
    def on_event(event: WorkerEvent) -> None:
        proxy = ref()
        if proxy is not None:
            proxy._liveness_on_event(event)

    return on_event


class LivenessProxyMixin:
    """Mix into an upstream ``GenerationExecutorProxy`` (first in the MRO); see the module docstring.

    The configuration is the class's (``liveness_proxy_class(..., config=...)``), then
    ``TRTLLM_WORKER_LIVENESS``, then ``llm_args.env_overrides`` (see :mod:`trtllm_liveness._config`);
    an invalid one raises ``ValueError`` before any worker starts.

    Thread-safety: the event handler runs in the monitor's watcher thread (or in the thread that
    called ``check_health``) and takes the state's lock only briefly; ``shutdown()`` is
    idempotent and may be called from any thread but the watcher.
    """

    _liveness_base: ClassVar[type]
    _liveness_default_enabled: ClassVar[bool] = False
    _liveness_config: ClassVar[LivenessConfig | None] = None

    def __init__(self, worker_kwargs: Any, *args: Any, **kwargs: Any) -> None:
        cls = type(self)
        llm_args = worker_kwargs.get("llm_args") if isinstance(worker_kwargs, Mapping) else None
        config = LivenessConfig.resolve(llm_args, default_enabled=cls._liveness_default_enabled,
                                        base=cls._liveness_config)
        state = EngineLiveness(config=config)
        self.__dict__[STATE_ATTR] = state
        try:
            if config.enabled:
                self._liveness_start(state, args, kwargs)
                export_metrics(state, llm_args)
            super().__init__(worker_kwargs, *args, **kwargs)  # type: ignore[call-arg]
            if config.enabled:
                forget_results(self)  # before any request: upstream's constructor just returned
        except BaseException:
            # Nobody will call shutdown() on an engine whose constructor failed: stop and close what
            # was started (the watcher, the stall timer, the hub, the process ending's cleanup), once.
            if config.enabled and not state.fatal_path.closing.is_set():
                abort_start(state)
            raise

    def _liveness_start(self, state: EngineLiveness, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        config = state.config
        check_host(config)  # quarantine: refuses to start on a host where a wedged worker still is
        features = detect_features(type(self)._liveness_base)
        warn_missing_hooks(type(self)._liveness_base)
        session = kwargs.get("mpi_session", args[1] if len(args) > 1 else None)
        state.owns_session = session is None
        if not features.fatal_error:
            self._fatal_error: BaseException | None = None  # Dynamo reads it on every version
        monitor = new_monitor(config)
        ref = weakref.ref(self)
        state.subscriber = _subscriber(ref)
        monitor.subscribe(state.subscriber, reports=True)  # the fatal line, or _liveness_on_event's
        if config.exit_on_fatal:
            arm_exit_guard(state, ref)
        state.monitor = monitor  # before start(): a failure from here on closes it (abort_start)
        monitor.start()
        mark_running(config.exit_code)  # for trtllm-liveness launch: an unclean end is never success
        state.shim = MonitorShim(monitor, on_close=self._liveness_expected_exits, own_view=config.observe)
        state.diagnoser = Diagnoser(lambda: monitor.verified_identities(), state.iteration_counts)
        # The engine's progress is always followed (a suspect host and a stopped rank wait for it);
        # the stall timer runs only with stall_timeout_s.
        state.stall = EngineStall(timeout_s=config.stall_timeout_s, fatal=config.stall_action is StallAction.FATAL,
                                  monitor=monitor, pending=lambda: pending_count(ref()),
                                  diagnoser=state.diagnoser, activity=dispatch_activity(ref))
        announce(type(self)._liveness_base, config)

    # -- public view ---------------------------------------------------------------------

    @property
    def liveness_state(self) -> EngineLiveness:
        """The engine's liveness state (read-only use: tests, doctor, bridges)."""
        return state_of(self)

    @property
    def liveness_config(self) -> LivenessConfig:
        """The resolved configuration."""
        return state_of(self).config

    @property
    def liveness_monitor(self) -> WorkerProcessMonitor | None:
        """The monitor watching this executor's ranks (None when disabled); what
        :func:`trtllm_liveness.integrations.dynamo.attach_to_dynamo` subscribes to."""
        return state_of(self).monitor

    @property
    def liveness_fatal_error(self) -> WorkerFailedError | None:
        """The one fatal error the extension recorded, or None."""
        return state_of(self).fatal_path.fatal

    @property
    def liveness_events(self) -> list[WorkerEvent]:
        """Every event seen (the first one is the fatal error's)."""
        return state_of(self).fatal_path.events

    @property
    def liveness_shutdown_report(self) -> StopReport | None:
        """The :class:`~trtllm_liveness.stop._bounded_stop.StopReport` of ``shutdown()``, once it ran."""
        return state_of(self).stop.report

    def liveness_statuses(self) -> list[RankStatus]:
        """Per-rank status snapshot (empty when disabled)."""
        monitor = state_of(self).monitor
        return monitor.statuses() if monitor is not None else []

    def liveness_diagnosis(self) -> Diagnosis | None:
        """The latest :class:`~trtllm_liveness.diagnose._diagnosis.Diagnosis` of the local ranks (taken at a
        stall, a wedge and every fatal error, in a thread the engine owns), or None. Non-blocking."""
        diagnoser = state_of(self).diagnoser
        return diagnoser.latest if diagnoser is not None else None

    # -- upstream attributes backed by the state -------------------------------------------

    @property
    def mpi_futures(self) -> Any:
        try:
            return state_of(self).upstream["mpi_futures"]
        except KeyError:
            raise AttributeError("mpi_futures") from None

    @mpi_futures.setter
    def mpi_futures(self, futures: Any) -> None:
        # With liveness on, upstream holds mirrors of mpi4py's futures (see _futures.py).
        state = state_of(self)
        if state.enabled and isinstance(futures, list):
            state.real_mpi_futures = list(futures)
            futures = [mirror_future(f) if isinstance(f, Future) else f for f in futures]
        state.upstream["mpi_futures"] = futures

    @property
    def _worker_process_monitor(self) -> Any:
        state = state_of(self)
        if state.shim is not None:
            return state.shim
        if "_worker_process_monitor" not in state.upstream:
            raise AttributeError("_worker_process_monitor")
        return state.upstream["_worker_process_monitor"]

    @_worker_process_monitor.setter
    def _worker_process_monitor(self, value: Any) -> None:
        # Upstream main assigns its own monitor; with liveness on it is replaced by the shim (one
        # registration, one set of pidfds) and closed.
        state = state_of(self)
        if state.shim is not None and value is not state.shim:
            close = getattr(value, "close", None)
            if callable(close):
                with contextlib.suppress(Exception):
                    close()
        state.upstream["_worker_process_monitor"] = value

    # -- start ---------------------------------------------------------------------------

    def _start_executor_workers(self, worker_kwargs: Any) -> None:
        state = state_of(self)
        if not state.enabled:
            super()._start_executor_workers(worker_kwargs)  # type: ignore[misc]
            return
        restore = wrap_session(self, state)
        # A failed MPI_Comm_spawn leaves the futures pending and upstream's loop waiting forever.
        pool_watch = PoolManagerWatch(getattr(self, "mpi_session", None),
                                      state.worker_futures).start(state.fatal_path.threads)
        try:
            super()._start_executor_workers(worker_kwargs)  # type: ignore[misc]
        except BaseException as exc:
            pool_watch.disarm()  # before abort_start joins the engine's threads
            fatal = state.fatal_path.fatal or pool_watch.error
            abort_start(state)
            if fatal is not None and fatal is not exc:
                raise fatal from exc
            raise
        finally:
            pool_watch.disarm()
            if restore is not None:
                restore()
        if state.monitor is not None:
            # Time in D before READY does not count towards the READY bound (the monitor resets it).
            state.monitor.arm_wedge_detection(d_state_timeout_s=state.config.d_state_timeout_s)
            if state.stall is not None:  # a stopped rank is a verdict with the engine's progress as its second signal
                state.monitor.watch_stopped_ranks(state.stall.clock, state.config.stopped_timeout_s)
        if state.hub is not None:
            state.hub.arm(state.config.d_state_timeout_s or None)
        if state.stall is not None:
            state.stall.arm()

    # -- events --------------------------------------------------------------------------

    def _liveness_on_event(self, event: WorkerEvent) -> None:
        # The reaction: called by the monitor's delivery only (each event once, one call at a
        # time, outside the monitor's locks); other threads reach it through _liveness_deliver.
        state = state_of(self)
        if state.config.observe:
            observe_verdict(state, event)  # one line, and nothing else
            return
        error = state.fatal_path.record(event)
        if error is not None:
            run_fatal_path(self, state, error)
        else:
            report_later_event(state, event)
        if is_local(event.identity):  # a remote rank's wedge says nothing about this host
            note_unrestartable(state, [event])  # quarantine: a wedge's status, marker and actions
        if state.diagnoser is not None and (error is not None or event.kind is EventKind.WEDGED):
            # After the fatal path, never before it: the snapshot takes a fraction of a second.
            reason = f"{event.kind.value} of rank {event.identity.rank}"
            on_done = None if error is None else functools.partial(report_snapshot, state, reason)
            state.diagnoser.request(reason, on_done, delay_s=AFTER_FATAL_DELAY_S if error is not None else 0.0,
                                    snapshot=error is not None)

    def _liveness_deliver(self, state: EngineLiveness) -> tuple[WorkerEvent | None, bool]:
        """The one door from a thread other than the watcher to the reaction: a synchronous check
        (a new event is delivered by the monitor), then the monitor's flush of this engine's
        subscription (a delivery another thread is making is waited for, at most
        ``DELIVERY_WAIT_S``). Returns the monitor's sticky failure and whether the reaction to it
        is done. Idempotent; never calls the reaction itself."""
        monitor, subscriber = state.monitor, state.subscriber
        if monitor is None or subscriber is None:
            return None, True
        failure = monitor.check()
        if failure is None:
            return None, True
        return failure, monitor.flush(subscriber, DELIVERY_WAIT_S)

    def _liveness_expected_exits(self) -> None:
        """A clean stop begins (upstream's pre_shutdown / monitor close, a healthy shutdown()):
        deliver a failure the monitor already knows first, then mark exits as expected."""
        state = state_of(self)
        if state.monitor is None or state.fatal_path.fatal is not None or state.fatal_path.expected_exits:
            return
        if getattr(self, "_fatal_error", None) is not None or getattr(self, "_engine_dead", None):
            return  # upstream's own death path is running: not a clean stop
        failure, _delivered = self._liveness_deliver(state)
        if failure is not None:
            return
        if state.fatal_path.expect_exits():
            state.monitor.mark_expected_exits()
            logger.debug("liveness: clean stop: worker exits from now on are expected")
            if state.hub is not None:
                state.hub.expect_exits()

    # -- overrides -----------------------------------------------------------------------

    def submit(self, request: Any) -> Any:
        """Upstream's submit; raises the engine-dead error at once after a fatal event, and fails
        a request that registered after the fatal sweep (1.2.x would leave it pending forever).
        Serialized with the fatal path's ``pre_shutdown()`` (``send_lock``): upstream's sockets
        have no lock. A request on an idle engine starts the stall clock."""
        state: EngineLiveness = self.__dict__[STATE_ATTR]  # per request: read inline, no call
        if not state.config.enabled:
            return super().submit(request)  # type: ignore[misc]
        fatal_path = state.fatal_path
        if fatal_path.fatal is not None:
            raise dead_error(self, fatal_path.fatal)
        if state.stall is not None:
            # Before upstream registers the request: the timer must never see it pending with
            # the idle engine's old clock.
            state.stall.note_submitted(pending_count(self) == 0)
        if not state.send_lock.acquire(False):  # uncontended: no timed wait
            # Contended: no waiting on once a fatal error is known (a send in flight to a dead peer
            # may never end), the engine-dead error instead.
            while not state.send_lock.acquire(timeout=0.1):
                if fatal_path.fatal is not None:
                    raise dead_error(self, fatal_path.fatal)
        try:
            if fatal_path.fatal is not None:
                # Became fatal while this call waited for the lock: upstream's send could go to a
                # leader the bounded stop has ended meanwhile (a PAIR put then never returns).
                raise dead_error(self, fatal_path.fatal)
            if state.request_socket_owner is None:
                state.request_socket_owner = threading.get_ident()
            result = super().submit(request)  # type: ignore[misc]
            if state.stall is not None:
                state.stall.note_registered()  # after upstream registered it: pending() counts it
            fatal = fatal_path.fatal
            if fatal is not None:
                # The sweep may have run between upstream's registration and now. Failed (and
                # forgotten) before the lock is released: else the fatal helper's pre_shutdown()
                # could send a CancellingRequest for it, from its thread, to a dead leader.
                fail_request(self, getattr(request, "id", getattr(result, "id", None)), dead_error(self, fatal))
        finally:
            state.send_lock.release()
        return result

    def pre_shutdown(self) -> None:
        """Upstream's ``pre_shutdown()``: marks expected exits first (a clean stop, unless a fatal
        error is known), then runs upstream's, serialized. Waits at most 0.5 s for another thread
        running it (the fatal path's helper may hang in it on a send to a dead peer): then returns.

        After a fatal error, in a thread other than the request socket's owner (the thread of the
        first ``submit()``), upstream's makes no socket send: the pending requests were failed and
        forgotten (no ``CancellingRequest``), and the worker futures are failed first (no stop
        sentinel)."""
        state = state_of(self)
        if not state.enabled:
            super().pre_shutdown()  # type: ignore[misc]
            return
        self._liveness_expected_exits()
        if not state.pre_shutdown_lock.acquire(timeout=PRE_SHUTDOWN_WAIT_S):
            logger.warning("liveness: pre_shutdown() is still running in another thread; not waiting for it")
            return
        try:
            state.pre_shutdown_entries += 1
            fatal = state.fatal_path.fatal
            if fatal is not None and not state.owns_request_socket():
                # Upstream's pre_shutdown() sends its stop sentinel (put_noblock(None)) only while
                # worker futures are pending (main: any; 1.2.x: all). After a fatal error it runs in
                # the fatal path's helper thread (or the upstream-shutdown thread); once a caller's
                # thread owns upstream's request socket, a send from another thread breaks ZMQ's rule
                # (sockets are not thread-safe) and raises with TLLM_LLMAPI_ZMQ_DEBUG=1. Failing the
                # futures (upstream's mirrors) first keeps upstream from sending at all; a leader
                # still alive is then ended by the bounded stop of shutdown() / the exit guard
                # instead of returning by itself.
                state.fail_worker_futures(fatal)
            super().pre_shutdown()  # type: ignore[misc]
        finally:
            state.pre_shutdown_lock.release()

    def check_health(self) -> bool:
        """False after a fatal event (checked synchronously too, so a dead watcher loses
        nothing); otherwise upstream's ``check_health`` or, on 1.2.x, ``not is_shutdown()``.
        One ``poll(0)`` over the pidfds; once a failure is known, waits at most
        ``DELIVERY_WAIT_S`` for its delivery under way in another thread."""
        state = state_of(self)
        if state.enabled and state.monitor is not None:
            if state.fatal_path.fatal is not None:
                return False
            # The monitor's answer is delivered (and reacted to) before upstream's own check
            # below can find the same death first, which would leave the liveness fatal error
            # unrecorded: the watcher may have seen it and not delivered it yet, or be dead.
            failure, delivered = self._liveness_deliver(state)
            if state.config.observe:
                pass  # a verdict is a line only: health is upstream's own
            elif state.fatal_path.fatal is not None or (failure is not None and not delivered):
                return False  # not delivered: the reaction is still under way in another thread
        parent = getattr(super(), "check_health", None)
        if parent is not None:
            return bool(parent())
        return not self.is_shutdown()  # type: ignore[attr-defined]

    def shutdown(self) -> None:
        """Bounded shutdown (:func:`~._engine_shutdown.shutdown_engine`): upstream's in a daemon
        thread, then the remaining workers stopped with SIGTERM/SIGKILL and deadlines. Blocks for
        at most about ``shutdown_grace_s + shutdown_term_s + shutdown_kill_s + 2`` seconds; never
        raises for a dead or wedged rank. Idempotent."""
        state = state_of(self)
        if not state.enabled or state.monitor is None:
            super().shutdown()  # type: ignore[misc]
            return
        shutdown_engine(self, state, functools.partial(run_upstream_shutdown, super().shutdown, state))  # type: ignore[misc]
