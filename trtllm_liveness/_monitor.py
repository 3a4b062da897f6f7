"""WorkerProcessMonitor: event-driven death and wedge detection for a set of worker processes.

Data flow::

    register(identities) --> pidfd per local rank --> epoll --+--> watcher thread (blocks)
                         \\-> procfs fallback list            |      |  on readable pidfd / tick
                                                              |      v
    find_dead_worker() / check() --- epoll.poll(0) ----------+   classify (exited, zombie,
                                                                  PID reused, wedged, ...)
                                                                     |
                                                     subscribers <---+ (once per rank and kind,
                                                                        outside the lock)

A pidfd becomes readable when its process exits, whether or not it is our child, so the watcher
sleeps in one ``epoll_wait`` over all pidfds plus a wakeup pipe and costs nothing while workers
live. Its timeout is the next due tick: the wedge scan (only when wedge detection is on) or the
procfs fallback poll (only when some worker could not get a pidfd); otherwise it blocks
indefinitely. Wedge sampling runs outside the monitor lock, so ``find_dead_worker()`` never waits
for a scan. The monitor never sends a signal.
"""

from __future__ import annotations

import errno
import logging
import os
import select
import signal
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from . import _pidfd, _procfs
from ._errors import AccessDenied, PidReused, ProcessGone, ProcessZombie
from ._events import EventKind, RankStatus, WorkerEvent, WorkerState
from ._identity import ProcessIdentity, coerce_identity, local_hostname, local_pid_namespace
from ._oom import OomProbe
from ._wedge import DStateSample, ThreadSampler, WedgeTracker

logger = logging.getLogger(__name__)

Subscriber = Callable[[WorkerEvent], None]

_EPOLL_FLAGS = select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR
_SCANNED_STATES = (WorkerState.ALIVE, WorkerState.WEDGED)


@dataclass(eq=False)
class _Watched:
    """Mutable per-rank record; guarded by the monitor's lock (the sampler has its own)."""

    identity: ProcessIdentity
    state: WorkerState
    method: str
    since: float = field(default_factory=time.monotonic)
    since_wall: float = field(default_factory=time.time)
    detail: str = ""
    pidfd: int | None = None
    wedge: WedgeTracker | None = None
    sampler: ThreadSampler | None = None
    oom: OomProbe | None = None
    reported: set[EventKind] = field(default_factory=set)

    def set_state(self, state: WorkerState, detail: str) -> None:
        if state is not self.state:
            self.state = state
            self.since = time.monotonic()
            self.since_wall = time.time()
        self.detail = detail

    def snapshot(self) -> RankStatus:
        return RankStatus(
            self.identity, self.state, self.since, self.since_wall, self.method, self.detail
        )


class _Resources:
    """The descriptors a monitor owns, released exactly once by whoever is last to need them.

    The watcher thread blocks in ``epoll_wait`` without a reference to the monitor, so when the
    monitor is closed or collected while the watcher runs, closing the epoll fd or the wakeup pipe
    under it could leave it asleep forever. Instead the owner wakes it and the watcher releases on
    its way out; without a running watcher the owner releases at once.
    """

    def __init__(self, epoll: select.epoll | None) -> None:
        self.epoll = epoll
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.by_fd: dict[int, _Watched] = {}
        self.records: dict[int, _Watched] = {}
        self.owner_pid = os.getpid()
        self.lock = threading.Lock()
        self.watchers = 0  # watcher threads running (an old one may still be leaving after a restart)
        self.released = False
        if epoll is not None:
            epoll.register(self.wake_r, _EPOLL_FLAGS)

    def wake(self) -> None:
        try:
            os.write(self.wake_w, b"x")
        except OSError:
            pass  # pipe full (a wakeup is already pending) or already released

    def owner_done(self) -> None:
        """The monitor is closed or collected: release now, or let the running watcher do it."""
        if os.getpid() != self.owner_pid:
            # Forked child: no watcher runs here and a lock copied mid-use would never be
            # released; just drop this process's copies of the descriptors.
            self._release_locked()
            return
        with self.lock:
            if self.watchers and os.getpid() == self.owner_pid:
                self.wake()
                return
            self._release_locked()

    def watcher_exited(self, owner_done: bool) -> None:
        with self.lock:
            self.watchers -= 1
            if owner_done and not self.watchers:
                self._release_locked()

    def _release_locked(self) -> None:
        if self.released:
            return
        self.released = True
        for fd, record in list(self.by_fd.items()):
            record.pidfd = None
            _close_quietly(fd)
        self.by_fd.clear()
        forked = os.getpid() != self.owner_pid
        for record in self.records.values():
            if record.sampler is not None:
                record.sampler.close(force=forked)
        if self.epoll is not None:
            # In a forked child this only drops the child's reference: the parent's epoll keeps
            # its registrations (nothing is unregistered here).
            self.epoll.close()
        _close_quietly(self.wake_w)
        _close_quietly(self.wake_r)


