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
live. Its timeout is the next due tick: the wedge-scan interval (only when wedge detection is
on) or the procfs fallback interval (only when some worker could not get a pidfd); otherwise it
blocks indefinitely. The monitor never sends a signal.
"""

from __future__ import annotations

import errno
import logging
import os
import select
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from . import _pidfd, _procfs
from ._errors import AccessDenied, PidReused, ProcessGone, ProcessZombie
from ._events import EventKind, RankStatus, WorkerEvent, WorkerState
from ._identity import ProcessIdentity, local_hostname, local_pid_namespace
from ._wedge import WedgeTracker, sample_d_state

logger = logging.getLogger(__name__)

Subscriber = Callable[[WorkerEvent], None]

_EPOLL_FLAGS = select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR


@dataclass
class _Watched:
    """Mutable per-rank record; guarded by the monitor's lock."""

    identity: ProcessIdentity
    state: WorkerState
    method: str
    since: float = field(default_factory=time.monotonic)
    since_wall: float = field(default_factory=time.time)
    detail: str = ""
    pidfd: int | None = None
    wedge: WedgeTracker | None = None
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


class WorkerProcessMonitor:
    """Watch worker processes given as identities; report deaths and wedges as events.

    Drop-in for upstream TensorRT-LLM's monitor: ``register(identities)``,
    ``find_dead_worker()`` (non-blocking, sticky) and ``close()``. In addition it can run a
    background watcher (:meth:`start`) that calls subscribers within a millisecond or two of the
    kernel reporting an exit, keeps a per-rank status view (:meth:`statuses`), and, when
    ``d_state_timeout_s`` is set, reports a worker any of whose threads stays in ``D`` longer
    than that as wedged, and one in ``D`` with SIGKILL pending as unkillable.

    All public methods are thread-safe. Subscribers are called once per rank and event kind,
    from the watcher thread or from the thread that called :meth:`check`, never under a lock.
    A monitor inherited by a forked child is inert there (the pidfds belong to the parent).

    Args:
        d_state_timeout_s: seconds a thread may stay in ``D`` before its worker is wedged;
            ``None`` or <= 0 disables wedge detection (and its cost).
        scan_interval_s: how often the watcher samples thread states for wedges.
        procfs_interval_s: how often workers without a pidfd are re-read from procfs.
    """

    def __init__(
        self,
        *,
        d_state_timeout_s: float | None = None,
        scan_interval_s: float = 1.0,
        procfs_interval_s: float = 0.5,
    ) -> None:
        if scan_interval_s <= 0 or procfs_interval_s <= 0:
            raise ValueError("scan_interval_s and procfs_interval_s must be positive")
        self._d_state_timeout_s = (
            d_state_timeout_s if d_state_timeout_s is not None and d_state_timeout_s > 0 else None
        )
        self._scan_interval_s = scan_interval_s
        self._procfs_interval_s = procfs_interval_s
        self._lock = threading.Lock()
        self._owner_pid = os.getpid()
        self._records: dict[int, _Watched] = {}
        self._by_fd: dict[int, _Watched] = {}
        self._procfs_only: list[_Watched] = []
        self._epoll: select.epoll | None = select.epoll() if _pidfd.pidfd_supported() else None
        self._subscribers: list[Subscriber] = []
        self._failure: WorkerEvent | None = None
        self._first_dead: ProcessIdentity | None = None
        self._closed = False
        self._thread: threading.Thread | None = None
        self._stop_requested = False
        self._watcher_error: BaseException | None = None
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        if self._epoll is not None:
            self._epoll.register(self._wake_r, _EPOLL_FLAGS)
        # Not a bound method: a finalizer holding self would keep it alive forever.
        self._finalizer = weakref.finalize(
            self, _release_fds, self._epoll, self._wake_r, self._wake_w, self._by_fd
        )

    # ----------------------------------------------------------------- registration

    def register(self, identities: Iterable[ProcessIdentity | Sequence[object]]) -> None:
        """Start watching ``identities`` (``ProcessIdentity`` or 5-field tuples).

        Identities of another host or PID namespace are kept as unmonitored, not dead. A
        process already gone, a zombie, or a PID whose start time differs (reused) is recorded
        dead at once and reported to subscribers. Registering the same identity again is a
        no-op; a new identity for an already registered rank replaces the old one. Falls back to
        procfs polling for a worker whose ``pidfd_open`` fails (ENOSYS, EPERM, EMFILE).
        Blocks only for procfs reads; raises ``RuntimeError`` after :meth:`close`.
        """
        events: list[WorkerEvent] = []
        with self._lock:
            if self._closed:
                raise RuntimeError("WorkerProcessMonitor is closed")
            if self._is_foreign_process():
                return
            for raw in identities:
                identity = raw if isinstance(raw, ProcessIdentity) else ProcessIdentity(*raw)  # type: ignore[arg-type]
                existing = self._records.get(identity.rank)
                if existing is not None:
                    if existing.identity == identity:
                        continue
                    logger.warning(
                        "rank %d re-registered with a new identity %s (was %s)",
                        identity.rank, identity, existing.identity,
                    )
                    self._forget_locked(existing)
                record = self._new_record(identity)
                self._records[identity.rank] = record
                event = self._event_for_state_locked(record)
                if event is not None:
                    events.append(event)
        self._wake()
        self._deliver(events)

    def _new_record(self, identity: ProcessIdentity) -> _Watched:
        if identity.hostname != local_hostname():
            return _Watched(identity, WorkerState.UNMONITORED_REMOTE, "none",
                            detail=f"on host {identity.hostname}, not {local_hostname()}")
        if identity.pid_namespace != local_pid_namespace():
            return _Watched(identity, WorkerState.UNMONITORED_OTHER_NAMESPACE, "none",
                            detail=f"PID namespace {identity.pid_namespace}, not {local_pid_namespace()}")
        wedge = WedgeTracker(self._d_state_timeout_s) if self._d_state_timeout_s else None
        fallback_reason = "pidfd unsupported"
        if self._epoll is not None:
            try:
                fd = _pidfd.open_verified_pidfd(identity.pid, identity.start_time)
            except (ProcessGone, AccessDenied) as exc:
                return self._dead_at_registration(identity, exc, "pidfd", wedge)
            except OSError as exc:
                fallback_reason = f"pidfd_open failed: {errno.errorcode.get(exc.errno or 0, exc)}"
                logger.warning("rank %d (pid %d): %s; polling procfs every %.2fs instead",
                               identity.rank, identity.pid, fallback_reason, self._procfs_interval_s)
            else:
                record = _Watched(identity, WorkerState.ALIVE, "pidfd", pidfd=fd, wedge=wedge)
                self._by_fd[fd] = record
                self._epoll.register(fd, _EPOLL_FLAGS)
                return record
        try:
            _pidfd.verify_start_time(identity.pid, identity.start_time)
        except (ProcessGone, AccessDenied) as exc:
            return self._dead_at_registration(identity, exc, "procfs", wedge)
        record = _Watched(identity, WorkerState.ALIVE, "procfs", detail=fallback_reason, wedge=wedge)
        self._procfs_only.append(record)
        return record

    def _dead_at_registration(
        self, identity: ProcessIdentity, exc: Exception, method: str, wedge: WedgeTracker | None
    ) -> _Watched:
        if isinstance(exc, AccessDenied):
            # Cannot read it, so cannot verify it: not ours to judge dead; keep it unmonitored.
            return _Watched(identity, WorkerState.UNMONITORED_OTHER_NAMESPACE, "none",
                            detail="access denied to /proc entry")
        state = WorkerState.ZOMBIE if isinstance(exc, ProcessZombie) else WorkerState.EXITED
        return _Watched(identity, state, method, detail=_cause_of(exc, at_registration=True), wedge=wedge)

    def _forget_locked(self, record: _Watched) -> None:
        if record.pidfd is not None:
            self._close_pidfd_locked(record)
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
        os.close(fd)

    # ----------------------------------------------------------------- checking

    def find_dead_worker(self) -> ProcessIdentity | None:
        """Return the first worker known to have died (exited, zombie or PID reused), if any.

        Non-blocking (one ``epoll_wait`` with zero timeout, plus a procfs read per worker in
        fallback mode) and sticky: once a death is seen, that identity is returned forever.
        """
        if self._first_dead is not None:
            return self._first_dead
        self.check()
        return self._first_dead

    def check(self) -> WorkerEvent | None:
        """Synchronous check of every local worker; returns the first fatal event, if any.

        Works with or without the watcher thread, so it is also the fail-safe when the watcher
        died. Does not sample thread states (that is the watcher's periodic job). Delivers any
        new event to subscribers before returning.
        """
        if self._failure is not None or self._closed:
            return self._failure
        events: list[WorkerEvent] = []
        with self._lock:
            if self._closed or self._is_foreign_process():
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
        """A snapshot of every registered rank, ordered by rank."""
        with self._lock:
            return [self._records[rank].snapshot() for rank in sorted(self._records)]

    @property
    def identities(self) -> list[ProcessIdentity]:
        """Every registered identity, ordered by rank."""
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
            if fd == self._wake_r:
                _drain(self._wake_r)
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
        except OSError:
            record.set_state(WorkerState.EXITED, "process exited (reaped)")
            return
        if info.start_time != identity.start_time:
            record.set_state(WorkerState.EXITED, "process exited (reaped; PID already reused)")
        elif info.state in ("Z", "X"):
            how = "" if info.exit_code is None else f", {_procfs.describe_wait_status(info.exit_code)}"
            record.set_state(WorkerState.ZOMBIE, f"process exited (zombie, not yet reaped{how})")
        else:
            record.set_state(WorkerState.EXITED, "process exited")

    def _poll_procfs_locked(self) -> list[WorkerEvent]:
        events = []
        for record in list(self._procfs_only):
            try:
                _pidfd.verify_start_time(record.identity.pid, record.identity.start_time)
            except AccessDenied:
                continue
            except ProcessGone as exc:
                state = WorkerState.ZOMBIE if isinstance(exc, ProcessZombie) else WorkerState.EXITED
                record.set_state(state, _cause_of(exc, at_registration=False))
                self._procfs_only.remove(record)
                event = self._event_for_state_locked(record)
                if event is not None:
                    events.append(event)
        return events

    def _scan_wedges_locked(self, now: float) -> list[WorkerEvent]:
        events = []
        for record in self._records.values():
            if record.wedge is None or record.state not in (WorkerState.ALIVE, WorkerState.WEDGED):
                continue
            try:
                sample = sample_d_state(record.identity.pid)
            except OSError:
                continue  # gone: the pidfd or procfs path reports the death
            verdict = record.wedge.observe(sample, now)
            if verdict is None or sample is None:
                continue
            seconds = record.wedge.d_seconds(now)
            if verdict is EventKind.UNKILLABLE:
                record.set_state(WorkerState.UNKILLABLE,
                                 f"thread {sample.d_tids[0]} in D with SIGKILL pending (wchan {sample.wchan or '?'})")
            else:
                record.set_state(WorkerState.WEDGED,
                                 f"thread {sample.d_tids[0]} in D for {seconds:.1f}s (wchan {sample.wchan or '?'})")
            event = self._event_for_state_locked(record, tid=sample.d_tids[0], wchan=sample.wchan)
            if event is not None:
                events.append(event)
        return events

    def _event_for_state_locked(
        self, record: _Watched, *, tid: int | None = None, wchan: str = ""
    ) -> WorkerEvent | None:
        kind = {
            WorkerState.EXITED: EventKind.DIED,
            WorkerState.ZOMBIE: EventKind.DIED,
            WorkerState.WEDGED: EventKind.WEDGED,
            WorkerState.UNKILLABLE: EventKind.UNKILLABLE,
        }.get(record.state)
        if kind is None or kind in record.reported:
            return None
        record.reported.add(kind)
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
            log = logger.error if event.kind is not EventKind.DIED else logger.warning
            log("liveness: %s", event.message)
            for callback in subscribers:
                self._call(callback, event)

    @staticmethod
    def _call(callback: Subscriber, event: WorkerEvent) -> None:
        try:
            callback(event)
        except Exception:
            logger.exception("liveness subscriber %r raised; ignored", callback)

    # ----------------------------------------------------------------- watcher thread

    def start(self) -> None:
        """Start the background watcher thread; a no-op if it is running. Thread-safe."""
        with self._lock:
            if self._closed:
                raise RuntimeError("WorkerProcessMonitor is closed")
            if self._is_foreign_process() or (self._thread is not None and self._thread.is_alive()):
                return
            self._stop_requested = False
            self._thread = threading.Thread(
                target=_watch, args=(weakref.ref(self), self._epoll, self._wake_r),
                name="trtllm-liveness-watcher", daemon=True,
            )
            self._thread.start()

    def stop(self, timeout: float = 1.0) -> bool:
        """Stop the watcher and join it for at most ``timeout`` seconds.

        Idempotent. Returns True when no watcher is running afterwards. Must not be called from
        a subscriber (it would wait for its own thread; that case returns False at once).
        """
        with self._lock:
            thread = self._thread
            self._stop_requested = True
        self._wake()
        if thread is None:
            return True
        if thread is threading.current_thread():
            return False
        thread.join(timeout)
        return not thread.is_alive()

    def close(self, timeout: float = 1.0) -> None:
        """Stop the watcher and release every pidfd. Idempotent; further registers raise."""
        self.stop(timeout)
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for record in self._records.values():
                if record.pidfd is not None:
                    self._close_pidfd_locked(record)
            self._procfs_only.clear()
            self._subscribers.clear()
        if self._thread is None or not self._thread.is_alive():
            self._finalizer()

    def __enter__(self) -> WorkerProcessMonitor:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # pipe full (a wakeup is already pending) or closed

    def _tick_timeout(self) -> float:
        """Seconds until the watcher must wake without an event; -1 blocks indefinitely."""
        with self._lock:
            intervals = []
            if self._procfs_only:
                intervals.append(self._procfs_interval_s)
            if self._d_state_timeout_s is not None and any(
                r.wedge is not None and r.state in (WorkerState.ALIVE, WorkerState.WEDGED)
                for r in self._records.values()
            ):
                intervals.append(self._scan_interval_s)
            return min(intervals) if intervals else -1.0

    def _run_tick(self, ready: list[tuple[int, int]], scan_due: bool) -> None:
        events: list[WorkerEvent] = []
        with self._lock:
            if self._closed:
                return
            events.extend(self._handle_ready_locked(ready))
            events.extend(self._poll_procfs_locked())
            if scan_due:
                events.extend(self._scan_wedges_locked(time.monotonic()))
        self._deliver(events)

    def _is_foreign_process(self) -> bool:
        if os.getpid() == self._owner_pid:
            return False
        logger.warning("WorkerProcessMonitor used in a forked child (pid %d); ignoring", os.getpid())
        return True


