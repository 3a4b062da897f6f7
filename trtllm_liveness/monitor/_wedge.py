"""Uninterruptible-sleep (``D``) detection, per thread, with a timeout.

A worker wedged in the GPU driver, NCCL or RDMA often has its *main* thread in ``S`` while one
helper thread is stuck in ``D``; torchrun's check reads only the main thread and misses it. Here
every thread of ``/proc/<pid>/task`` is sampled. A thread in ``D`` with SIGKILL pending cannot die
until the kernel lets go: that is "unkillable".

Sampling is the watcher's only periodic cost, so :class:`ThreadSampler` keeps it small: one
``pread`` of a kept ``/proc/<pid>/stat`` fd for a single-threaded process, plus one small read per
extra thread, with the thread list cached between scans.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

from .._events import EventKind
from ..process import _procfs


@dataclass(frozen=True)
class DStateSample:
    """The threads of one process found in ``D`` at one instant."""

    d_tids: tuple[int, ...]
    kill_pending: bool
    wchan: str


def _d_sample(pid: int, states: dict[int, str]) -> DStateSample | None:
    d_tids = tuple(sorted(tid for tid, state in states.items() if state in _procfs.UNINTERRUPTIBLE_STATES))
    if not d_tids:
        return None
    kill_pending = _procfs.sigkill_pending(pid) or any(_safe_thread_kill_pending(pid, tid) for tid in d_tids)
    return DStateSample(d_tids, kill_pending, _procfs.read_wchan(pid, d_tids[0]))


def sample_d_state(pid: int) -> DStateSample | None:
    """Sample ``pid``'s threads once, without caching; None when no thread is in ``D``.

    Raises ``FileNotFoundError``/``ProcessLookupError`` when the process is gone. Costs one
    ``listdir`` and one small read per thread; the signal mask and wait channel are read only
    when a ``D`` thread is found.
    """
    return _d_sample(pid, _procfs.read_thread_states(pid))


def _safe_thread_kill_pending(pid: int, tid: int) -> bool:
    try:
        return _procfs.sigkill_pending(pid, tid)
    except (FileNotFoundError, ProcessLookupError):
        return False


class ThreadSampler:
    """Samples one process's thread states scan after scan, as cheaply as procfs allows.

    Keeps ``/proc/<pid>/stat`` open (it pins the process: after a reap, reads fail instead of
    showing a process that reused the PID) and caches the list of other threads. The cache is
    exact while the thread count in ``stat`` is unchanged and every cached thread still answers:
    a thread that vanished fails to read, and one that appeared without another vanishing changes
    the count; either forces a fresh ``listdir``.

    ``sample`` and ``close`` may be called from different threads (a per-sampler lock orders them,
    so a closed fd number is never read after reuse); ``sample`` itself has one caller at a time.
    """

    def __init__(self, pid: int, start_time: int) -> None:
        self.pid = pid
        self.start_time = start_time
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._closed = False
        self._tids: list[int] = []  # threads other than the main one, from the last listing

    def sample(self) -> DStateSample | None:
        """Sample once; None when no thread is in ``D``.

        Raises ``ProcessLookupError``/``FileNotFoundError`` when the process is gone (or the
        sampler is closed), another ``OSError`` when procfs cannot be read now (e.g. ``EMFILE``),
        ``ValueError`` on malformed procfs content. Blocks only for procfs reads.
        """
        with self._lock:
            if self._closed:
                raise ProcessLookupError(f"sampler for pid {self.pid} is closed")
            main_state, num_threads = _procfs.parse_state_and_threads(self._read_main())
            states = {self.pid: main_state}
            if num_threads > 1:
                states.update(self._other_thread_states(num_threads))
        return _d_sample(self.pid, states)

    def _read_main(self) -> bytes:
        if self._fd is not None:
            return _procfs.pread_stat(self._fd)
        try:
            fd = _procfs.open_stat(self.pid)
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            raise
        except OSError:
            # Out of descriptors (EMFILE): read without keeping one, and try to keep one next time.
            # Without a kept fd nothing pins the process, so verify this read like the first one.
            data = _procfs.read_task_stat(self.pid, self.pid)
            self._check_start_time(data)
            return data
        try:
            data = _procfs.pread_stat(fd)
            self._check_start_time(data)
        except BaseException:
            os.close(fd)  # never leak the fd on a reused PID or a malformed/failed read
            raise
        self._fd = fd
        return data

    def _check_start_time(self, data: bytes) -> None:
        if _procfs.parse_stat(data).start_time != self.start_time:
            raise ProcessLookupError(f"pid {self.pid} was reused")

    def _other_thread_states(self, num_threads: int) -> dict[int, str]:
        states: dict[int, str] = {}
        for attempt in range(2):
            if attempt or len(self._tids) != num_threads - 1:
                self._tids = [tid for tid in _procfs.list_tids(self.pid) if tid != self.pid]
            states.clear()
            vanished = False
            for tid in self._tids:
                try:
                    data = _procfs.read_task_stat(self.pid, tid)
                except (FileNotFoundError, ProcessLookupError):
                    vanished = True
                    continue
                state = _procfs.thread_state_of(data)
                if state:
                    states[tid] = state
            if not vanished:
                break
        return states

    def close(self, *, force: bool = False) -> None:
        """Release the kept fd. Idempotent; waits for a sample in progress (microseconds).

        ``force`` skips the lock: only for a forked child, where no sampling thread exists and a
        lock copied while held would never be released.
        """
        if force:
            self._closed = True
            fd, self._fd = self._fd, None
        else:
            with self._lock:
                self._closed = True
                fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


class WedgeTracker:
    """Turns successive samples of one process into at most one WEDGED and one UNKILLABLE verdict.

    WEDGED: one thread has been in ``D`` on every sample for at least ``timeout_s`` (tracked per
    thread, so several threads each dipping into ``D`` briefly, as under heavy I/O, do not add
    up). UNKILLABLE: ``D`` with SIGKILL pending on two consecutive samples, i.e. it survived
    SIGKILL for at least one sampling interval (a process that is merely exiting passes through
    ``D`` briefly and must not be flagged). Not thread-safe: one owner samples it.
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.d_since_by_tid: dict[int, float] = {}
        self.kill_pending_scans = 0
        self.reported: set[EventKind] = set()
        self.last_sample: DStateSample | None = None

    @property
    def d_since(self) -> float | None:
        """Monotonic time since which the longest-stuck thread has been in ``D``, or None."""
        return min(self.d_since_by_tid.values()) if self.d_since_by_tid else None

    def observe(self, sample: DStateSample | None, now: float) -> EventKind | None:
        """Feed one sample taken at monotonic time ``now``; return a newly reached verdict."""
        self.last_sample = sample
        if sample is None:
            self.d_since_by_tid.clear()
            self.kill_pending_scans = 0
            return None
        self.d_since_by_tid = {tid: self.d_since_by_tid.get(tid, now) for tid in sample.d_tids}
        self.kill_pending_scans = self.kill_pending_scans + 1 if sample.kill_pending else 0
        if self.kill_pending_scans >= 2 and EventKind.UNKILLABLE not in self.reported:
            self.reported.add(EventKind.UNKILLABLE)
            return EventKind.UNKILLABLE
        if self.d_seconds(now) >= self.timeout_s and not self.reported:
            self.reported.add(EventKind.WEDGED)
            return EventKind.WEDGED
        return None

    def d_seconds(self, now: float) -> float:
        """How long the longest-stuck thread has been seen in ``D`` (0 when none is)."""
        since = self.d_since
        return 0.0 if since is None else now - since

    def stuck_tid(self) -> int | None:
        """The thread that has been in ``D`` longest, if any."""
        if not self.d_since_by_tid:
            return None
        return min(self.d_since_by_tid, key=lambda tid: (self.d_since_by_tid[tid], tid))