class WorkerProcessMonitor:
    """Watch worker processes given as identities; report deaths and wedges as events.

    Drop-in for upstream TensorRT-LLM's monitor: ``register(identities)``,
    ``find_dead_worker()`` (non-blocking, sticky) and ``close()``. In addition it can run a
    background watcher (:meth:`start`) that calls subscribers within a millisecond or two of the
    kernel reporting an exit, keeps a per-rank status view (:meth:`statuses`), and, when
    ``d_state_timeout_s`` is set, reports a worker any of whose threads stays in ``D`` longer
    than that as wedged, and one in ``D`` with SIGKILL pending as unkillable.

    All public methods are thread-safe. Subscribers are called once per rank and event kind,
    from the watcher thread or from the thread that called :meth:`register`/:meth:`check`, never
    under a lock. A monitor inherited by a forked child is inert there: every method returns at
    once without touching the parent's pidfds, epoll or locks.

    Args:
        d_state_timeout_s: seconds a thread may stay in ``D`` before its worker is wedged;
            ``None`` or <= 0 disables wedge detection (and its cost).
        scan_interval_s: how often the watcher samples thread states for wedges.
        procfs_interval_s: how often the watcher re-reads procfs for workers without a pidfd.
    """

    def __init__(
        self,
        *,
        d_state_timeout_s: float | None = None,
        scan_interval_s: float = 1.0,
        procfs_interval_s: float = 0.5,
    ) -> None:
        if not scan_interval_s > 0 or not procfs_interval_s > 0:
            raise ValueError("scan_interval_s and procfs_interval_s must be positive")
        self._d_state_timeout_s = (
            d_state_timeout_s if d_state_timeout_s is not None and d_state_timeout_s > 0 else None
        )
        self._scan_interval_s = scan_interval_s
        self._procfs_interval_s = procfs_interval_s
        self._lock = threading.Lock()
        self._owner_pid = os.getpid()
        self._warned_foreign = False
        self._res = _Resources(select.epoll() if _pidfd.pidfd_supported() else None)
        self._epoll = self._res.epoll
        self._records = self._res.records
        self._by_fd = self._res.by_fd
        self._procfs_only: list[_Watched] = []
        self._subscribers: list[Subscriber] = []
        self._failure: WorkerEvent | None = None
        self._first_dead: ProcessIdentity | None = None
        self._closed = False
        self._thread: threading.Thread | None = None
        self._stop_requested = False
        self._watcher_error: BaseException | None = None
        # Not a bound method: a finalizer holding self would keep it alive forever.
        self._finalizer = weakref.finalize(self, self._res.owner_done)

    # ----------------------------------------------------------------- registration

    def register(self, identities: Iterable[ProcessIdentity | Sequence[object]]) -> None:
        """Start watching ``identities`` (``ProcessIdentity`` or 5-field tuples).

        Identities of another host or PID namespace are kept as unmonitored, not dead. A
        process already gone, a zombie, or a PID whose start time differs (reused) is recorded
        dead at once and reported to subscribers. Registering the same identity again is a
        no-op; a new identity for an already registered rank replaces the old one. Falls back to
        procfs polling for a worker whose ``pidfd_open`` fails (ENOSYS, EPERM, EMFILE).
        Blocks only for procfs reads and ``pidfd_open`` (tens of microseconds per worker).
        Raises :class:`~trtllm_liveness.InvalidIdentityError` (a ``ValueError``, before anything
        is registered) for a malformed entry, ``RuntimeError`` after :meth:`close`.
        """
        if self._is_foreign_process():
            return
        parsed = [coerce_identity(raw, index) for index, raw in enumerate(identities)]
        events: list[WorkerEvent] = []
        with self._lock:
            if self._closed:
                raise RuntimeError("WorkerProcessMonitor is closed")
            # Workers of one job share a memory cgroup: read each OOM counter once per call.
            oom_counters: dict[str, int | None] = {}
            for identity in parsed:
                existing = self._records.get(identity.rank)
                if existing is not None:
                    if existing.identity == identity:
                        continue
                    logger.warning(
                        "rank %d re-registered with a new identity %s (was %s)",
                        identity.rank, identity, existing.identity,
                    )
                    self._forget_locked(existing)
                record = self._new_record(identity, oom_counters)
                self._records[identity.rank] = record
                event = self._event_for_state_locked(record)
                if event is not None:
                    events.append(event)
        self._res.wake()
        self._deliver(events)

    def _new_record(self, identity: ProcessIdentity, oom_counters: dict[str, int | None]) -> _Watched:
        if identity.hostname != local_hostname():
            return _Watched(identity, WorkerState.UNMONITORED_REMOTE, "none",
                            detail=f"on host {identity.hostname}, not {local_hostname()}")
        if identity.pid_namespace != local_pid_namespace():
            return _Watched(identity, WorkerState.UNMONITORED_OTHER_NAMESPACE, "none",
                            detail=f"PID namespace {identity.pid_namespace}, not {local_pid_namespace()}")
        wedge = WedgeTracker(self._d_state_timeout_s) if self._d_state_timeout_s else None
        sampler = ThreadSampler(identity.pid, identity.start_time) if wedge is not None else None
        fallback_reason = "pidfd unsupported"
        if self._epoll is not None:
            try:
                fd = _pidfd.open_verified_pidfd(identity.pid, identity.start_time)
            except (ProcessGone, AccessDenied) as exc:
                return self._dead_at_registration(identity, exc, "pidfd")
            except (OSError, ValueError) as exc:
                code = getattr(exc, "errno", None)
                fallback_reason = f"pidfd_open failed: {errno.errorcode.get(code or 0, str(exc))}"
                logger.warning("rank %d (pid %d): %s; polling procfs every %.2fs instead",
                               identity.rank, identity.pid, fallback_reason, self._procfs_interval_s)
            else:
                record = _Watched(identity, WorkerState.ALIVE, "pidfd", pidfd=fd, wedge=wedge, sampler=sampler,
                                  oom=OomProbe.capture(identity.pid, oom_counters))
                self._by_fd[fd] = record
                self._epoll.register(fd, _EPOLL_FLAGS)
                return record
        try:
            _pidfd.verify_start_time(identity.pid, identity.start_time)
        except (ProcessGone, AccessDenied) as exc:
            return self._dead_at_registration(identity, exc, "procfs")
        except (OSError, ValueError) as exc:
            # Cannot read procfs now either (EMFILE): not evidence of death. Poll until it works.
            fallback_reason += f"; not yet verified ({exc})"
        record = _Watched(identity, WorkerState.ALIVE, "procfs", detail=fallback_reason, wedge=wedge, sampler=sampler,
                          oom=OomProbe.capture(identity.pid, oom_counters))
        self._procfs_only.append(record)
        return record

    def _dead_at_registration(self, identity: ProcessIdentity, exc: Exception, method: str) -> _Watched:
        if isinstance(exc, AccessDenied):
            # Cannot read it, so cannot verify it: not ours to judge dead; keep it unmonitored.
            return _Watched(identity, WorkerState.UNMONITORED_OTHER_NAMESPACE, "none",
                            detail="access denied to /proc entry")
        state = WorkerState.ZOMBIE if isinstance(exc, ProcessZombie) else WorkerState.EXITED
        return _Watched(identity, state, method, detail=_cause_of(exc, at_registration=True))

    def _forget_locked(self, record: _Watched) -> None:
        self._close_pidfd_locked(record)
        if record.sampler is not None:
            record.sampler.close()
        if record in self._procfs_only:
            self._procfs_only.remove(record)

    def _close_pidfd_locked(self, record: _Watched) -> None:
        fd = record.pidfd
        if fd is None:
            return
        record.pidfd = None
        self._by_fd.pop(fd, None)
        if self._epoll is not None:
            try:
                self._epoll.unregister(fd)
            except (OSError, ValueError):
                pass
        _close_quietly(fd)

    # ----------------------------------------------------------------- checking

    def find_dead_worker(self) -> ProcessIdentity | None:
        """Return the first worker known to have died (exited, zombie or PID reused), if any.

        Non-blocking (one ``epoll_wait`` with zero timeout, plus a procfs read per worker in
        fallback mode; never waits for a wedge scan) and sticky: once a death is seen, that
        identity is returned forever. A wedged worker is not dead: see :attr:`failure`.
        """
        if self._first_dead is not None:
            return self._first_dead
        self.check()
        return self._first_dead

    def check(self) -> WorkerEvent | None:
        """Synchronous check of every local worker; returns the first fatal event, if any.

        Works with or without the watcher thread, so it is also the fail-safe when the watcher
        died. Does not sample thread states (that is the watcher's periodic job). Delivers any
        new event to subscribers, in this thread, before returning. Non-blocking as
        :meth:`find_dead_worker`.
        """
        if self._closed or self._is_foreign_process():
            return self._failure
        events: list[WorkerEvent] = []
        with self._lock:
            if self._closed:
                return self._failure
            if self._epoll is not None and self._by_fd:
                events.extend(self._handle_ready_locked(self._epoll.poll(0)))
            events.extend(self._poll_procfs_locked())
        self._deliver(events)
        return self._failure

    @property
    def failure(self) -> WorkerEvent | None:
        """The first fatal event (death, wedge or unkillable), or None while all is well."""
        return self._failure

    def statuses(self) -> list[RankStatus]:
        """A snapshot of every registered rank, ordered by rank. Non-blocking."""
        if self._is_foreign_process():
            return []
        with self._lock:
            return [self._records[rank].snapshot() for rank in sorted(self._records)]

    @property
    def identities(self) -> list[ProcessIdentity]:
        """Every registered identity, ordered by rank."""
        if self._is_foreign_process():
            return []
        with self._lock:
            return [self._records[rank].identity for rank in sorted(self._records)]

    @property
    def watcher_alive(self) -> bool:
        """Whether the background watcher thread is running."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def watcher_error(self) -> BaseException | None:
        """The exception that killed the watcher thread, if it died."""
        return self._watcher_error

    def _handle_ready_locked(self, ready: list[tuple[int, int]]) -> list[WorkerEvent]:
        events = []
        for fd, _mask in ready:
            if fd == self._res.wake_r:
                _drain(fd)
                continue
            record = self._by_fd.get(fd)
            # Re-test the fd under the lock: another thread may have closed it and a new
            # registration may have reused the number since epoll reported it.
            if record is None or not _pidfd.is_exited(fd):
                continue
            self._classify_exit_locked(record)
            self._close_pidfd_locked(record)
            event = self._event_for_state_locked(record)
            if event is not None:
                events.append(event)
        return events

    def _classify_exit_locked(self, record: _Watched) -> None:
        identity = record.identity
        try:
            info = _procfs.read_stat(identity.pid)
        except (OSError, ValueError):
            record.set_state(WorkerState.EXITED, _with_oom_cause(record, "process exited (reaped)", None))
            return
        if info.start_time != identity.start_time:
            detail = "process exited (reaped; PID already reused)"
            record.set_state(WorkerState.EXITED, _with_oom_cause(record, detail, None))
        elif info.state in ("Z", "X"):
            how = "" if info.exit_code is None else f", {_procfs.describe_wait_status(info.exit_code)}"
            detail = f"process exited (zombie, not yet reaped{how})"
            record.set_state(WorkerState.ZOMBIE, _with_oom_cause(record, detail, info.exit_code))
        else:
            # Readable pidfd, stat still there and not a zombie: the exit is in progress.
            record.set_state(WorkerState.EXITED, _with_oom_cause(record, "process exited", None))

    def _poll_procfs_locked(self) -> list[WorkerEvent]:
        events = []
        for record in list(self._procfs_only):
            try:
                _pidfd.verify_start_time(record.identity.pid, record.identity.start_time)
            except ProcessGone as exc:
                state = WorkerState.ZOMBIE if isinstance(exc, ProcessZombie) else WorkerState.EXITED
                record.set_state(state, _with_oom_cause(record, _cause_of(exc, at_registration=False), None))
                self._procfs_only.remove(record)
                event = self._event_for_state_locked(record)
                if event is not None:
                    events.append(event)
            except (OSError, ValueError, AccessDenied):
                continue  # cannot tell this time (EMFILE, EACCES): try again at the next poll
        return events

    def _scan_wedges(self) -> list[WorkerEvent]:
        """Sample every watched worker's threads (outside the lock) and apply verdicts (inside)."""
        with self._lock:
            if self._closed:
                return []
            targets = [
                (record, record.sampler) for record in self._records.values()
                if record.sampler is not None and record.state in _SCANNED_STATES
            ]
        samples: list[tuple[_Watched, DStateSample | None]] = []
        for record, sampler in targets:
            try:
                samples.append((record, sampler.sample()))
            except (OSError, ValueError):
                continue  # gone (the pidfd or procfs path reports the death) or unreadable now
        if not samples:
            return []
        now = time.monotonic()
        events = []
        with self._lock:
            for record, sample in samples:
                if record.wedge is None or self._records.get(record.identity.rank) is not record:
                    continue  # re-registered or closed meanwhile
                if record.state not in _SCANNED_STATES:
                    continue
                event = self._apply_sample_locked(record, record.wedge, sample, now)
                if event is not None:
                    events.append(event)
        return events

    def _apply_sample_locked(
        self, record: _Watched, wedge: WedgeTracker, sample: DStateSample | None, now: float
    ) -> WorkerEvent | None:
        was_seconds = wedge.d_seconds(now)
        verdict = wedge.observe(sample, now)
        if sample is None:
            if record.state is WorkerState.WEDGED:
                # The failure already raised stays (it is sticky); the view tells the truth.
                record.set_state(WorkerState.ALIVE, f"left D state after at least {was_seconds:.1f}s (was wedged)")
            return None
        if verdict is None:
            return None
        tid = wedge.stuck_tid() or sample.d_tids[0]
        wchan = sample.wchan or "?"
        if verdict is EventKind.UNKILLABLE:
            record.set_state(WorkerState.UNKILLABLE, f"thread {tid} in D with SIGKILL pending (wchan {wchan})")
        else:
            record.set_state(WorkerState.WEDGED,
                             f"thread {tid} in D for {wedge.d_seconds(now):.1f}s (wchan {wchan})")
        return self._event_for_state_locked(record, tid=tid, wchan=sample.wchan)

    def _event_for_state_locked(
        self, record: _Watched, *, tid: int | None = None, wchan: str = ""
    ) -> WorkerEvent | None:
        kind = _EVENT_OF_STATE.get(record.state)
        if kind is None or kind in record.reported:
            return None
        record.reported.add(kind)
        if kind is EventKind.DIED and record.sampler is not None:
            record.sampler.close()
        event = WorkerEvent(kind, record.identity, record.detail, tid=tid, wchan=wchan)
        if self._failure is None:
            self._failure = event
        if kind is EventKind.DIED and self._first_dead is None:
            self._first_dead = record.identity
        return event

    # ----------------------------------------------------------------- events

    def subscribe(self, callback: Subscriber) -> None:
        """Call ``callback(event)`` for each fatal event from now on.

        A subscriber that arrives after a failure is called at once, in this thread, with the
        first fatal event, so no failure is lost. Exceptions it raises are logged and ignored.
        Subscribing the same callback twice calls it twice.
        """
        with self._lock:
            self._subscribers.append(callback)
            failure = self._failure
        if failure is not None:
            self._call(callback, failure)

    def unsubscribe(self, callback: Subscriber) -> None:
        """Stop calling ``callback``; a no-op when it is not subscribed."""
        with self._lock:
            if callback in self._subscribers:
                self._subscribers.remove(callback)

    def _deliver(self, events: list[WorkerEvent]) -> None:
        if not events:
            return
        with self._lock:
            subscribers = list(self._subscribers)
        for event in events:
            # Subscribers first: they act on the failure; the log line can wait microseconds.
            for callback in subscribers:
                self._call(callback, event)
            log = logger.error if event.kind is not EventKind.DIED else logger.warning
            log("liveness: %s", event.message)

    @staticmethod
    def _call(callback: Subscriber, event: WorkerEvent) -> None:
        try:
            callback(event)
        except Exception:
            logger.exception("liveness subscriber %r raised; ignored", callback)

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
            self._stop_requested = False
            if self._thread is not None and self._thread.is_alive():
                return
            with self._res.lock:
                self._res.watchers += 1
            self._thread = threading.Thread(
                target=_watch, args=(weakref.ref(self), self._res),
                name="trtllm-liveness-watcher", daemon=True,
            )
            self._thread.start()

    def stop(self, timeout: float = 1.0) -> bool:
        """Stop the watcher and join it for at most ``timeout`` seconds.

        Idempotent and thread-safe. Returns True when no watcher is running afterwards. Called
        from a subscriber (the watcher thread itself) it asks the watcher to stop after the
        current delivery and returns False at once.
        """
        if self._is_foreign_process():
            return True
        with self._lock:
            thread = self._thread
            self._stop_requested = True
        self._res.wake()
        if thread is None:
            return True
        if thread is threading.current_thread():
            return False
        thread.join(timeout)
        return not thread.is_alive()

    def close(self, timeout: float = 1.0) -> None:
        """Stop the watcher (waiting at most ``timeout`` seconds) and release every descriptor.

        Idempotent and thread-safe; further ``register``/``start`` calls raise ``RuntimeError``.
        If the watcher does not stop in time (e.g. a subscriber blocks), it releases the
        descriptors itself when it ends.
        """
        if self._is_foreign_process():
            self._closed = True
            return
        self.stop(timeout)
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for record in self._records.values():
                self._close_pidfd_locked(record)
                if record.sampler is not None:
                    record.sampler.close()
            self._procfs_only.clear()
            self._subscribers.clear()
        self._finalizer()

    def __enter__(self) -> WorkerProcessMonitor:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _tick_needs(self) -> tuple[bool, bool]:
        """(wedge scan wanted, procfs poll wanted) given the current records."""
        with self._lock:
            scan = self._d_state_timeout_s is not None and any(
                record.sampler is not None and record.state in _SCANNED_STATES
                for record in self._records.values()
            )
            return scan, bool(self._procfs_only)

    def _run_tick(self, ready: list[tuple[int, int]], procfs_due: bool) -> None:
        events: list[WorkerEvent] = []
        with self._lock:
            if self._closed:
                return
            events.extend(self._handle_ready_locked(ready))
            if procfs_due:
                events.extend(self._poll_procfs_locked())
        self._deliver(events)

    def _is_foreign_process(self) -> bool:
        if os.getpid() == self._owner_pid:
            return False
        if not self._warned_foreign:
            self._warned_foreign = True
            logger.warning("WorkerProcessMonitor used in a forked child (pid %d); it is inert here", os.getpid())
        return True


