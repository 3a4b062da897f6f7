"""WorkerProcessMonitor: event-driven death and wedge detection for a set of worker processes.

Data flow::

    register(identities) --> open_watched_rank (_registration) --> WatchedRank (_watched_rank),
    kept in the RankTable (_rank_table) --+-- pidfd --> PidfdWatcher (_watcher)
                                          |             watch set: pidfds + wakeup
                                          |             check set: pidfds only
                                          +-- no pidfd --> ProcfsFallback (_procfs_fallback)

    watcher thread: epoll_wait(watch set, timeout = next wedge scan / procfs tick) --+
    check() / find_dead_worker(): epoll_wait(check set, 0), procfs poll -------------+--> classify,
                                                                                        claim event
    wedge scan (watcher only, outside the lock, due by WedgeScan):                         ^
        ThreadSampler per rank (process/_thread_sampler), verdict by its WedgeTracker -----+
    apply_remote_many(): agents' reports, merge_remote_reports (_remote_reports) ----------+
                                                                                           v
                                          EventLog (_delivery): every subscriber, each event once

A pidfd becomes readable when its process exits, whether or not it is our child, so the watcher
sleeps in one ``epoll_wait`` and costs nothing while workers live. Its timeout is the next due
tick: the wedge scan (only when wedge detection is on and armed) or the procfs poll (only when
some worker could not get a pidfd); otherwise it blocks until a pidfd or its wakeup fires. Only
the watcher ever clears its wakeup (docs/development.md, "The watcher owns its wakeup", says why).
The monitor never sends a signal.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from .._events import EventKind, MonitorMethod, RankStatus, WorkerEvent, WorkerState
from ..process import _pidfd
from ..process._identity import ProcessIdentity, coerce_identity
from ..process._oom import OomCounters
from ._delivery import EventLog, Subscriber
from ._rank_table import RankTable, sample_threads
from ._remote_reports import merge_remote_reports
from ._stall_timer import StalledSince
from ._stopped_rank import STOPPED_BY_SIGNAL, StoppedRank
from ._watched_rank import SCANNED_STATES, WatchedRank
from ._watcher import PidfdWatcher, WatcherClosed
from ._wedge import WedgeScan

if TYPE_CHECKING:
    from ._progress_clock import ProgressClock

__all__ = ["Subscriber", "WorkerProcessMonitor"]

logger = logging.getLogger(__name__)


class WorkerProcessMonitor:
    """Watch worker processes given as identities; report deaths and wedges as events.

    Drop-in for upstream TensorRT-LLM's monitor: ``register(identities)``,
    ``find_dead_worker()`` (non-blocking, sticky) and ``close()``. In addition it can run a
    background watcher (:meth:`start`) that calls subscribers within a millisecond or two of the
    kernel reporting an exit, keeps a per-rank status view (:meth:`statuses`), and, when
    ``d_state_timeout_s`` is set, reports a worker any of whose threads stays in ``D`` without
    a context switch longer than that as wedged (the kernel's hung-task rule, :mod:`._wedge`), and
    one in ``D`` with SIGKILL pending on two scans, not having run between them, as unkillable.

    Lifecycle: ``register`` any time before :meth:`close`; :meth:`start` and :meth:`stop` the
    watcher any number of times; :meth:`close` once. Every method is thread-safe and every
    transition idempotent. Subscribers get every fatal event exactly once per rank and kind, in
    order, never two calls at once and never under a lock, from the watcher thread or from the
    thread whose call found the event; a late subscriber gets the events so far at once. A
    monitor inherited by a forked child is inert there.

    Args:
        d_state_timeout_s: seconds a thread may stay in ``D`` without a context switch before
            its worker is wedged; ``None`` or <= 0 disables wedge detection (and its cost).
        scan_interval_s: how often the watcher samples thread states for wedges.
        procfs_interval_s: how often the watcher re-reads procfs for workers without a pidfd.
        wedge_armed: False defers wedge verdicts until :meth:`arm_wedge_detection` (an engine
            arms it once its model is loaded: a slow start-up must not be called a wedge).
    """

    def __init__(
        self,
        *,
        d_state_timeout_s: float | None = None,
        scan_interval_s: float = 1.0,
        procfs_interval_s: float = 0.5,
        wedge_armed: bool = True,
    ) -> None:
        if not scan_interval_s > 0 or not procfs_interval_s > 0:
            raise ValueError("scan_interval_s and procfs_interval_s must be positive")
        self._wedge_scan = WedgeScan(d_state_timeout_s, scan_interval_s, armed=wedge_armed)
        self._lock = threading.Lock()
        self._owner_pid = os.getpid()
        self._warned_foreign = False
        self._watcher = PidfdWatcher(pidfd_capable=_pidfd.pidfd_supported())
        self._ranks = RankTable(self._watcher, procfs_interval_s)
        self._log = EventLog()
        self._failure: WorkerEvent | None = None
        self._stall: StalledSince | None = None
        self._stall_reported = False
        self._stopped_rule: tuple[ProgressClock, float] | None = None  # (the engine's progress, the bound)
        self._first_dead: ProcessIdentity | None = None
        self._expecting_exits = False
        self._subscriber_reports = False
        self._closed = False
        self._next_procfs = 0.0
        # Not a bound method: a finalizer holding self would keep it alive forever.
        self._finalizer = weakref.finalize(self, _release, self._watcher, self._owner_pid)

    # ----------------------------------------------------------------- registration

    def register(self, identities: Iterable[ProcessIdentity | Sequence[object]]) -> None:
        """Start watching ``identities`` (``ProcessIdentity`` or 5-field tuples).

        Identities of another host or PID namespace are kept as unmonitored, not dead. A
        process already gone, a zombie, or a PID whose start time differs (reused) is recorded
        dead at once and reported to subscribers. An identity without a start time (``None``:
        upstream sends that when its /proc read failed) is watched through its pidfd, which pins
        the process found at registration; its status says the start time is unverified.
        Registering the same identity again is a no-op; a new identity for an already registered
        rank replaces the old one. Falls back to procfs polling for a worker whose ``pidfd_open``
        fails (ENOSYS, EPERM, EMFILE). Blocks only for procfs reads and ``pidfd_open`` (tens of
        microseconds per worker). Raises :class:`~trtllm_liveness.process.InvalidIdentityError` (a
        ``ValueError``, before anything is registered) for a malformed entry, ``RuntimeError``
        after :meth:`close`.
        """
        if self._is_foreign_process():
            return
        parsed = [coerce_identity(raw, index) for index, raw in enumerate(identities)]
        events: list[WorkerEvent] = []
        with self._lock:
            if self._closed:
                raise RuntimeError("WorkerProcessMonitor is closed")
            # Workers of one job share a memory cgroup: resolve and read it once per call.
            oom_counters = OomCounters()
            for identity in parsed:
                existing = self._ranks.records.get(identity.rank)
                if existing is not None:
                    if existing.identity == identity:
                        continue
                    logger.warning(
                        "rank %d re-registered with a new identity %s (was %s)",
                        identity.rank, identity, existing.identity,
                    )
                    self._ranks.forget(existing)
                record = self._ranks.add(identity, d_state_timeout_s=self._wedge_scan.timeout_s,
                                         oom_counters=oom_counters)
                self._claim_locked(record, events)
        self._watcher.wake()  # the watcher's timeout may change (a first wedge scan, a procfs tick)
        self._publish(events)

    # ----------------------------------------------------------------- checking

    def find_dead_worker(self) -> ProcessIdentity | None:
        """Return the first worker known to have died (exited, zombie or PID reused), if any.

        Non-blocking (one ``epoll_wait`` with zero timeout, plus a procfs read per worker in
        fallback mode; never waits for a wedge scan) and sticky: once a death is seen, that
        identity is returned forever. A wedged worker is not dead: see :attr:`failure`. Exits
        after :meth:`mark_expected_exits` are not deaths.
        """
        if self._first_dead is not None:
            return self._first_dead
        self.check()
        return self._first_dead

    def check(self) -> WorkerEvent | None:
        """Synchronous check of every local worker; returns the first fatal event, if any.

        Works with or without the watcher thread, so it is also the fail-safe when the watcher
        died. Does not sample thread states (that is the watcher's periodic job) and never touches
        the watcher's wakeup. A new event is delivered to subscribers before this returns, in
        this thread, unless another thread is delivering to a subscriber at that moment (that
        thread then delivers it too). Non-blocking as :meth:`find_dead_worker`.
        """
        if self._closed or self._is_foreign_process():
            return self._failure
        events: list[WorkerEvent] = []
        with self._lock:
            if self._closed:
                return self._failure
            self._claim_all_locked(self._ranks.exited(self._watcher.ready_now()), events)
            if self._ranks.fallback:
                self._claim_all_locked(self._ranks.fallback.poll(), events)
        self._publish(events)
        return self._failure

    @property
    def failure(self) -> WorkerEvent | None:
        """The first fatal event (death, wedge or unkillable), or None while all is well."""
        return self._failure

    @property
    def events(self) -> list[WorkerEvent]:
        """Every fatal event so far, in the order subscribers get them."""
        if self._is_foreign_process():
            return []
        return self._log.events

    def statuses(self) -> list[RankStatus]:
        """A snapshot of every registered rank, ordered by rank. Non-blocking.

        While the engine is stalled (:meth:`set_stalled`), every local rank that is otherwise
        ``alive`` shows ``stalled`` instead."""
        if self._is_foreign_process():
            return []
        with self._lock:
            snapshots = self._ranks.snapshots()
            stall = self._stall
        return snapshots if stall is None else [stall.over(status) for status in snapshots]

    def set_stalled(self, since: float | None, detail: str = "", since_wall: float | None = None) -> None:
        """Show the engine as stalled since ``since`` (monotonic) in :meth:`statuses`, or, with
        None, no longer. A stall is a fact about the engine, not about one process: no event is
        raised here (see :meth:`report_stall` for ``stall_action=fatal``). Thread-safe."""
        if self._is_foreign_process():
            return
        with self._lock:
            if since is None:
                self._stall = None
            else:
                wall = since_wall if since_wall is not None else time.time() - (time.monotonic() - since)
                self._stall = StalledSince(since, wall, detail)

    @property
    def stalled(self) -> StalledSince | None:
        """The stall :meth:`set_stalled` shows now, or None. Non-blocking."""
        with self._lock:
            return self._stall

    def report_stall(self, event: WorkerEvent) -> bool:
        """Deliver a ``stalled`` event (``stall_action=fatal``, a stopped rank) to every subscriber,
        at most once per monitor; it becomes :attr:`failure` if none was recorded before. True if
        delivered now. Raises ``ValueError`` for an event of another kind."""
        if event.kind is not EventKind.STALLED:
            raise ValueError(f"report_stall() takes a stalled event, got {event.kind.value}")
        if self._is_foreign_process():
            return False
        with self._lock:
            if self._closed or not self._stall_locked(event):
                return False
        self._publish([event])
        return True

    def _stall_locked(self, event: WorkerEvent) -> bool:
        if self._stall_reported:
            return False
        self._stall_reported = True
        if self._failure is None:
            self._failure = event
        self._log.append([event])
        return True

    def watch_stopped_ranks(self, progress: ProgressClock, timeout_s: float) -> None:
        """From now on, a local rank stopped by a signal (``T``) at every wedge scan for
        ``timeout_s`` while ``progress`` shows no progress for as long with requests pending is a
        ``stalled`` event (:mod:`._stopped_rank`); 0 or less: never. Rides on the wedge scan (no
        scan, no verdict: wedge detection off turns this off too). Thread-safe."""
        with self._lock:
            self._stopped_rule = (progress, timeout_s) if timeout_s > 0 else None

    @property
    def identities(self) -> list[ProcessIdentity]:
        """Every registered identity, ordered by rank."""
        if self._is_foreign_process():
            return []
        with self._lock:
            return self._ranks.identities()

    def verified_identities(self) -> list[ProcessIdentity]:
        """The local identities whose start time was given and verified: the only signal targets."""
        if self._is_foreign_process():
            return []
        with self._lock:
            return self._ranks.verified_identities()

    @property
    def watcher_alive(self) -> bool:
        """Whether the background watcher thread is running."""
        return self._watcher.alive

    @property
    def watcher_error(self) -> BaseException | None:
        """The exception that killed the watcher thread, if it died."""
        return self._watcher.error

    def _claim_all_locked(self, records: list[WatchedRank], events: list[WorkerEvent]) -> None:
        for record in records:
            self._claim_locked(record, events)

    # ----------------------------------------------------------------- remote ranks (agents)

    def apply_remote_many(self, updates: Sequence[tuple[ProcessIdentity, WorkerState, str]], *,
                          via: MonitorMethod | str,
                          tid: int | None = None, wchan: str = "", fault_at: float | None = None,
                          deliver: bool = True) -> int:
        """Record what remote hosts' agents (or the hub, for a lost host) say of remote ranks.

        Each update's rank record (made here if ``register`` never saw it) takes the update's state
        and detail and shows ``via`` as its method (``MonitorMethod.AGENT`` or ``NONE``, or its
        value; one that observes on this host, ``pidfd`` or ``procfs``, raises ``ValueError``: a rank
        only heard of is never a signal target); a fatal state becomes an event through the same
        exactly-once path as a local observation (a death after :meth:`mark_expected_exits` is
        expected, no event). A death, or any fatal verdict, stands: a later non-fatal report is a
        late message. Nothing here signals anything, and a remote rank is never a signal target
        (:meth:`verified_identities`). An update is not taken when its identity is local (this
        host's ranks are observed here, not hearsay), when it contradicts the one registered for
        that rank (another pid or start time), or after :meth:`close`. Every state is set before any
        event is delivered, so a subscriber sees the whole host's view. Returns how many updates
        were taken. ``deliver=False``: states, failure and log line at once, but no subscriber is
        called here (an agent hub under its lock); :meth:`deliver` does that, and so does the next
        :meth:`check` or :meth:`flush` of any thread. Thread-safe; delivers in this thread like
        :meth:`check`.
        """
        method = MonitorMethod(via)
        if method.signals:
            raise ValueError(f"a remote report comes via an agent or none, not {method}: a rank only heard of is "
                             "never observed (nor signalled) here")
        if self._is_foreign_process():
            return 0
        events: list[WorkerEvent] = []
        with self._lock:
            if self._closed:
                return 0
            taken = merge_remote_reports(self._ranks.records, updates, via=method)
            for record in taken:
                self._claim_locked(record, events, tid=tid, wchan=wchan, fault_at=fault_at)
        self._publish(events, deliver=deliver)
        return len(taken)

    def _claim_locked(self, record: WatchedRank, events: list[WorkerEvent],
                      *, tid: int | None = None, wchan: str = "", fault_at: float | None = None) -> None:
        """Turn the record's state into an event once; record it as failure and in the log."""
        if self._expecting_exits and record.state.is_dead and EventKind.DIED not in record.reported:
            record.reported.add(EventKind.DIED)
            record.set_state(WorkerState.EXITED_EXPECTED, f"{record.detail} (expected: shutdown under way)")
            record.close_sampler()
            return
        event = record.claim_event(tid=tid, wchan=wchan, fault_at=fault_at)
        if event is None:
            return
        if self._failure is None:
            self._failure = event
        if event.kind is EventKind.DIED and self._first_dead is None:
            self._first_dead = record.identity
        events.append(event)
        self._log.append([event])  # under the monitor lock: the log's order is the state order

    def deliver(self) -> None:
        """Give every subscriber, in this thread, the events recorded so far that it has not been
        given (left to the thread delivering to it at the moment, if one is)."""
        if not self._is_foreign_process():
            self._log.deliver()

    def _publish(self, events: list[WorkerEvent], *, deliver: bool = True) -> None:
        """Deliver (subscribers first: they act on the failure), then log each new event once
        (at DEBUG where a subscriber reports the events itself: one failure, one ERROR)."""
        if deliver:
            self._log.deliver()
        for event in events:
            if self._subscriber_reports:
                logger.debug("liveness: %s (reported by a subscriber)", event.message)
                continue
            log = logger.error if event.kind is not EventKind.DIED else logger.warning
            log("liveness: %s", event.message)

    # ----------------------------------------------------------------- expected exits, arming

    def mark_expected_exits(self) -> None:
        """From now on a worker's exit is expected (a shutdown began): not a death, no event.

        What upstream's ``pre_shutdown()`` means by closing its monitor. Exits are still shown in
        :meth:`statuses` (``exited-expected``); wedges and unkillable workers are still reported,
        since they are facts about the host, not about the shutdown. Idempotent, thread-safe.
        """
        if self._is_foreign_process():
            return
        with self._lock:
            self._expecting_exits = True

    def arm_wedge_detection(self, d_state_timeout_s: float | None = None) -> None:
        """Start calling workers wedged; with ``d_state_timeout_s``, from now on with that timeout.

        An engine builds its monitor unarmed (or armed with a long start-up bound) and calls this
        once the model is loaded: time spent in ``D`` before the call does not count. A positive
        ``d_state_timeout_s`` replaces the constructor's (turning wedge detection on if it was
        off); 0 or a negative value turns it off. Idempotent without an argument; thread-safe.
        """
        if self._is_foreign_process():
            return
        with self._lock:
            if not self._wedge_scan.arm(d_state_timeout_s):
                return
            self._ranks.rearm_wedges(self._wedge_scan.timeout_s)  # D time before arming does not count
        self._watcher.wake()

    @property
    def wedge_armed(self) -> bool:
        """Whether wedge verdicts are being made (see ``wedge_armed`` in the constructor)."""
        return self._wedge_scan.enabled

    # ----------------------------------------------------------------- events

    def subscribe(self, callback: Subscriber, *, reports: bool = False) -> None:
        """Call ``callback(event)`` for each fatal event, exactly once per rank and kind.

        A subscriber that arrives after failures is given them at once, in this thread, so no
        failure is lost. Exceptions it raises are logged and ignored. Subscribing the same
        callback twice calls it twice. With ``reports=True`` the subscriber logs each event
        itself (an engine's fatal line): the monitor then logs events at DEBUG only, so one
        failure is one ERROR, not that and the monitor's line.
        """
        if self._is_foreign_process():
            return
        if reports:
            self._subscriber_reports = True
        self._log.subscribe(callback)

    def unsubscribe(self, callback: Subscriber) -> None:
        """Stop calling ``callback`` (one subscription of it); a no-op when it is not subscribed."""
        if self._is_foreign_process():
            return
        self._log.unsubscribe(callback)

    def flush(self, callback: Subscriber, timeout: float) -> bool:
        """Make sure ``callback`` has been given every event so far: what nobody is delivering to it
        is delivered in this thread; a delivery to it that another thread is making is waited for,
        at most ``timeout`` seconds. True when done; False at the timeout, or at once when called
        from inside that delivery. Never a second call for an event, never two calls at a time.
        """
        if self._is_foreign_process():
            return True
        return self._log.flush(callback, timeout)

    # ----------------------------------------------------------------- watcher thread

    def start(self) -> None:
        """Start the background watcher thread; a no-op if it is running. Thread-safe.

        Returns at once. Raises ``RuntimeError`` after :meth:`close`.
        """
        if self._is_foreign_process():
            return
        with self._lock:
            if self._closed:
                raise RuntimeError("WorkerProcessMonitor is closed")
        try:
            self._watcher.start(self)
        except WatcherClosed:  # closed by another thread since the check above
            raise RuntimeError("WorkerProcessMonitor is closed") from None

    def stop(self, timeout: float = 1.0) -> bool:
        """Stop the watcher and join it for at most ``timeout`` seconds.

        Idempotent and thread-safe. Returns True when no watcher is running afterwards. Called
        from a subscriber (the watcher thread itself) it asks the watcher to stop after the
        current delivery and returns False at once.
        """
        if self._is_foreign_process():
            return True
        return self._watcher.stop(timeout)

    def close(self, timeout: float = 1.0) -> None:
        """Stop the watcher (waiting at most ``timeout`` seconds) and release every descriptor.

        Idempotent and thread-safe; further ``register``/``start`` calls raise ``RuntimeError``.
        If the watcher does not stop in time (e.g. a subscriber blocks), it releases the
        descriptors itself when it ends.
        """
        if self._is_foreign_process():
            self._closed = True
            return
        with self._lock:
            already = self._closed
            self._closed = True
            if not already:
                self._ranks.release()  # the watcher owns and closes the descriptors
        if not already:
            self._log.clear_subscribers()
        self._watcher.close(timeout)

    def __enter__(self) -> WorkerProcessMonitor:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # Called by the watcher thread (PidfdWatcher), never by anybody else.

    def _watch_timeout(self) -> float | None:
        with self._lock:
            due = []
            if self._wedge_scan.enabled and self._ranks.wants_scan():
                due.append(self._wedge_scan.next_at)
            if self._ranks.fallback:
                due.append(self._next_procfs)
        return max(0.0, min(due) - time.monotonic()) if due else None

    def _watch_handle(self, ready: list[int]) -> None:
        events: list[WorkerEvent] = []
        now = time.monotonic()
        with self._lock:
            if self._closed:
                return
            self._claim_all_locked(self._ranks.exited(ready), events)
            if self._ranks.fallback and now >= self._next_procfs:
                self._next_procfs = now + self._ranks.fallback.interval_s
                self._claim_all_locked(self._ranks.fallback.poll(), events)
            scan_due = self._wedge_scan.enabled and self._ranks.wants_scan() and self._wedge_scan.take_due(now)
        self._publish(events)
        if scan_due:
            self._publish(self._scan_wedges())

    def _scan_wedges(self) -> list[WorkerEvent]:
        """Sample every watched worker's threads (outside the lock) and apply verdicts (inside).

        Samples are dated by when their scan began, and the next scan begins a full interval after
        that at the earliest: a thread stuck since one scan is judged stuck for ``k`` intervals at
        the ``k``-th scan after it, never one scan later because this scan's reads happened to
        take longer than that one's (a date taken after the reads would differ by that much)."""
        with self._lock:
            if self._closed:
                return []
            now = time.monotonic()
            self._wedge_scan.not_before(now)
            targets = self._ranks.scan_targets()
        samples = sample_threads(targets)
        if not samples:
            return []
        rule = self._stopped_rule
        quiet, pending, needed = None, 0, 0.0
        if rule is not None and any(record.sampler is not None and record.sampler.state == STOPPED_BY_SIGNAL
                                    for record, _sample in samples):
            # Only while a rank is stopped (its rule's only reader), outside the lock: len(), procfs.
            quiet = rule[0].quiet_s(now)
            pending = rule[0].pending() if quiet is not None else 0
            needed = rule[0].quiet_bound(rule[1], now)
        events: list[WorkerEvent] = []
        with self._lock:
            for record, sample in samples:
                if record.wedge is None or self._closed or not self._ranks.is_current(record):
                    continue  # re-registered or closed meanwhile
                if record.state in SCANNED_STATES:
                    verdict = record.observe_threads(record.wedge, sample, now)
                    if verdict is not None:
                        tid, wchan = verdict
                        self._claim_locked(record, events, tid=tid, wchan=wchan)
                if rule is not None and record.sampler is not None and record.state is WorkerState.ALIVE:
                    self._observe_stop_locked(record, record.sampler.state, rule[1], now, (quiet, needed), pending,
                                              events)
        return events

    def _observe_stop_locked(self, record: WatchedRank, state: str, timeout_s: float, now: float,
                             quiet: tuple[float | None, float], pending: int, events: list[WorkerEvent]) -> None:
        """``quiet``: the engine's seconds without progress (None: idle), and how many it takes."""
        if record.stopped is None or record.stopped.timeout_s != timeout_s:
            record.stopped = StoppedRank(timeout_s, self._wedge_scan.interval_s)
        record.stopped.observe(state, now)
        cause = record.stopped.verdict(now, quiet[0], pending, quiet[1])
        if cause is None or record.stopped.since is None:
            return
        event = WorkerEvent(EventKind.STALLED, record.identity, cause, fault_at=record.stopped.since)
        if self._stall_locked(event):
            events.append(event)

    def _is_foreign_process(self) -> bool:
        if os.getpid() == self._owner_pid:
            return False
        if not self._warned_foreign:
            self._warned_foreign = True
            logger.warning("WorkerProcessMonitor used in a forked child (pid %d); it is inert here", os.getpid())
        return True


def _release(watcher: PidfdWatcher, owner_pid: int) -> None:
    """Finalizer: the monitor was closed or collected."""
    if os.getpid() != owner_pid:
        watcher.release_in_forked_child()
    else:
        watcher.close(0.0)
