"""EngineLiveness: everything the extension keeps for one engine, in one object.

The proxy holds it in ONE attribute (``proxy.__dict__["_liveness"]``), so nothing else of the
extension lands on the upstream object (besides what upstream itself reads: ``_fatal_error``,
``_worker_process_monitor`` and ``mpi_futures``, which are upstream's names).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..._config import LivenessConfig
from ..._events import EventKind, WorkerEvent, WorkerFailedError
from ...exit._exit_guard import FatalExitGuard
from ...exit._process_ending import OwnedThreads
from ...exit._snapshot_record import FatalSnapshot
from ...monitor._delivery import Subscriber
from ...monitor._monitor import WorkerProcessMonitor
from ...monitor._stall_timer import StallInfo
from ...process._identity import ProcessIdentity
from ...stop._bounded_stop import StopReport
from .._futures import fail_pending
from ._engine_stall import Diagnoser, EngineStall
from ._shim import MonitorShim
from ._side_channel import IdentityChannel

if TYPE_CHECKING:  # optional extras: imported only where an engine uses them
    from ...multihost._hub import AgentHub
    from ...multihost._hub_records import HostStop
    from ..prometheus import LivenessMetrics

STATE_ATTR = "_liveness"

logger = logging.getLogger(__name__.rpartition(".")[0])


def state_of(proxy: object) -> EngineLiveness:
    """The :class:`EngineLiveness` a liveness proxy holds (see the module docstring)."""
    state: EngineLiveness = proxy.__dict__[STATE_ATTR]
    return state


def stall_under_way(proxy: object) -> StallInfo | None:
    """The stall under way of a liveness proxy's engine, or None (no stall, or no stall timer:
    ``stall_timeout_s`` 0, liveness off); Dynamo's status route shows it."""
    stall = state_of(proxy).stall
    detector = stall.detector if stall is not None else None
    return detector.current if detector is not None else None