_EVENT_OF_STATE = {
    WorkerState.EXITED: EventKind.DIED,
    WorkerState.ZOMBIE: EventKind.DIED,
    WorkerState.WEDGED: EventKind.WEDGED,
    WorkerState.UNKILLABLE: EventKind.UNKILLABLE,
}


def _watch(ref: weakref.ReferenceType[WorkerProcessMonitor], res: _Resources) -> None:
    """Watcher loop. Holds the monitor only by weakref between waits, so a dropped monitor ends it."""
    next_scan = next_procfs = 0.0
    poller: select.poll | None = None
    if res.epoll is None:
        poller = select.poll()
        poller.register(res.wake_r, select.POLLIN)
    owner_done = True
    try:
        while True:
            monitor = ref()
            if monitor is None or monitor._closed:
                return
            with monitor._lock:
                # Decided under the lock so that a concurrent start() either sees this thread
                # gone (and starts another) or has cleared the request (and this one goes on).
                if monitor._stop_requested:
                    if monitor._thread is threading.current_thread():
                        monitor._thread = None
                    owner_done = False
                    return
            scan_wanted, procfs_wanted = monitor._tick_needs()
            scan_interval, procfs_interval = monitor._scan_interval_s, monitor._procfs_interval_s
            del monitor
            due = [t for t, wanted in ((next_scan, scan_wanted), (next_procfs, procfs_wanted)) if wanted]
            timeout = max(0.0, min(due) - time.monotonic()) if due else -1.0
            if res.epoll is not None:
                ready = res.epoll.poll(timeout)
            else:
                assert poller is not None
                # No pidfd support at all: wait on the wakeup pipe alone; procfs ticks do the rest.
                if poller.poll(None if timeout < 0 else timeout * 1000.0):
                    _drain(res.wake_r)
                ready = []
            monitor = ref()
            if monitor is None:
                return
            now = time.monotonic()
            procfs_due = procfs_wanted and now >= next_procfs
            if procfs_due:
                next_procfs = now + procfs_interval
            monitor._run_tick(ready, procfs_due)
            if scan_wanted and now >= next_scan:
                next_scan = now + scan_interval
                monitor._deliver(monitor._scan_wedges())
            del monitor
    except BaseException as exc:  # fail loudly: the engine must not become silently unmonitored
        owner_done = False
        monitor = ref()
        if monitor is not None:
            monitor._watcher_error = exc
            owner_done = monitor._closed
        del monitor
        logger.critical(
            "liveness watcher thread died (%r); worker deaths are now seen only by synchronous "
            "checks (check_health / find_dead_worker)", exc, exc_info=True,
        )
    finally:
        res.watcher_exited(owner_done)


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except OSError:
        pass


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def _cause_of(exc: Exception, *, at_registration: bool) -> str:
    when = " at registration" if at_registration else ""
    if isinstance(exc, PidReused):
        return f"PID reused{when}: start time differs from the registered one (process exited)"
    if isinstance(exc, ProcessZombie):
        return f"process exited{when} (zombie, not yet reaped)"
    return f"process exited{when} (no longer exists)"


def _with_oom_cause(record: _Watched, detail: str, wait_status: int | None) -> str:
    """Append the OOM killer as the cause when the kernel's counters say so.

    Only a SIGKILL (or an exit whose status we cannot see) can be an OOM kill.
    """
    if record.oom is None:
        return detail
    if wait_status is not None and not (os.WIFSIGNALED(wait_status) and os.WTERMSIG(wait_status) == signal.SIGKILL):
        return detail
    verdict = record.oom.verdict()
    return detail if verdict is None else f"{detail}; {verdict}"
