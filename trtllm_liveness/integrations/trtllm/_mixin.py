"""LivenessProxyMixin: the overrides of upstream's ``GenerationExecutorProxy``.

Each override delegates to upstream when liveness is disabled. With liveness on:

- ``__init__``: resolves the configuration, builds the engine's :class:`~._state.EngineLiveness`
  (monitor started, wedge verdicts held back until READY), then runs upstream's constructor;
- ``_start_executor_workers``: wraps ``mpi_session.submit`` so every rank runs
  :func:`~._worker_entry.liveness_worker_entry` (proxy-death watch; on 1.2.x the identity side
  channel), watches mpi4py's pool thread during the spawn, and arms the wedge timer at READY;
- ``mpi_futures`` / ``_worker_process_monitor``: upstream's attributes, backed by the state (the
  mirrors of the worker futures; the monitor shim on main);
- ``check_health``, ``submit``, ``pre_shutdown``, ``shutdown``: see each;
- ``dispatch_result_task`` (upstream's result thread): waits in the engine's
  :class:`~._upstream_teardown.DispatchGate` (closed after a fatal error or the bounded stop, which
  ends the thread); each dispatched response is progress for the stall timer (``stall_timeout_s``,
  :mod:`._engine_stall`).

The fatal path itself is :mod:`._fatal`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any, ClassVar

from ..._config import LivenessConfig
from ..._errors import LivenessError
from ..._events import EventKind, RankStatus, WorkerEvent, WorkerFailedError
from ...exit._exit_guard import FatalExitGuard, interrupt_self_once
from ...exit._outcome import mark_clean, mark_running
from ...monitor._monitor import WorkerProcessMonitor
from ...process._identity import ProcessIdentity, is_local
from ...process._pidfd import verify_start_time
from ...stop._bounded_stop import StopReport
from .._futures import mirror_future
from .._pool_manager_watch import PoolManagerWatch
from ._engine_stall import AFTER_FATAL_DELAY_S, Diagnoser, EngineStall, pending_count, pending_counter
from ._fatal import (
    PRE_SHUTDOWN_WAIT_S,
    acquire_send_lock,
    check_host,
    dead_error,
    exit_status,
    fail_request,
    note_unrestartable,
    run_fatal_path,
    wait_for_quarantine,
)
from ._features import detect_features, warn_missing_hooks, warn_session_hooks
from ._hosts import agent_settings, start_hub, stop_remote_hosts, wants_hub
from ._request_socket import owns_request_socket, quiet_after_fatal, zmq_debug
from ._shim import MonitorShim
from ._side_channel import IdentityChannel
from ._startup import announce, arm_wedges, export_metrics, new_monitor, upstream_skips_registration
from ._state import MISSING, STATE_ATTR, EngineLiveness
from ._upstream_teardown import (
    DispatchGate,
    abandon_session,
    close_dispatch,
    release_upstream_waits,
    run_upstream_shutdown,
)
from ._worker_entry import liveness_worker_entry, proxy_identity
from ._worker_spec import SPEC_KWARG, ProxyIdentity, WorkerSpec

logger = logging.getLogger(__name__.rpartition(".")[0])

_UPSTREAM_SHUTDOWN_AFTER_STOP_S = 1.0


def _subscriber(ref: weakref.ReferenceType[Any]) -> Callable[[WorkerEvent], None]:
    # Holds the proxy by weakref: a monitor must not keep a dropped engine alive.
    def on_event(event: WorkerEvent) -> None:
        proxy = ref()
        if proxy is not None:
            proxy._liveness_on_event(event)

    return on_event


def _state(proxy: Any) -> EngineLiveness:
    state: EngineLiveness = proxy.__dict__[STATE_ATTR]
    return state


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
        if config.enabled:
            self._liveness_start(state, args, kwargs)
            export_metrics(state, llm_args)
        super().__init__(worker_kwargs, *args, **kwargs)  # type: ignore[call-arg]

    def _liveness_start(self, state: EngineLiveness, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        config = state.config
        check_host(config)  # quarantine: refuses to start on a host where a wedged worker still is
        state.features = features = detect_features(type(self)._liveness_base)
        warn_missing_hooks(type(self)._liveness_base)
        session = kwargs.get("mpi_session", args[1] if len(args) > 1 else None)
        state.owns_session = session is None
        if not features.fatal_error:
            self._fatal_error: BaseException | None = None  # Dynamo reads it on every version
        monitor = new_monitor(config)
        monitor.subscribe(_subscriber(weakref.ref(self)))
        if config.exit_on_fatal:
            state.exit_guard = FatalExitGuard(graceful=_graceful(state), timeout_s=config.exit_timeout_s,
                                              exit_code=config.exit_code, exit_fn=_exit_stopping(weakref.ref(self)),
                                              exit_code_unrestartable=config.exit_code_unrestartable)
        monitor.start()
        state.monitor = monitor
        state.dispatch_gate = DispatchGate()
        mark_running(config.exit_code)  # for trtllm-liveness launch: an unclean end is never success
        state.shim = MonitorShim(monitor, on_close=self._liveness_expected_exits)
        state.diagnoser = Diagnoser(lambda: monitor.verified_identities())
        if config.stall_timeout_s > 0:
            state.stall = EngineStall(timeout_s=config.stall_timeout_s, fatal=config.stall_action == "fatal",
                                      monitor=monitor, pending=pending_counter(weakref.ref(self)),
                                      diagnoser=state.diagnoser)
        announce(type(self)._liveness_base, config)

    # -- public view ---------------------------------------------------------------------

    @property
    def liveness_state(self) -> EngineLiveness:
        """The engine's liveness state (read-only use: tests, doctor, bridges)."""
        return _state(self)

    @property
    def liveness_config(self) -> LivenessConfig:
        """The resolved configuration."""
        return _state(self).config

    @property
    def liveness_monitor(self) -> WorkerProcessMonitor | None:
        """The monitor watching this executor's ranks (None when disabled); what
        :func:`trtllm_liveness.integrations.dynamo.attach_to_dynamo` subscribes to."""
        return _state(self).monitor

    @property
    def liveness_exit_guard(self) -> FatalExitGuard | None:
        """The exit guard when ``exit_on_fatal`` is on (``guard.triggered`` after a fatal event)."""
        return _state(self).exit_guard

    @property
    def liveness_fatal_error(self) -> WorkerFailedError | None:
        """The one fatal error the extension recorded, or None."""
        return _state(self).fatal

    @property
    def liveness_events(self) -> list[WorkerEvent]:
        """Every event seen (the first one is the fatal error's)."""
        state = _state(self)
        with state.lock:
            return list(state.events)

    @property
    def liveness_shutdown_report(self) -> StopReport | None:
        """The :class:`~trtllm_liveness.stop._bounded_stop.StopReport` of ``shutdown()``, once it ran."""
        return _state(self).shutdown_report

    @property
    def liveness_pre_shutdown_calls(self) -> int:
        """How many calls reached upstream's ``pre_shutdown()`` through this proxy."""
        return _state(self).pre_shutdown_entries

    def liveness_statuses(self) -> list[RankStatus]:
        """Per-rank status snapshot (empty when disabled)."""
        monitor = _state(self).monitor
        return monitor.statuses() if monitor is not None else []

    def liveness_diagnosis(self) -> Any:
        """The latest :class:`~trtllm_liveness.diagnose._diagnosis.Diagnosis` of the local ranks (taken at a
        stall, a wedge and every fatal error, in a daemon thread), or None. Non-blocking."""
        diagnoser = _state(self).diagnoser
        return diagnoser.latest if diagnoser is not None else None

    def liveness_stall(self) -> Any:
        """The :class:`~trtllm_liveness.monitor._stall_timer.StallInfo` of the stall under way, or None."""
        stall = _state(self).stall
        detector = stall.detector if stall is not None else None
        return detector.current if detector is not None else None

    def liveness_identities(self) -> list[ProcessIdentity]:
        """The registered worker identities (empty when disabled or not known yet)."""
        monitor = _state(self).monitor
        return monitor.identities if monitor is not None else []

    # -- upstream attributes backed by the state -------------------------------------------

    @property
    def mpi_futures(self) -> Any:
        futures = _state(self).mpi_futures
        if futures is MISSING:
            raise AttributeError("mpi_futures")
        return futures

    @mpi_futures.setter
    def mpi_futures(self, futures: Any) -> None:
        # With liveness on, upstream holds mirrors of mpi4py's futures (see _futures.py).
        state = _state(self)
        if state.enabled and isinstance(futures, list):
            state.real_mpi_futures = list(futures)
            futures = [mirror_future(f) if isinstance(f, Future) else f for f in futures]
        state.mpi_futures = futures

    @property
    def _worker_process_monitor(self) -> Any:
        state = _state(self)
        if state.shim is not None:
            return state.shim
        if state.upstream_monitor is MISSING:
            raise AttributeError("_worker_process_monitor")
        return state.upstream_monitor

    @_worker_process_monitor.setter
    def _worker_process_monitor(self, value: Any) -> None:
        # Upstream main assigns its own monitor; with liveness on it is replaced by the shim (one
        # registration, one set of pidfds) and closed.
        state = _state(self)
        if state.shim is not None and value is not state.shim:
            close = getattr(value, "close", None)
            if callable(close):
                with contextlib.suppress(Exception):
                    close()
        state.upstream_monitor = value

    # -- start ---------------------------------------------------------------------------

    def _start_executor_workers(self, worker_kwargs: Any) -> None:
        state = _state(self)
        if not state.enabled:
            super()._start_executor_workers(worker_kwargs)  # type: ignore[misc]
            return
        restore = self._liveness_wrap_session(state)
        # A failed MPI_Comm_spawn leaves the futures pending and upstream's loop waiting forever.
        pool_watch = PoolManagerWatch(getattr(self, "mpi_session", None),
                                      lambda: state.mpi_futures if isinstance(state.mpi_futures, list) else None
                                      ).start()
        try:
            super()._start_executor_workers(worker_kwargs)  # type: ignore[misc]
        except BaseException as exc:
            fatal = state.fatal or pool_watch.error
            self._liveness_abort_start()
            if fatal is not None and fatal is not exc:
                raise fatal from exc
            raise
        finally:
            pool_watch.disarm()
            if restore is not None:
                restore()
        state.ready = True
        if state.monitor is not None:
            arm_wedges(state.monitor, state.config)
        if state.hub is not None:
            state.hub.arm(state.config.d_state_timeout_s or None)
        if state.stall is not None:
            state.stall.arm()

    def _liveness_wrap_session(self, state: EngineLiveness) -> Callable[[], None] | None:
        session = getattr(self, "mpi_session", None)
        warn_session_hooks(session, owned=state.owns_session)
        submit = getattr(session, "submit", None)
        if session is None or not callable(submit):
            return None
        channel: IdentityChannel | None = None
        assert state.features is not None
        # main sends the ranks' identities itself, but registers them only for sessions it spawned:
        # for an mpirun-launched (MpiCommSession) or remote session it skips them, so the side
        # channel serves there too (as on 1.2.x, which sends none).
        if not state.features.identities_signal or upstream_skips_registration(session):
            ref = weakref.ref(self)

            def on_identities(identities: list[ProcessIdentity]) -> None:
                proxy = ref()
                if proxy is not None and proxy._liveness_register(identities):
                    logger.info("liveness: watching %d worker ranks", len(identities))

            channel = IdentityChannel(on_identities, state.config.identities_timeout_s,
                                      exclude_pids=frozenset({os.getpid()}))
            state.channel = channel
        try:
            me: ProxyIdentity | None = ProxyIdentity.from_sequence(proxy_identity())
        except Exception:
            logger.warning("liveness: could not read the proxy's own identity: no proxy-death watch", exc_info=True)
            me = None
        progress = state.stall.open_channel() if state.stall is not None else None
        if state.hub is None and state.monitor is not None and wants_hub(state.config, session):
            state.hub = start_hub(state.config, state.monitor)
        hub = agent_settings(state.hub) if state.hub is not None else None

        def wrapped_submit(task: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            kwargs[SPEC_KWARG] = WorkerSpec(task, me, channel.spec if channel is not None else None, progress, hub)
            return submit(liveness_worker_entry, *args, **kwargs)

        session.submit = wrapped_submit

        def restore() -> None:
            with contextlib.suppress(AttributeError):
                del session.submit  # back to the class's method

        return restore

    def _liveness_register(self, identities: list[ProcessIdentity]) -> bool:
        monitor = _state(self).monitor
        if monitor is None:
            return False
        try:
            monitor.register(identities)
        except RuntimeError:  # closed meanwhile
            return False
        return True

    def _liveness_abort_start(self) -> None:
        # The constructor fails, so nobody will call shutdown(): stop what was started, bounded.
        with contextlib.suppress(Exception):
            self._liveness_stop_workers()
        self._liveness_release()

    # -- events --------------------------------------------------------------------------

    def _liveness_on_event(self, event: WorkerEvent) -> None:
        state = _state(self)
        error = state.record(event)
        if error is not None:
            run_fatal_path(self, state, error)
        if is_local(event.identity):  # a remote rank's wedge says nothing about this host
            note_unrestartable(state, [event])  # quarantine: a wedge's status, marker and actions
        if state.diagnoser is not None and (error is not None or event.kind is EventKind.WEDGED):
            # After the fatal path, never before it: the snapshot takes a fraction of a second.
            state.diagnoser.request(f"{event.kind.value} of rank {event.identity.rank}",
                                    delay_s=AFTER_FATAL_DELAY_S if error is not None else 0.0)

    def _liveness_expected_exits(self) -> None:
        """A clean stop begins (upstream's pre_shutdown / monitor close, a healthy shutdown()):
        deliver a failure the monitor already knows first, then mark exits as expected."""
        state = _state(self)
        if state.monitor is None or state.fatal is not None or state.expected_exits:
            return
        if getattr(self, "_fatal_error", None) is not None or getattr(self, "_engine_dead", None):
            return  # upstream's own death path is running: not a clean stop
        failure = state.monitor.check()
        if failure is not None:
            self._liveness_on_event(failure)
            return
        if state.begin_expected_exits():
            logger.debug("liveness: clean stop: worker exits from now on are expected")
            if state.hub is not None:
                state.hub.expect_exits()

    # -- overrides -----------------------------------------------------------------------

    def dispatch_result_task(self) -> Any:
        """Upstream's result dispatch (one response batch per call, in its result thread), made
        once a batch can be received; False, which ends the thread, once the engine's dispatch gate
        is closed. Each dispatched batch is progress for the stall timer."""
        state = _state(self)
        gate = state.dispatch_gate
        if gate is None:
            more = super().dispatch_result_task()  # type: ignore[misc]
        else:
            more = gate.dispatch(getattr(self, "result_queue", None), super().dispatch_result_task)  # type: ignore[misc]
        stall = state.stall
        if stall is not None and more:
            stall.note_output()
        return more

    def submit(self, request: Any) -> Any:
        """Upstream's submit; raises the engine-dead error at once after a fatal event, and fails
        a request that registered after the fatal sweep (1.2.x would leave it pending forever).
        Serialized with the fatal path's ``pre_shutdown()`` (``send_lock``): upstream's sockets
        have no lock. A request on an idle engine starts the stall clock."""
        state = _state(self)
        if not state.enabled:
            return super().submit(request)  # type: ignore[misc]
        if state.fatal is not None:
            raise dead_error(self, state.fatal)
        if state.stall is not None:
            # Before upstream registers the request: the timer must never see it pending with
            # the idle engine's old clock.
            state.stall.note_submitted(pending_count(self) == 0)
        acquire_send_lock(self, state)
        try:
            if state.fatal is not None:
                # Became fatal while this call waited for the lock: upstream's send could go to a
                # leader the bounded stop has ended meanwhile (a PAIR put then never returns).
                raise dead_error(self, state.fatal)
            if state.request_socket_owner is None:
                state.request_socket_owner = threading.get_ident()
            result = super().submit(request)  # type: ignore[misc]
            fatal = state.fatal
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
        sentinel, see :func:`._request_socket.quiet_after_fatal`)."""
        state = _state(self)
        if not state.enabled:
            super().pre_shutdown()  # type: ignore[misc]
            return
        self._liveness_expected_exits()
        if not state.pre_shutdown_lock.acquire(timeout=PRE_SHUTDOWN_WAIT_S):
            logger.warning("liveness: pre_shutdown() is still running in another thread; not waiting for it")
            return
        try:
            with state.lock:
                state.pre_shutdown_entries += 1
            if state.fatal is not None and not owns_request_socket(state):
                quiet_after_fatal(state, state.fatal)
            super().pre_shutdown()  # type: ignore[misc]
        finally:
            state.pre_shutdown_lock.release()

    def check_health(self) -> bool:
        """False after a fatal event (checked synchronously too, so a dead watcher loses
        nothing); otherwise upstream's ``check_health`` or, on 1.2.x, ``not is_shutdown()``.
        Non-blocking (one ``poll(0)`` over the pidfds)."""
        state = _state(self)
        if state.enabled and state.monitor is not None:
            if state.fatal is not None:
                return False
            # Act on the monitor's answer here, in this thread: the watcher may have seen the
            # death and not yet delivered it (or be dead). Otherwise upstream's own check below
            # finds the same death first and the liveness fatal error is never recorded.
            failure = state.monitor.check()
            if failure is not None:
                self._liveness_on_event(failure)
                if state.fatal is not None:
                    return False
        parent = getattr(super(), "check_health", None)
        if parent is not None:
            return bool(parent())
        return not self.is_shutdown()  # type: ignore[attr-defined]

    def shutdown(self) -> None:
        """Bounded shutdown: upstream's in a daemon thread, then the remaining workers stopped
        with SIGTERM/SIGKILL and deadlines. Blocks for at most about ``shutdown_grace_s +
        shutdown_term_s + shutdown_kill_s + 2`` seconds; never raises for a dead or wedged rank.
        Idempotent."""
        state = _state(self)
        if not state.enabled or state.monitor is None:
            super().shutdown()  # type: ignore[misc]
            return
        self._liveness_expected_exits()  # a death already known is delivered first
        with state.lock:
            if state.shutdown_started:
                return
            state.shutdown_started = True
            failed = state.fatal is not None
        config = state.config
        owned = self._liveness_owns_session(state)
        if failed:
            state.fatal_done.wait(PRE_SHUTDOWN_WAIT_S)
        else:
            # Workers exiting now are expected: stop the watcher so they are not reported dead.
            state.monitor.stop()
            if zmq_debug() and owns_request_socket(state):
                # Upstream's debug mode raises on a send from a thread that does not own its
                # request socket: this one does, so upstream's pre_shutdown() (stop sentinel,
                # cancellations) runs here; the shutdown() below then finds it done. The engine is
                # healthy, so these sends go to a live leader.
                self.pre_shutdown()
        upstream = threading.Thread(target=self._liveness_upstream_shutdown,
                                    name="trtllm-liveness-upstream-shutdown", daemon=True)
        upstream.start()
        report = None
        if not failed:
            # A healthy engine gets the grace period to stop by itself; a dead world does not.
            deadline = time.monotonic() + config.shutdown_grace_s
            upstream.join(config.shutdown_grace_s)
            if owned:
                self._liveness_wait_exit(deadline)
                report = self._liveness_stop_workers()
                release_upstream_waits(state, report)
            # else: the ranks belong to the caller's session (mpirun's job): they keep serving it
            # after this engine is gone, and are never signalled by a healthy shutdown.
        else:
            report = self._liveness_stop_workers()
            release_upstream_waits(state, report)
        upstream.join(_UPSTREAM_SHUTDOWN_AFTER_STOP_S)
        if upstream.is_alive():
            logger.warning("liveness: upstream shutdown still blocked after the workers were stopped; abandoned")
            self._liveness_abandon_session(state)
        self._liveness_release()
        if state.fatal is None and not (report is not None and report.unkillable):
            mark_clean()
        if report is not None and report.unkillable:
            events = report.events()
            with state.lock:
                if state.fatal is None and events:
                    state.fatal = WorkerFailedError(events[0])
            if events and getattr(self, "_fatal_error", None) is None:
                self._fatal_error = state.fatal

    def _liveness_owns_session(self, state: EngineLiveness) -> bool:
        owns = getattr(self, "_owns_mpi_session", None)
        return owns if isinstance(owns, bool) else state.owns_session

    def _liveness_abandon_session(self, state: EngineLiveness) -> None:
        abandon_session(self, state, self._liveness_owns_session(state))

    def _liveness_wait_exit(self, deadline: float) -> None:
        monitor = _state(self).monitor
        pending = monitor.identities if monitor is not None else []
        while pending and time.monotonic() < deadline:
            pending = [identity for identity in pending if _is_running(identity)]
            if pending:
                time.sleep(0.01)

    def _liveness_upstream_shutdown(self) -> None:
        run_upstream_shutdown(super().shutdown, _state(self))  # type: ignore[misc]

    def _liveness_stop_workers(self) -> StopReport | None:
        from ...stop._bounded_stop import stop_processes

        state = _state(self)
        identities = state.monitor.identities if state.monitor is not None else []
        # Never signal an identity whose start time was not verified (a recycled pid).
        identities = [identity for identity in identities if identity.start_time is not None]
        if not identities and state.hub is None:
            return None
        config = state.config
        remote = stop_remote_hosts(state.hub, config) if state.hub is not None else None
        identities = [identity for identity in identities if is_local(identity)]
        report = stop_processes(identities, grace_s=config.shutdown_term_s, kill_s=config.shutdown_kill_s)
        if remote is not None:
            remote[0].join(config.shutdown_term_s + config.shutdown_kill_s + 2.0)
            state.host_stops = list(remote[1])
        state.shutdown_report = report
        note_unrestartable(state, report.events())  # quarantine: ranks left unkillable by the stop
        return report

    def _liveness_release(self) -> None:
        state = _state(self)
        close_dispatch(state)
        if state.hub is not None:
            with contextlib.suppress(Exception):
                state.hub.close()
        if state.channel is not None:
            state.channel.close()
        if state.stall is not None:
            state.stall.close()
        if state.monitor is not None:
            with contextlib.suppress(Exception):
                state.monitor.close()
        if state.metrics is not None:
            with contextlib.suppress(Exception):
                state.metrics.close()


def _graceful(state: EngineLiveness) -> Callable[[], None]:
    # The guard's graceful action: ONE SIGINT per process, and none once this executor's
    # shutdown() has begun (a SIGINT from trtllm-serve's /health got there first).
    def interrupt() -> None:
        if state.shutdown_started:
            logger.info("liveness: the executor is already shutting down; the exit guard sends no SIGINT")
            return
        if not interrupt_self_once():
            logger.info("liveness: graceful shutdown already requested by another exit guard of this process")

    return interrupt


def _exit_stopping(ref: weakref.ReferenceType[LivenessProxyMixin]) -> Callable[[int], None]:
    # The exit guard's last resort: the workers are not our children (prte spawned them), so
    # nobody else reaps them once this process is gone; stop them first, bounded.
    def exit_now(code: int) -> None:
        proxy = ref()
        if proxy is not None:
            with contextlib.suppress(Exception):
                proxy._liveness_stop_workers()
            code = exit_status(_state(proxy), code)  # quarantine: a rank the stop left unkillable
        wait_for_quarantine()  # the marker of a rank this stop left unkillable must be written first
        os._exit(code)

    return exit_now


def _is_running(identity: ProcessIdentity) -> bool:
    try:
        verify_start_time(identity.pid, identity.start_time)
    except (LivenessError, OSError):
        return False
    return True