class FatalPath:
    """The engine's fate as the fatal path (:mod:`._fatal`) keeps it: the one fatal error, every
    event seen, whether a death is still news, the fatal line and snapshot, and the fatal path's
    threads. It owns these fields and its lock: the fatal error, the events, the expected exits and
    the shutdown's start change only through its methods, under the lock; ``line`` and ``snapshot``
    are written once each by the fatal path itself (:mod:`._fatal`), and ``done`` and ``closing``
    are events. Thread-safe; nothing here blocks beyond the lock.

    Attributes:
        fatal: the ONE fatal error, once a fatal event arrived (or the bounded stop left a rank
            unkillable: :meth:`fail_after_stop`).
        expected_exits: set once a clean stop began (upstream's ``pre_shutdown()``/monitor
            ``close()``, or ``shutdown()`` of a healthy engine): deaths after it are not fatal.
        shutdown_started: ``shutdown()`` ran (:meth:`begin_shutdown`).
        would_fail: observe mode's verdicts by kind (``observe=1``: none of them acted on).
        line / snapshot: the fatal ERROR line's text (with its evidence) and the typed record of
            the fatal verdict's snapshot, once taken (``_fatal.report_snapshot``).
        done: set when the fatal path's helper finished upstream's ``pre_shutdown()``.
        threads: the engine's threads but the diagnosis' (the exit guard's trigger, the
            ``pre_shutdown()`` helper, observe mode's reporter, the remote hosts' stop, upstream's
            ``shutdown()``, the pool manager's watch), joined, each until its deadline, when the
            engine's liveness is released.
        closing: set when it is released: the exit guard's trigger no longer waits ``exit_delay_s``.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: list[WorkerEvent] = []
        self.fatal: WorkerFailedError | None = None
        self.expected_exits = False
        self.shutdown_started = False
        self.would_fail: dict[EventKind, int] = {}
        self.line = ""
        self.snapshot: FatalSnapshot | None = None
        self.done = threading.Event()
        self.threads = OwnedThreads()
        self.closing = threading.Event()

    @property
    def events(self) -> list[WorkerEvent]:
        """Every event seen (the first is the fatal error's), a copy."""
        with self._lock:
            return list(self._events)

    @property
    def failed_or_stopping(self) -> bool:
        """The engine has failed, or a clean stop or ``shutdown()`` began: a death is no news now."""
        return self.fatal is not None or self.shutdown_started or self.expected_exits

    def record(self, event: WorkerEvent) -> WorkerFailedError | None:
        """Remember ``event``; the fatal error if this is the first fatal one, else None (also
        after a clean stop or ``shutdown()`` began)."""
        with self._lock:
            self._remember(event)
            if self.failed_or_stopping:
                return None
            self.fatal = WorkerFailedError(event)
            return self.fatal

    def observe(self, event: WorkerEvent) -> bool:
        """Observe mode: remember ``event`` and count it by kind; True for the engine's first verdict."""
        with self._lock:
            first = not self.would_fail
            self._remember(event)
            self.would_fail[event.kind] = self.would_fail.get(event.kind, 0) + 1
        return first

    def _remember(self, event: WorkerEvent) -> None:
        if not any(seen is event for seen in self._events):
            self._events.append(event)

    def expect_exits(self) -> bool:
        """Mark that workers may now exit without it being a failure; True the first time. No
        effect after a fatal error (that one stays)."""
        with self._lock:
            if self.fatal is not None or self.expected_exits:
                return False
            self.expected_exits = True
            return True

    def begin_shutdown(self) -> bool | None:
        """``shutdown()`` begins: None if it had begun already, else whether the engine had failed."""
        with self._lock:
            if self.shutdown_started:
                return None
            self.shutdown_started = True
            return self.fatal is not None

    def fail_after_stop(self, event: WorkerEvent) -> WorkerFailedError:
        """The bounded stop left a rank unkillable (``event``): that is the fatal error unless one is known."""
        with self._lock:
            if self.fatal is None:
                self.fatal = WorkerFailedError(event)
            return self.fatal


class EngineStop:
    """The bounded stop of the engine's ranks (``_engine_shutdown.stop_workers``), which runs exactly
    once whoever asks: ``shutdown()``, the process's ending (the exit guard's watchdog, the STOP
    stage) and a failed start may all ask, from different threads at the same time. It owns its
    lock and what the stop found: ``report`` (the local ranks') and ``host_stops`` (the remote
    hosts' :class:`~trtllm_liveness.multihost.HostStop` reports, with an agent hub)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.done = False
        self.report: StopReport | None = None
        self.host_stops: list[HostStop] = []

    def once(self, bound_s: float, stop: Callable[[EngineStop], StopReport | None]) -> StopReport | None:
        """The report of the one stop: the first caller runs ``stop(self)`` under the lock (it hands
        the remote hosts' reports to :meth:`note_host_stops` as soon as they are in); every other
        caller waits for it (``bound_s`` at most) and gets the same report, so no rank is signalled
        twice (not even after a stop that raised) and the report is never overwritten."""
        if not self._lock.acquire(timeout=bound_s):
            logger.warning("liveness: the engine's bounded stop, under way in another thread, did not end within "
                           "%.1fs; not waiting for it", bound_s)
            return self.report
        try:
            if not self.done:
                try:
                    self.report = stop(self)
                finally:
                    self.done = True
            return self.report
        finally:
            self._lock.release()

    def note_host_stops(self, stops: list[HostStop]) -> None:
        """The remote hosts' reports of the stop under way (called by the stop itself)."""
        self.host_stops = stops


@dataclass(eq=False)
class EngineLiveness:
    """Per-engine liveness state: what the engine's parts hold, set as they start; the engine's fate
    is its :class:`FatalPath`'s.

    Attributes:
        config: the resolved configuration (``enabled`` False: everything else stays empty).
        monitor / shim / exit_guard: the engine's monitor, what upstream main sees as its monitor,
            and the exit guard (``exit_on_fatal`` only).
        subscriber: the engine's subscription to the monitor (the reaction's only caller).
        channel: the 1.2.x identity side channel, while start-up runs.
        fatal_path: the engine's fate (:class:`FatalPath`): its fatal error, events, fatal line.
        owns_session: the proxy created its MPI session (none was passed in).
        stop: the bounded stop of the engine's ranks (:class:`EngineStop`): run once, and its reports.
        stop_at_exit: the engine's STOP cleanup of the process's ending (``exit_on_fatal`` only).
        pre_shutdown_entries: calls of upstream's ``pre_shutdown()`` the extension made or passed on
            (counted under ``pre_shutdown_lock``).
        real_mpi_futures: mpi4py's own futures (upstream holds mirrors, see ``_futures.py``).
        request_socket_owner: the thread (ident) that owns upstream's request socket as its
            ``TLLM_LLMAPI_ZMQ_DEBUG`` check defines it: the first that used it, i.e. the first
            ``submit()``'s (``abort_request()`` follows a submit; ``pre_shutdown()`` sends last);
            set once, under ``send_lock``.
        stall: the engine's stall detection (``stall_timeout_s`` > 0), else None.
        diagnoser: the bounded snapshots of the local ranks (at a stall, a wedge, a fatal error).
        exit_join_released: the extension released mpi4py's exit join of the owned pool's thread
            (1.2.x, after a death; main's session does it itself); set once, by the teardown.
        metrics: the engine's ``LivenessMetrics`` when the extension exported them itself
            (trtllm-serve's multiprocess Prometheus page), else None.
        hub: the multi-host agent hub, where one runs.
        upstream: storage behind upstream's ``mpi_futures`` and ``_worker_process_monitor``
            attributes, by name (absent until upstream sets them; what
            upstream stores there is its own: the extension only looks for a list of futures).
    """

    config: LivenessConfig
    monitor: WorkerProcessMonitor | None = None
    subscriber: Subscriber | None = None
    shim: MonitorShim | None = None
    exit_guard: FatalExitGuard | None = None
    fatal_path: FatalPath = field(default_factory=FatalPath)
    # Serializes upstream's pre_shutdown(): its "already done" flag is not atomic. Taken with a
    # timeout only: the fatal path's helper may hang inside it (a send to a dead peer).
    pre_shutdown_lock: threading.Lock = field(default_factory=threading.Lock)
    # Held around upstream's submit() and the fatal helper's pre_shutdown(): upstream's ZMQ
    # sockets have no lock, so the extension never sends while a caller's send is in flight.
    send_lock: threading.Lock = field(default_factory=threading.Lock)
    channel: IdentityChannel | None = None
    owns_session: bool = True
    stop: EngineStop = field(default_factory=EngineStop)
    stop_at_exit: Callable[[], None] | None = None
    pre_shutdown_entries: int = 0
    real_mpi_futures: list[Future[Any]] | None = None
    request_socket_owner: int | None = None
    metrics: LivenessMetrics | None = None
    stall: EngineStall | None = None
    diagnoser: Diagnoser | None = None
    exit_join_released: bool = False
    hub: AgentHub | None = None
    upstream: dict[str, Any] = field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        return self.config.enabled

    @property
    def identities(self) -> list[ProcessIdentity]:
        """The ranks the engine's monitor knows (none without a monitor)."""
        return self.monitor.identities if self.monitor is not None else []

    def iteration_counts(self) -> dict[int, int]:
        """Each rank's last reported executor iteration count (empty without stall detection)."""
        stall = self.stall
        return {} if stall is None else {rank: last.count for rank, last in stall.iterations().items()}

    def worker_futures(self) -> list[Any]:
        """What upstream holds as its worker futures (the mirrors), once it set a list; else empty."""
        futures = self.upstream.get("mpi_futures")
        return futures if isinstance(futures, list) else []

    @property
    def host_stops(self) -> list[HostStop]:
        """What each remote host's agent reported of the stop of its ranks (docs/multihost.md)."""
        return self.stop.host_stops

    def owns_request_socket(self) -> bool:
        """Whether this thread may send on upstream's request socket (``TLLM_LLMAPI_ZMQ_DEBUG``'s
        check, docs/upstream-contract.md, "Request queue and blocking sends"): ZMQ sockets are not
        thread-safe, and upstream's queues have no lock. No submit yet: nobody owns the socket,
        and the thread that sends now becomes its owner."""
        owner = self.request_socket_owner
        return owner is None or owner == threading.get_ident()

    def fail_worker_futures(self, error: BaseException) -> None:
        """Fail every worker future upstream still waits on with ``error``."""
        fail_pending(self.worker_futures(), error)