def _watch(ref: weakref.ReferenceType[WorkerProcessMonitor], epoll: select.epoll | None, wake_r: int) -> None:
    """Watcher loop. Holds the monitor only by weakref between waits, so a dropped monitor ends it."""
    next_scan = 0.0
    try:
        while True:
            monitor = ref()
            if monitor is None or monitor._stop_requested or monitor._closed:
                return
            timeout = monitor._tick_timeout()
            del monitor
            if epoll is not None:
                ready = epoll.poll(timeout)
            else:
                # No pidfd support at all: wait on the wakeup pipe alone; procfs ticks do the rest.
                readable, _, _ = select.select([wake_r], [], [], None if timeout < 0 else timeout)
                if readable:
                    _drain(wake_r)
                ready = []
            monitor = ref()
            if monitor is None:
                return
            now = time.monotonic()
            scan_due = now >= next_scan
            if scan_due:
                next_scan = now + monitor._scan_interval_s
            monitor._run_tick(ready, scan_due)
            del monitor
    except BaseException as exc:  # fail loudly: the engine must not become silently unmonitored
        monitor = ref()
        if monitor is not None:
            monitor._watcher_error = exc
        logger.critical(
            "liveness watcher thread died (%r); worker deaths are now seen only by synchronous "
            "checks (check_health / find_dead_worker)", exc, exc_info=True,
        )


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except (BlockingIOError, OSError):
        pass


def _release_fds(epoll: select.epoll | None, wake_r: int, wake_w: int, by_fd: dict[int, _Watched]) -> None:
    for fd in list(by_fd):
        try:
            os.close(fd)
        except OSError:
            pass
    by_fd.clear()
    if epoll is not None:
        epoll.close()
    for fd in (wake_w, wake_r):
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
