"""Dynamo integration: a worker's ``/health`` and ``/live`` turn 503 the moment a rank dies.

Stock Dynamo polls the engine (``check_health`` every 2 s, ``_fatal_error`` every 0.5 s). This
bridge is event-driven instead: it subscribes to the :class:`~trtllm_liveness.WorkerProcessMonitor`
and, in the watcher thread, right after the kernel reports the death or the wedge:

1. ``runtime.set_health_status(False)``: the system status server answers 503 on ``/health`` and
   ``/live`` from now on, so the orchestrator stops routing here;
2. starts ``runtime.shutdown()`` once (graceful: the etcd lease is revoked, in-flight streams end);
3. ends the process with a non-zero status if that has not finished within ``shutdown_timeout_s``
   (and turns a clean exit of the main program into that status too: never 0 after an engine death).

It also serves the per-rank status as JSON at ``/engine/<route>`` (default ``/engine/liveness``).
Works with the ``ai-dynamo-runtime`` package (tested with 1.6.1); it is passed in, never imported
here, so this module imports without Dynamo installed.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any, Protocol

from .._events import WorkerEvent
from .._exit_guard import FatalExitGuard
from .._monitor import WorkerProcessMonitor

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
            extension, its ``liveness_monitor``).
        route: name under ``/engine/`` for the JSON status, or None for no route.
        shutdown_timeout_s: bound on the graceful runtime shutdown before the process is ended.
        exit_code: non-zero status of the process after a fatal event.
        exit_fn: how to end the process (``os._exit``); replaceable for tests.

    Call :meth:`attach` once the runtime exists (before or after serving starts). Thread-safe.
    """

    def __init__(
        self,
        runtime: RuntimeLike,
        monitor: WorkerProcessMonitor,
        *,
        route: str | None = "liveness",
        shutdown_timeout_s: float = 10.0,
        exit_code: int = 1,
        exit_fn: Callable[[int], object] = os._exit,
    ) -> None:
        self._runtime = runtime
        self._monitor = monitor
        self._route = route
        self._guard = FatalExitGuard(
            graceful=self._shutdown_runtime, timeout_s=shutdown_timeout_s, exit_code=exit_code, exit_fn=exit_fn
        )
        self._attached = False

    @property
    def guard(self) -> FatalExitGuard:
        """The exit guard; ``guard.triggered`` tells whether the engine died."""
        return self._guard

    def attach(self) -> None:
        """Register the status route and subscribe to the monitor. Idempotent.

        If the monitor has already failed, the reaction happens at once, in this thread.
        """
        if self._attached:
            return
        self._attached = True
        if self._route is not None:
            self._runtime.register_engine_route(self._route, self._serve_status)
        self._monitor.subscribe(self._on_event)

    def status(self) -> dict[str, Any]:
        """The JSON document served at ``/engine/<route>``."""
        failure = self._monitor.failure
        return {
            "healthy": failure is None,
            "failure": None if failure is None else failure.to_dict(),
            "restartable": True if failure is None else failure.restartable,
            "ranks": [status.to_dict() for status in self._monitor.statuses()],
        }

    async def _serve_status(self, body: dict[str, Any]) -> dict[str, Any]:
        return self.status()

    def _on_event(self, event: WorkerEvent) -> None:
        # Health first: it is one call into the runtime and what the orchestrator acts on.
        try:
            self._runtime.set_health_status(False)
        except Exception:
            logger.exception("could not set Dynamo health status to not ready")
        self._guard.trigger(event)

    def _shutdown_runtime(self) -> None:
        logger.warning("engine failed; shutting the Dynamo runtime down")
        self._runtime.shutdown()
