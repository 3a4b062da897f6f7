"""Prometheus metrics for worker liveness (needs the optional ``prometheus_client`` package).

:class:`LivenessMetrics` subscribes to a :class:`~trtllm_liveness.monitor.WorkerProcessMonitor` and exports
five families. docs/metrics.md lists every family, label and label value, what each latency
``origin`` measures, and on which server page (Dynamo, trtllm-serve, your own) the metrics appear.

Facts of the code that page does not carry:

- ``trtllm_liveness_worker_state`` has one series per state (the layout of prometheus_client's
  ``Enum``), so ``trtllm_liveness_worker_state{state="alive"} == 0`` finds a rank in trouble.
- The fault time of each ``origin`` comes from the event: ``exit_seen`` is its ``detected_at``;
  ``d_state_start``, ``last_progress`` and ``last_heard`` are its ``fault_at``. Events handed over
  late (attaching to a monitor that had already failed) observe no latency: the delay would be
  the attach's, not the monitor's.
- By default a private :class:`prometheus_client.CollectorRegistry` is used, so importing or
  instantiating this never touches the global registry.
- trtllm-serve's ``/prometheus/metrics`` reads only the files under ``PROMETHEUS_MULTIPROC_DIR``:
  a collector in a registry never reaches it. In multiprocess mode (:func:`multiprocess_mode_active`)
  the values are written to those files as well, the state gauges refreshed on every event and
  every ``refresh_interval_s`` by a daemon thread.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

try:
    import prometheus_client
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, values
    from prometheus_client.core import GaugeMetricFamily
    from prometheus_client.registry import Collector
except ImportError as _exc:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(
        "trtllm_liveness.integrations.prometheus needs the optional 'prometheus_client' package: "
        "pip install 'trtllm-liveness[metrics]' (or pip install prometheus_client)"
    ) from _exc

from .._events import EventKind, RankStatus, WorkerEvent, WorkerState
from ..monitor._monitor import WorkerProcessMonitor
from ..process._identity import ProcessIdentity

logger = logging.getLogger(__name__)

__all__ = ["DETECTION_LATENCY_BUCKETS", "LATENCY_ORIGINS", "LivenessMetrics", "multiprocess_mode_active"]

# Detection is sub-millisecond with pidfds and up to seconds with polling peers (Dynamo 0.5/2 s,
# upstream's 5 s loop) or a D-state timeout: the buckets span both so one histogram shows both.
DETECTION_LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0,
)

# The (kind, origin) pairs the latency histogram can have; each is exported from the start.
LATENCY_ORIGINS: dict[EventKind, tuple[str, ...]] = {
    EventKind.DIED: ("noted", "exit_seen"),
    EventKind.WEDGED: ("noted", "d_state_start"),
    EventKind.UNKILLABLE: ("noted", "d_state_start"),
    EventKind.STALLED: ("noted", "last_progress"),
    EventKind.LOST: ("noted", "last_heard"),
}

FaultTime = Callable[[WorkerEvent], "float | None"]

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
REFRESHER_JOIN_S = 1.0
"""How long ``close()`` waits for the refresh thread (woken at once; one refresh's file reads at most)."""

# The counters by kind: the failures, then the verdicts an observing engine did not act on.
_COUNTERS = (
    ("trtllm_liveness_worker_failures",
     "Fatal worker events by kind: died, wedged (D past the timeout), unkillable (SIGKILL pending in D)"),
    ("trtllm_liveness_would_fail",
     "Verdicts an observing engine (observe=1) did not act on, by kind: what enforcing would have failed"),
)
# The state gauges (name, help, labels): built at each scrape, and mirrored in the multiprocess files.
_STATE_GAUGES: tuple[tuple[str, str, list[str]], ...] = (
    ("trtllm_liveness_worker_state", "1 for the state each worker rank is in now, 0 for the other states",
     ["rank", "host", "state"]),
    ("trtllm_liveness_unkillable_workers",
     "Worker ranks in uninterruptible sleep (D) with SIGKILL pending; non-zero: recycle the host", []),
)


def multiprocess_mode_active() -> bool:
    """Whether prometheus_client writes metric values to files under ``PROMETHEUS_MULTIPROC_DIR``.

    prometheus_client decides this once, when it is first imported, from the environment: setting
    the variable later changes nothing in this process.
    """
    return values.ValueClass is not values.MutexValue


class _LivenessCollector(Collector):
    """Every liveness family: the counters and the histogram (``metrics``), then the state gauges,
    built from the attached monitor at each scrape. One collector, so that registering the
    families is all or nothing and unregistering them one call."""

    def __init__(self, owner: LivenessMetrics, metrics: tuple[Any, ...]) -> None:
        self._owner = owner
        self._metrics = metrics

    def describe(self) -> Iterable[Any]:
        return [family for metric in self._metrics for family in metric.describe()] + self._families()

    def collect(self) -> Iterable[Any]:
        families = self._families()
        state, unkillable = families
        statuses = self._owner.statuses()
        for status in statuses:
            rank, host = str(status.identity.rank), status.identity.hostname
            for candidate in WorkerState:
                state.add_metric([rank, host, candidate.value], 1.0 if status.state is candidate else 0.0)
        unkillable.add_metric([], float(_unkillable_count(statuses)))
        return [family for metric in self._metrics for family in metric.collect()] + families

    @staticmethod
    def _families() -> list[GaugeMetricFamily]:
        return [GaugeMetricFamily(name, text, labels=labels) for name, text, labels in _STATE_GAUGES]


def _unkillable_count(statuses: list[RankStatus]) -> int:
    return sum(status.state is WorkerState.UNKILLABLE for status in statuses)


class _FileStateGauges:
    """The state gauges as file-backed values, for a ``MultiProcessCollector`` (multiprocess mode).

    A ``MultiProcessCollector`` reads only what metrics wrote to files, so the scrape-time
    collector is invisible to it; these gauges mirror it. Never registered in a registry (the
    collector already serves these names there). ``livemax``: one process writes them; ``max``
    keeps a single series without a ``pid`` label. Label series cannot be removed in
    multiprocess mode, so a rank that disappears is set to 0 in every state.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state, self._unkillable = (Gauge(name, text, labels, registry=None, multiprocess_mode="livemax")
                                         for name, text, labels in _STATE_GAUGES)
        self._unkillable.set(0)
        self._unkillable_written = 0
        # Each series' last written state (None: 0 in every state). A gauge is written only when
        # its value changes: each write takes the file's lock and mmap, and the refresh thread
        # calls ``sync`` every ``refresh_interval_s`` on an engine whose states rarely change.
        self._written: dict[tuple[str, str], WorkerState | None] = {}

    def sync(self, statuses: list[RankStatus]) -> None:
        with self._lock:
            wanted: dict[tuple[str, str], WorkerState | None] = dict.fromkeys(self._written)
            for status in statuses:
                wanted[(str(status.identity.rank), status.identity.hostname)] = status.state
            for key, state in wanted.items():
                if key in self._written and self._written[key] is state:
                    continue
                for candidate in WorkerState:
                    self._state.labels(*key, candidate.value).set(1.0 if state is candidate else 0.0)
                self._written[key] = state
            unkillable = _unkillable_count(statuses)
            if unkillable != self._unkillable_written:
                self._unkillable.set(unkillable)
                self._unkillable_written = unkillable


class LivenessMetrics:
    """Prometheus metrics fed by one :class:`~trtllm_liveness.monitor.WorkerProcessMonitor` at a time.

    Events arrive in the monitor's watcher thread (or the thread that called ``check``); the
    counter and histogram are updated there, which takes microseconds and never blocks. The state
    gauges are computed at scrape time from ``monitor.statuses()`` (one short lock of the
    monitor) and, in multiprocess mode, also written to the metric files (see the module
    docstring). All methods are thread-safe.

    Args:
        monitor: attach to this monitor at once (see :meth:`attach`).
        registry: where to register the metrics; default a new private ``CollectorRegistry``.
        use_default_registry: register in ``prometheus_client.REGISTRY`` instead (only one
            ``LivenessMetrics`` may do so per process: metric names must be unique there).
        fault_time: optional ``callback(event) -> monotonic time of the fault or None``, consulted
            when :meth:`note_fault` gave no time for the event's rank (origin ``noted``).
        refresh_interval_s: in multiprocess mode, how often the file-backed state gauges are
            re-read from the monitor (transitions without an event: a rank leaving ``D``, exits
            after a shutdown began). Positive.
        observe: the engine observes (``observe=1``): its verdicts count in
            ``trtllm_liveness_would_fail_total``, not as failures (nothing failed).

    Raises ``ValueError`` (from prometheus_client) if the registry already has these metric names,
    or for a non-positive ``refresh_interval_s``. In one process, create at most one instance
    while in multiprocess mode (the files hold one value per metric name and labels).
    """

    def __init__(
        self,
        monitor: WorkerProcessMonitor | None = None,
        *,
        registry: CollectorRegistry | None = None,
        use_default_registry: bool = False,
        fault_time: FaultTime | None = None,
        refresh_interval_s: float = 1.0,
        observe: bool = False,
    ) -> None:
        if registry is not None and use_default_registry:
            raise ValueError("give either registry or use_default_registry, not both")
        if not refresh_interval_s > 0:
            raise ValueError("refresh_interval_s must be positive")
        if registry is None:
            registry = prometheus_client.REGISTRY if use_default_registry else CollectorRegistry(auto_describe=True)
        self.registry: CollectorRegistry = registry
        self._fault_time = fault_time
        self._refresh_interval_s = refresh_interval_s
        self._lock = threading.Lock()
        self._monitor: WorkerProcessMonitor | None = None
        self._attached_at = 0.0
        self._faults: dict[int, float] = {}
        self._counted: set[tuple[ProcessIdentity, EventKind]] = set()
        self._observe = observe
        self._failures, self._would_fail = (Counter(name, text, ["kind"], registry=None) for name, text in _COUNTERS)
        self._latency = Histogram(
            "trtllm_liveness_detection_latency_seconds",
            "Seconds from a worker fault to the delivery of the monitor's event; origin: where the fault time "
            "came from (noted by the caller, exit_seen by the monitor, d_state_start seen by the monitor)",
            ["kind", "origin"],
            buckets=DETECTION_LATENCY_BUCKETS,
            registry=None,
        )
        for kind in EventKind:
            # Export zeroes from the start: a rate() over a series that appears at the first
            # failure misses that failure.
            self._failures.labels(kind.value)
            self._would_fail.labels(kind.value)
            for origin in LATENCY_ORIGINS[kind]:
                self._latency.labels(kind.value, origin)
        self._collector = _LivenessCollector(self, (self._failures, self._would_fail, self._latency))
        registry.register(self._collector)
        self._files: _FileStateGauges | None = None
        self._stop = threading.Event()
        self._refresher: threading.Thread | None = None
        if multiprocess_mode_active():
            self._files = _FileStateGauges()
            self._refresher = threading.Thread(target=self._refresh_loop, name="trtllm-liveness-metrics",
                                               daemon=True)
            self._refresher.start()
        elif os.environ.get(MULTIPROC_ENV):
            # The variable came after prometheus_client's import: no value of this process (ours or
            # anybody's) reaches a MultiProcessCollector such as trtllm-serve's /prometheus/metrics.
            logger.warning(
                "%s is set but prometheus_client was imported before it was: liveness metrics (and every other "
                "metric of this process) will not appear on a multiprocess endpoint such as trtllm-serve's "
                "/prometheus/metrics; set %s in the environment the process starts with",
                MULTIPROC_ENV, MULTIPROC_ENV,
            )
        if monitor is not None:
            self.attach(monitor)

    # ----------------------------------------------------------------- wiring

    @property
    def multiprocess(self) -> bool:
        """Whether the values also go to the multiprocess files (see the module docstring)."""
        return self._files is not None

    def attach(self, monitor: WorkerProcessMonitor) -> None:
        """Subscribe to ``monitor``, replacing the monitor attached before (e.g. after a restart).

        A monitor that has already failed reports its fatal events at once (counted, no latency
        observed). Counters keep their values; an event already counted for the same identity and
        kind is not counted twice. Does not block beyond the monitor's lock.
        """
        self._replace_monitor(monitor)

    def detach(self) -> None:
        """Stop listening to the attached monitor; its ranks disappear from the state gauge."""
        self._replace_monitor(None)

    def _replace_monitor(self, monitor: WorkerProcessMonitor | None) -> None:
        with self._lock:
            previous, self._monitor = self._monitor, monitor
            if monitor is not None and previous is not monitor:
                self._attached_at = time.monotonic()
        if previous is not monitor:
            if previous is not None:
                previous.unsubscribe(self._on_event)
            if monitor is not None:
                monitor.subscribe(self._on_event)
        self._sync_files()

    def close(self) -> None:
        """Detach, stop the refresh thread (multiprocess mode) and unregister every metric. Idempotent."""
        self.detach()
        self._stop.set()
        refresher = self._refresher
        if refresher is not None and refresher is not threading.current_thread():
            refresher.join(timeout=REFRESHER_JOIN_S)
            if refresher.is_alive():
                logger.warning("liveness metrics refresh thread did not stop within %g s (daemon: left to exit)",
                               REFRESHER_JOIN_S)
        with contextlib.suppress(KeyError):  # already unregistered
            self.registry.unregister(self._collector)

    def start_http_server(self, port: int = 0, addr: str = "127.0.0.1") -> tuple[Any, threading.Thread]:
        """Serve this registry at ``http://addr:port/metrics`` from a daemon thread.

        ``port=0`` picks a free port (read it from ``server.server_port``). Binds loopback by
        default; pass ``addr="0.0.0.0"`` to let a Prometheus server on another host scrape it.
        Returns prometheus_client's ``(server, thread)``; stop with ``server.shutdown()`` then
        ``server.server_close()``. Raises ``OSError`` if the address cannot be bound.
        """
        server, thread = prometheus_client.start_http_server(port, addr=addr, registry=self.registry)
        return server, thread

    def exposition(self) -> str:
        """This registry in the Prometheus text format (what a scrape of it returns)."""
        text: str = prometheus_client.generate_latest(self.registry).decode()
        return text

    # ----------------------------------------------------------------- inputs

    def note_fault(self, rank: int, at: float | None = None) -> None:
        """Record that a fault hit ``rank`` at monotonic time ``at`` (default: now).

        The next event for that rank observes its latency from ``at`` (origin ``noted``). Call it
        right before sending the signal (or injecting the fault), not after.
        """
        with self._lock:
            self._faults[rank] = time.monotonic() if at is None else at

    def statuses(self) -> list[RankStatus]:
        """The attached monitor's per-rank statuses (empty when none is attached)."""
        with self._lock:
            monitor = self._monitor
        return [] if monitor is None else monitor.statuses()

    def _on_event(self, event: WorkerEvent) -> None:
        delivered = time.monotonic()
        key = (event.identity, event.kind)
        with self._lock:
            if key in self._counted:
                return
            self._counted.add(key)
            noted = self._faults.pop(event.identity.rank, None)
            late = event.detected_at < self._attached_at
        (self._would_fail if self._observe else self._failures).labels(event.kind.value).inc()
        self._sync_files()
        if self._observe or late:  # an observed verdict is no failure: no latency either
            return
        fault_at, origin = self._fault_of(event, noted)
        if fault_at is None:
            return
        latency = delivered - fault_at
        if latency < 0:
            # A fault time after the delivery: a caller bug (or another clock), not a latency.
            logger.debug("fault time for %s is after its detection; latency not recorded", event.identity.describe())
            return
        self._latency.labels(event.kind.value, origin).observe(latency)

    def _fault_of(self, event: WorkerEvent, noted: float | None) -> tuple[float | None, str]:
        """The best fault time known for ``event`` and its origin label."""
        if noted is None and self._fault_time is not None:
            try:
                noted = self._fault_time(event)
            except Exception:
                logger.exception("fault_time callback raised; using the monitor's times for %s",
                                 event.identity.describe())
        if noted is not None:
            return noted, "noted"
        # The monitor's own time is the second origin of LATENCY_ORIGINS: the exit's handling for a
        # death, else the event's fault_at (the first sample of the stuck thread in D, the stall's
        # last progress, the lost host's agent last heard; None only for events built without it).
        origin = LATENCY_ORIGINS[event.kind][1]
        return (event.detected_at if event.kind is EventKind.DIED else event.fault_at), origin

    # ----------------------------------------------------------------- multiprocess files

    def _sync_files(self) -> None:
        files = self._files
        if files is None:
            return
        try:
            files.sync(self.statuses())
        except Exception:  # never let a metrics file problem reach the monitor's delivery
            logger.exception("could not write the liveness state gauges to %s", os.environ.get(MULTIPROC_ENV))

    def _refresh_loop(self) -> None:
        while not self._stop.wait(self._refresh_interval_s):
            self._sync_files()
