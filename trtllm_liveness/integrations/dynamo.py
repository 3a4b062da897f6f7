"""Dynamo integration: a worker's ``/health`` and ``/live`` turn 503 the moment a rank dies.

Stock Dynamo polls the engine (``check_health`` every 2 s, ``_fatal_error`` every 0.5 s). This
bridge is event-driven instead: it subscribes to the :class:`~trtllm_liveness.monitor.WorkerProcessMonitor`
and, in the watcher thread, right after the kernel reports the death or the wedge:

1. ``runtime.set_health_status(False)``: the system status server answers 503 on ``/health`` and
   ``/live`` from now on, so the orchestrator stops routing here;
2. starts ``runtime.shutdown()`` once (graceful: the etcd lease is revoked, in-flight streams end);
3. ends the process with a non-zero status if that has not finished within ``shutdown_timeout_s``
   (and turns a clean exit of the main program into that status too: never 0 after an engine death).

It also serves the per-rank status as JSON at ``/engine/<route>`` (default ``/engine/liveness``):
``healthy``, ``failure``, ``restartable``, ``ranks`` (each rank's state, ``stalled`` while the engine
is stalled), and, when the bridge knows the executor (:func:`attach_to_dynamo` does), ``stall`` (the
stall under way, or null) and ``diagnosis`` (the latest snapshot of every rank: activity, wait
channels, Python stacks, the odd rank out; taken at a stall, a wedge and every fatal error).
:func:`attach_to_dynamo` finds the monitor of a liveness-enabled executor (or of an ``LLM``
holding one in ``_executor``) and attaches a bridge in one call.

docs/dynamo.md says what stock Dynamo gets without this module, what it adds, and what both entry
points do with liveness switched off (an inert bridge, :attr:`DynamoLivenessBridge.active` False;
no metrics registered); docs/metrics.md says how :func:`expose_metrics_on_dynamo` reaches the system
status server's ``/metrics`` and when ``LivenessMetrics(use_default_registry=True)`` is used instead.
Works with the ``ai-dynamo-runtime`` package (tested with 1.6.1); it is passed in, never imported
here, so this module imports without Dynamo installed.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from .._events import WorkerEvent
from ..exit._exit_guard import DEFAULT_EXIT_CODE_UNRESTARTABLE, FatalExitGuard
from ..monitor._monitor import WorkerProcessMonitor

__all__ = [
    "DynamoLivenessBridge", "RuntimeLike", "attach_to_dynamo", "expose_metrics_on_dynamo", "liveness_monitor_of",
]

logger = logging.getLogger(__name__)


class RuntimeLike(Protocol):
    """The part of ``dynamo.runtime.DistributedRuntime`` this bridge uses."""

    def set_health_status(self, ready: bool) -> None: ...

    def shutdown(self) -> None: ...

    def register_engine_route(self, route_name: str, callback: Any) -> None: ...


class DynamoLivenessBridge:
    """Connect a liveness monitor to a Dynamo ``DistributedRuntime``.

    Args:
        runtime: the worker's ``DistributedRuntime``.
        monitor: the monitor watching the engine's ranks (for an executor with the TensorRT-LLM
            extension, its ``liveness_monitor``); None makes an inert bridge (liveness off):
            :meth:`attach` does nothing, :meth:`status` says healthy with no ranks, ``guard`` is None.
        route: name under ``/engine/`` for the JSON status, or None for no route.
        shutdown_timeout_s: bound on the graceful runtime shutdown before the process is ended
            (counted from the fatal event, so it includes ``shutdown_delay_s``).
        shutdown_delay_s: seconds between the 503 and the start of the runtime shutdown, so
            probes and operators can still read ``/health`` and the JSON route; 0 = at once.
        exit_code: non-zero status of the process after a fatal event.
        exit_code_unrestartable: the status instead after a non-restartable one (a wedged or
            unkillable rank: do not restart on this host); default 69.
        exit_fn: how to end the process (``os._exit``); replaceable for tests.
        executor: the liveness executor (or an object holding it in ``_executor``), for the stall
            and diagnosis fields of the JSON route; None leaves them out.

    Call :meth:`attach` once the runtime exists (before or after serving starts). Thread-safe.
    """

    def __init__(
        self,
        runtime: RuntimeLike,
        monitor: WorkerProcessMonitor | None,
        *,
        route: str | None = "liveness",
        shutdown_timeout_s: float = 10.0,
        shutdown_delay_s: float = 0.0,
        exit_code: int = 1,
        exit_fn: Callable[[int], object] = os._exit,
        exit_code_unrestartable: int = DEFAULT_EXIT_CODE_UNRESTARTABLE,
        executor: Any = None,
    ) -> None:
        self._executor = _liveness_executor_of(executor)
        if shutdown_delay_s < 0 or shutdown_delay_s > shutdown_timeout_s:
            raise ValueError("shutdown_delay_s must be in [0, shutdown_timeout_s]")
        self._shutdown_delay_s = shutdown_delay_s
        self._runtime = runtime
        self._monitor = monitor
        self._route = route
        # An inert bridge makes no guard: the guard's process ending registers an exit hook.
        self._guard = None if monitor is None else FatalExitGuard(
            graceful=self._shutdown_runtime, timeout_s=shutdown_timeout_s, exit_code=exit_code, exit_fn=exit_fn,
            exit_code_unrestartable=exit_code_unrestartable,
        )
        self._attached = False
        self._attach_lock = threading.Lock()

    @property
    def active(self) -> bool:
        """False for an inert bridge (liveness off: no monitor), which does nothing."""
        return self._monitor is not None

    @property
    def guard(self) -> FatalExitGuard | None:
        """The exit guard; ``guard.triggered`` tells whether the engine died. None when inert."""
        return self._guard

    def attach(self) -> None:
        """Register the status route and subscribe to the monitor. Idempotent; nothing for an
        inert bridge.

        If the monitor has already failed, the reaction happens at once, in this thread.
        """
        with self._attach_lock:  # the class is thread-safe: two racing attach() calls attach once
            if self._attached or self._monitor is None:
                return
            self._attached = True
        if self._route is not None:
            self._runtime.register_engine_route(self._route, self._serve_status)
        self._monitor.subscribe(self._on_event)

    def status(self) -> dict[str, Any]:
        """The JSON document served at ``/engine/<route>`` (an inert bridge serves none: healthy,
        no ranks; an observing engine's verdicts are lines, not failures: healthy)."""
        monitor = self._monitor
        failure = None if monitor is None or _observes(self._executor) else monitor.failure
        document: dict[str, Any] = {
            "healthy": failure is None,
            "failure": None if failure is None else failure.to_dict(),
            "restartable": True if failure is None else failure.restartable,
            "ranks": [] if monitor is None else [status.to_dict() for status in monitor.statuses()],
        }
        executor = self._executor
        if executor is not None:
            from .trtllm._state import stall_under_way  # an executor's integration is loaded already

            stall = stall_under_way(executor)
            diagnosis = executor.liveness_diagnosis()
            document["stall"] = None if stall is None else stall.to_dict()
            document["diagnosis"] = None if diagnosis is None else diagnosis.to_dict(include_scan=False)
        return document

    async def _serve_status(self, body: dict[str, Any]) -> dict[str, Any]:
        return self.status()

    def _on_event(self, event: WorkerEvent) -> None:
        if _observes(self._executor):
            return  # the engine's own "would fail" line is the whole reaction
        # Health first: it is one call into the runtime and what the orchestrator acts on.
        try:
            self._runtime.set_health_status(False)
        except Exception:
            logger.exception("could not set Dynamo health status to not ready")
        if self._guard is not None:
            self._guard.trigger(event)

    def _shutdown_runtime(self) -> None:
        # Runs in the guard's daemon thread: sleeping here delays nothing but the shutdown.
        if self._shutdown_delay_s > 0:
            time.sleep(self._shutdown_delay_s)
        logger.warning("engine failed; shutting the Dynamo runtime down")
        self._runtime.shutdown()


def _held(engine: Any) -> Iterator[Any]:
    """``engine``, then the object it holds in ``_executor`` (else ``executor``), and so on: at most
    4, none twice."""
    seen: list[Any] = []
    candidate = engine
    while candidate is not None and len(seen) < 4 and not any(candidate is s for s in seen):
        yield candidate
        seen.append(candidate)
        candidate = getattr(candidate, "_executor", None) or getattr(candidate, "executor", None)


def _liveness_executor_of(engine: Any) -> Any:
    """The liveness executor behind ``engine`` (itself, ``_executor`` or ``executor``), or None."""
    return next((candidate for candidate in _held(engine) if callable(getattr(candidate, "liveness_diagnosis", None))
                 and hasattr(candidate, "liveness_state")), None)


def _observes(engine: Any) -> bool:
    """Whether the liveness executor behind ``engine`` observes (``observe=1``): its verdicts are
    lines, not failures."""
    return bool(getattr(getattr(_liveness_executor_of(engine), "liveness_config", None), "observe", False))


def liveness_monitor_of(engine: Any) -> WorkerProcessMonitor:
    """The :class:`~trtllm_liveness.monitor.WorkerProcessMonitor` behind ``engine``.

    ``engine`` may be the monitor itself, an executor with the TensorRT-LLM extension on (its
    ``liveness_monitor``), or an object holding one in ``_executor`` (TensorRT-LLM's ``LLM``) or
    ``executor``. Raises ``ValueError`` when none is found (the extension is off or the object is
    something else). Non-blocking.
    """
    for candidate in _held(engine):
        if isinstance(candidate, WorkerProcessMonitor):
            return candidate
        monitor = getattr(candidate, "liveness_monitor", None)
        if isinstance(monitor, WorkerProcessMonitor):
            return monitor
    raise ValueError(
        f"{type(engine).__name__} has no liveness monitor: is the TensorRT-LLM liveness extension enabled?"
    )


def _monitor_unless_off(engine: Any, entry: str) -> WorkerProcessMonitor | None:
    """:func:`liveness_monitor_of` ``engine``, or None (one INFO line naming ``entry``) when it has
    none because ``TRTLLM_WORKER_LIVENESS`` switches liveness off; raises its ``ValueError`` while
    the switch is on, or holds a value an engine start would have refused (then the missing
    monitor is the caller's error, not the switch)."""
    from .._config import ENV_VAR, parse_value

    try:
        return liveness_monitor_of(engine)
    except ValueError as missing:
        raw = os.environ.get(ENV_VAR)
        try:
            switched_on = parse_value(raw).enabled
        except ValueError:
            raise missing from None
        if switched_on:
            raise
    logger.info("liveness: off (%s %s): %s does nothing", ENV_VAR, "unset" if raw is None else repr(raw), entry)
    return None


def attach_to_dynamo(
    engine: Any,
    runtime: RuntimeLike,
    *,
    route: str | None = "liveness",
    shutdown_timeout_s: float = 10.0,
    shutdown_delay_s: float = 0.0,
    exit_code: int = 1,
    exit_fn: Callable[[int], object] = os._exit,
    exit_code_unrestartable: int = DEFAULT_EXIT_CODE_UNRESTARTABLE,
) -> DynamoLivenessBridge:
    """Build a :class:`DynamoLivenessBridge` for ``engine`` (see :func:`liveness_monitor_of`),
    attach it and return it. The keyword arguments are the bridge's.

    Call it once the executor has started, from the thread that owns the runtime (usually the
    event loop's). With liveness switched off (``TRTLLM_WORKER_LIVENESS`` unset, a false word or
    ``enabled=0``) and no monitor on ``engine``, returns an inert bridge (``active`` False) that
    touches nothing, with one INFO line. Raises ``ValueError`` when ``engine`` has no liveness
    monitor while the switch is on. If the engine has already failed, the worker turns unhealthy
    and starts its shutdown at once.
    """
    monitor = _monitor_unless_off(engine, "attach_to_dynamo")
    bridge = DynamoLivenessBridge(
        runtime, monitor, route=route, shutdown_timeout_s=shutdown_timeout_s,
        shutdown_delay_s=shutdown_delay_s, exit_code=exit_code, exit_fn=exit_fn,
        exit_code_unrestartable=exit_code_unrestartable, executor=engine,
    )
    bridge.attach()
    return bridge


def expose_metrics_on_dynamo(endpoint: Any, metrics: Any) -> Any:
    """Show liveness metrics on Dynamo's system ``/metrics`` (the port of ``DYN_SYSTEM_PORT``).

    ``endpoint``: a ``dynamo.runtime`` ``Endpoint`` of this worker (``runtime.endpoint("ns.comp.ep")``,
    the one it serves). ``metrics``: a
    :class:`~trtllm_liveness.integrations.prometheus.LivenessMetrics`, or anything
    :func:`liveness_monitor_of` accepts (then a new ``LivenessMetrics`` with a private registry is
    attached to its monitor). Registers a callback that renders that registry at each scrape
    (microseconds: one short lock of the monitor); returns the ``LivenessMetrics``. Call it once
    per worker, before or after ``serve_endpoint``. Needs ``prometheus_client``; raises
    ``ImportError`` without it, ``ValueError`` when ``metrics`` has no liveness monitor, and
    ``TypeError`` when ``endpoint`` has no ``metrics.register_prometheus_expfmt_callback``.
    With liveness switched off and no monitor on ``metrics``: registers nothing, needs nothing,
    returns None (one INFO line).
    """
    register = getattr(getattr(endpoint, "metrics", None), "register_prometheus_expfmt_callback", None)
    if not callable(register):
        raise TypeError(
            f"{type(endpoint).__name__} has no metrics.register_prometheus_expfmt_callback: "
            "pass an Endpoint of ai-dynamo-runtime (runtime.endpoint(...))"
        )
    monitor: WorkerProcessMonitor | None = None
    loaded = sys.modules.get(f"{__package__}.prometheus")  # a LivenessMetrics exists only once it is
    if loaded is None or not isinstance(metrics, loaded.LivenessMetrics):
        monitor = _monitor_unless_off(metrics, "expose_metrics_on_dynamo")
        if monitor is None:
            return None
    from .prometheus import LivenessMetrics  # optional dependency: imported only when asked for

    liveness = metrics if isinstance(metrics, LivenessMetrics) else LivenessMetrics(monitor, observe=_observes(metrics))

    def render() -> str:
        # Runs in Dynamo's scrape path: an exception there would fail the whole /metrics page.
        try:
            return liveness.exposition()
        except Exception:
            logger.exception("could not render liveness metrics for Dynamo's /metrics")
            return ""

    register(render)
    return liveness