class WedgeScan:
    """When the watcher samples thread states for wedges: the ``D``-state timeout each rank's
    :class:`WedgeTracker` gets, whether verdicts are armed, and when the next scan is due.
    Guarded by the monitor's lock (``enabled`` may be read without it)."""

    def __init__(self, timeout_s: float | None, interval_s: float, *, armed: bool) -> None:
        self.timeout_s = timeout_s if timeout_s is not None and timeout_s > 0 else None
        self.interval_s = interval_s
        self.armed = armed
        self.next_at = 0.0  # monotonic

    @property
    def enabled(self) -> bool:
        """Whether wedge verdicts are being made: armed, with a timeout."""
        return self.armed and self.timeout_s is not None

    def arm(self, timeout_s: float | None) -> bool:
        """Arm; a positive ``timeout_s`` replaces the timeout, 0 or less turns detection off. The
        next scan is due at once. False (nothing changed) when already armed and no timeout given."""
        if timeout_s is None and self.armed:
            return False
        self.armed = True
        if timeout_s is not None:
            self.timeout_s = timeout_s if timeout_s > 0 else None
        self.next_at = time.monotonic()
        return True

    def take_due(self, now: float) -> bool:
        """Whether a scan is due at monotonic ``now``; if so the next one is scheduled."""
        if now < self.next_at:
            return False
        self.next_at = now + self.interval_s
        return True
