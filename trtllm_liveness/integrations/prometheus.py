"""Prometheus metrics for worker liveness (needs the optional ``prometheus_client`` package).

:class:`LivenessMetrics` subscribes to a :class:`~trtllm_liveness.WorkerProcessMonitor` and exposes:

``trtllm_liveness_worker_state{rank, host, state}`` (gauge)
    1 for the state each rank is in now, 0 for every other state (one series per state, the
    layout of prometheus_client's ``Enum``), so ``trtllm_liveness_worker_state{state="alive"} == 0``
    finds a rank in trouble. Read from the monitor at scrape time: never stale.
``trtllm_liveness_unkillable_workers`` (gauge)
    Ranks in ``D`` with SIGKILL pending now. Non-zero means: recycle the host.
``trtllm_liveness_worker_failures_total{kind}`` (counter)
    Fatal events by kind: ``died``, ``wedged``, ``unkillable``. A wedged rank that then becomes
    unkillable counts once as each. Keeps counting across :meth:`LivenessMetrics.attach` of a new
    monitor (an executor restart).
``trtllm_liveness_detection_latency_seconds{kind}`` (histogram)
    Seconds from a fault whose time is *known to the caller* to the monitor's event for that rank
    (``event.detected_at``, monotonic clock). The fault time comes from
    :meth:`LivenessMetrics.note_fault` (e.g. called just before the executor or a chaos test sends
    SIGKILL) or from the ``fault_time`` callback. Nothing is observed for a fault nobody timed: the
    kernel does not record when a process exited, and a monitor state's ``since`` is the detection
    time itself, so it cannot stand in for the fault time.

A private :class:`prometheus_client.CollectorRegistry` is used by default, so importing or
instantiating this never touches the global registry; pass ``registry=prometheus_client.REGISTRY``
(or ``use_default_registry=True``) to expose the metrics with the process's other metrics.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

try:
    import prometheus_client
    from prometheus_client import CollectorRegistry, Counter, Histogram
    from prometheus_client.core import GaugeMetricFamily
    from prometheus_client.registry import Collector
except ImportError as _exc:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(
        "trtllm_liveness.integrations.prometheus needs the optional 'prometheus_client' package: "
        "pip install 'trtllm-liveness[metrics]' (or pip install prometheus_client)"
    ) from _exc

from .._events import EventKind, RankStatus, WorkerEvent, WorkerState
from .._identity import ProcessIdentity
from .._monitor import WorkerProcessMonitor

logger = logging.getLogger(__name__)

__all__ = ["DETECTION_LATENCY_BUCKETS", "LivenessMetrics"]

# Detection is sub-millisecond with pidfds and up to seconds with polling peers (Dynamo 0.5/2 s,
# upstream's 5 s loop): the buckets span both so the comparison shows in one histogram.
DETECTION_LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)

FaultTime = Callable[[WorkerEvent], "float | None"]


class _StateCollector(Collector):
    """Builds the state gauges from the attached monitor at each scrape."""

    def __init__(self, owner: LivenessMetrics) -> None:
        self._owner = owner

    def describe(self) -> Iterable[Any]:
        return self._families()

    def collect(self) -> Iterable[Any]:
        families = self._families()
        state, unkillable = families
        count = 0
        for status in self._owner.statuses():
            rank, host = str(status.identity.rank), status.identity.hostname
            for candidate in WorkerState:
                state.add_metric([rank, host, candidate.value], 1.0 if status.state is candidate else 0.0)
            count += status.state is WorkerState.UNKILLABLE
        unkillable.add_metric([], float(count))
        return families

    @staticmethod
    def _families() -> list[GaugeMetricFamily]:
        return [
            GaugeMetricFamily(
                "trtllm_liveness_worker_state",
                "1 for the state each worker rank is in now, 0 for the other states",
                labels=["rank", "host", "state"],
            ),
            GaugeMetricFamily(
                "trtllm_liveness_unkillable_workers",
                "Worker ranks in uninterruptible sleep (D) with SIGKILL pending; non-zero: recycle the host",
            ),
        ]


class LivenessMetrics:
    """Prometheus metrics fed by one :class:`~trtllm_liveness.WorkerProcessMonitor` at a time.

    Events arrive in the monitor's watcher thread (or the thread that called ``check``); the
    counter and histogram are updated there, which takes microseconds and never blocks. The state
    gauges are computed at scrape time from ``monitor.statuses()`` (one short lock of the
    monitor). All methods are thread-safe.

    Args:
        monitor: attach to this monitor at once (see :meth:`attach`).
        registry: where to register the metrics; default a new private ``CollectorRegistry``.
        use_default_registry: register in ``prometheus_client.REGISTRY`` instead (only one
            ``LivenessMetrics`` may do so per process: metric names must be unique there).
        fault_time: optional ``callback(event) -> monotonic time of the fault or None``, consulted
            when :meth:`note_fault` gave no time for the event's rank.

    Raises ``ValueError`` (from prometheus_client) if the registry already has these metric names.
    """

    def __init__(
        self,
        monitor: WorkerProcessMonitor | None = None,
        *,
        registry: CollectorRegistry | None = None,
        use_default_registry: bool = False,
        fault_time: FaultTime | None = None,
    ) -> None:
        if registry is not None and use_default_registry:
            raise ValueError("give either registry or use_default_registry, not both")
        if registry is None:
            registry = prometheus_client.REGISTRY if use_default_registry else CollectorRegistry(auto_describe=True)
        self.registry: CollectorRegistry = registry
        self._fault_time = fault_time
        self._lock = threading.Lock()
        self._monitor: WorkerProcessMonitor | None = None
        self._faults: dict[int, float] = {}
        self._counted: set[tuple[ProcessIdentity, EventKind]] = set()
        self._collector = _StateCollector(self)
        self._failures = Counter(
            "trtllm_liveness_worker_failures",
            "Fatal worker events by kind: died, wedged (D past the timeout), unkillable (SIGKILL pending in D)",
            ["kind"],
            registry=None,
        )
        self._latency = Histogram(
            "trtllm_liveness_detection_latency_seconds",
            "Seconds from a fault timed by the caller (e.g. SIGKILL sent) to the monitor's event",
            ["kind"],
            buckets=DETECTION_LATENCY_BUCKETS,
            registry=None,
        )
        for kind in EventKind:
            # Export zeroes from the start: a rate() over a series that appears at the first
            # failure misses that failure.
            self._failures.labels(kind.value)
            self._latency.labels(kind.value)
        registered: list[Any] = []
        try:
            for collector in (self._failures, self._latency, self._collector):
                registry.register(collector)
                registered.append(collector)
        except ValueError:
            for collector in registered:
                registry.unregister(collector)
            raise
        if monitor is not None:
            self.attach(monitor)

    # ----------------------------------------------------------------- wiring

    def attach(self, monitor: WorkerProcessMonitor) -> None:
        """Subscribe to ``monitor``, replacing the monitor attached before (e.g. after a restart).

        A monitor that has already failed reports its first fatal event at once. Counters keep
        their values; an event already counted for the same identity and kind is not counted
        twice. Does not block beyond the monitor's lock.
        """
        with self._lock:
            previous, self._monitor = self._monitor, monitor
        if previous is not None and previous is not monitor:
            previous.unsubscribe(self._on_event)
        if previous is not monitor:
            monitor.subscribe(self._on_event)

    def detach(self) -> None:
        """Stop listening to the attached monitor; its ranks disappear from the state gauge."""
        with self._lock:
            previous, self._monitor = self._monitor, None
        if previous is not None:
            previous.unsubscribe(self._on_event)

    def close(self) -> None:
        """Detach and unregister every metric from the registry. Idempotent."""
        self.detach()
        for collector in (self._failures, self._latency, self._collector):
            try:
                self.registry.unregister(collector)
            except KeyError:
                pass  # already unregistered

    def start_http_server(self, port: int = 0, addr: str = "127.0.0.1") -> tuple[Any, threading.Thread]:
        """Serve this registry at ``http://addr:port/metrics`` from a daemon thread.

        ``port=0`` picks a free port (read it from ``server.server_port``). Binds loopback by
        default; pass ``addr="0.0.0.0"`` to let a Prometheus server on another host scrape it.
        Returns prometheus_client's ``(server, thread)``; stop with ``server.shutdown()`` then
        ``server.server_close()``. Raises ``OSError`` if the address cannot be bound.
        """
        server, thread = prometheus_client.start_http_server(port, addr=addr, registry=self.registry)
        return server, thread

    # ----------------------------------------------------------------- inputs

    def note_fault(self, rank: int, at: float | None = None) -> None:
        """Record that a fault hit ``rank`` at monotonic time ``at`` (default: now).

        The next event for that rank observes ``event.detected_at - at`` in the latency
        histogram. Call it right before sending the signal (or injecting the fault), not after.
        """
        with self._lock:
            self._faults[rank] = time.monotonic() if at is None else at

    def statuses(self) -> list[RankStatus]:
        """The attached monitor's per-rank statuses (empty when none is attached)."""
        with self._lock:
            monitor = self._monitor
        return [] if monitor is None else monitor.statuses()

    def _on_event(self, event: WorkerEvent) -> None:
        key = (event.identity, event.kind)
        with self._lock:
            if key in self._counted:
                return
            self._counted.add(key)
            fault_at = self._faults.pop(event.identity.rank, None)
        self._failures.labels(event.kind.value).inc()
        if fault_at is None and self._fault_time is not None:
            try:
                fault_at = self._fault_time(event)
            except Exception:
                logger.exception("fault_time callback raised; no latency recorded for %s", event.identity.describe())
                fault_at = None
        if fault_at is None:
            return
        latency = event.detected_at - fault_at
        if latency < 0:
            # The fault was noted after the detection: a caller bug, not a negative latency.
            logger.debug("fault time for %s is after its detection; latency not recorded", event.identity.describe())
            return
        self._latency.labels(event.kind.value).observe(latency)
