"""Per-thread sampling of a process for uninterruptible sleep (``D``).

A worker wedged in the GPU driver, NCCL or RDMA often has its *main* thread in ``S`` while one
helper thread is stuck in ``D``; torchrun's check reads only the main thread and misses it. Here
every thread of ``/proc/<pid>/task`` is sampled. A thread in ``D`` with SIGKILL pending cannot die
until the kernel lets go: that is "unkillable". A thread in ``D`` on every sample may still be
working, so a sample carries each ``D`` thread's switch count, read with its signal bits
(docs/diagnosis.md, "When ``D`` is a wedge", says why and what that read costs).

Sampling is the watcher's only periodic cost, so :class:`ThreadSampler` keeps it small: one
``pread`` of a kept ``stat`` fd per thread (the process's and, within a per-process budget of
descriptors, each other thread's), with the thread list cached between scans. :func:`sample_d_state` is the one-off
form (a stop's report on a survivor, a scan). What a run of samples means (wedged after a timeout,
unkillable) is :mod:`trtllm_liveness.monitor._wedge`'s job.
"""

from __future__ import annotations

import os
import resource
import threading
from dataclasses import dataclass

from . import _procfs

__all__ = ["DStateSample", "ThreadSampler", "sample_d_state"]

KEPT_THREAD_FDS_MAX = 1024
"""How many other threads' ``stat`` fds all samplers of this process keep open at most (a kept
fd's re-read costs about a third of an open-read-close), and never more than an eighth of the
process's descriptor limit (the server's own sockets and files come first); threads beyond it
are read by path."""


class _FdBudget:
    """The process-wide count of kept thread fds, claimed and returned by the samplers."""

    def __init__(self, cap: int) -> None:
        self._lock = threading.Lock()
        self.cap = cap
        self.used = 0

    def limit(self) -> int:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        return self.cap if soft == resource.RLIM_INFINITY else min(self.cap, soft // 8)

    def claim(self) -> bool:
        limit = self.limit()
        with self._lock:
            if self.used >= limit:
                return False
            self.used += 1
            return True

    def release(self, count: int) -> None:
        with self._lock:
            self.used -= count

    def after_fork(self) -> None:
        # A forked child has no sampling thread; the lock may have been copied while held.
        self._lock = threading.Lock()


_budget = _FdBudget(KEPT_THREAD_FDS_MAX)
os.register_at_fork(after_in_child=_budget.after_fork)


@dataclass(frozen=True)
class DStateSample:
    """The threads of one process found in ``D`` at one instant, and whether each has run since.

    ``switches`` holds each ``d_tids`` thread's context-switch count (``voluntary_ctxt_switches +
    nonvoluntary_ctxt_switches``), in the same order; None where its ``status`` could not be read
    (the thread ended meanwhile). ``kill_pending`` comes from the same reads: SIGKILL queued for one
    of these threads or for the process. ``wchan`` is the first ``D`` thread's wait channel.
    """

    d_tids: tuple[int, ...]
    kill_pending: bool
    wchan: str
    switches: tuple[int | None, ...]

    def __post_init__(self) -> None:
        if len(self.switches) != len(self.d_tids):
            raise ValueError(f"{len(self.switches)} switch counts for {len(self.d_tids)} threads in D")

    def switches_of(self, tid: int) -> int | None:
        """Thread ``tid``'s context-switch count at this sample; None when it was not in ``D`` or
        its count could not be read."""
        for d_tid, switches in zip(self.d_tids, self.switches, strict=True):
            if d_tid == tid:
                return switches
        return None

    def held_since(self, before: DStateSample) -> tuple[int, ...]:
        """The threads in ``D`` at ``before`` and at this sample that never ran in between: their
        context-switch count, read both times, did not change (the kernel's hung-task rule)."""
        return tuple(tid for tid, switches in zip(self.d_tids, self.switches, strict=True)
                     if switches is not None and before.switches_of(tid) == switches)


def _d_sample(pid: int, states: dict[int, str]) -> DStateSample | None:
    d_tids = _procfs.uninterruptible_tids(states)
    if not d_tids:
        return None
    # One read of each D thread's status gives both its SIGKILL bits (the thread's own and its
    # process's queue) and its switch count; threads not in D are never read.
    statuses = [_thread_status(pid, tid) for tid in d_tids]
    kill_pending = any(status is not None and status.sigkill_pending for status in statuses)
    switches = tuple(None if status is None else status.context_switches for status in statuses)
    return DStateSample(d_tids, kill_pending, _first_wchan(pid, d_tids), switches)


def _thread_status(pid: int, tid: int) -> _procfs.StatusInfo | None:
    # Read by path, never kept: only threads seen in D get here.
    try:
        return _procfs.read_status(pid, tid)
    except (FileNotFoundError, ProcessLookupError):
        return None  # it ended since its state was read


def _first_wchan(pid: int, d_tids: tuple[int, ...]) -> str:
    # A thread seen in D a moment ago may have ended since (threads pass through D as they exit).
    for tid in d_tids:
        try:
            return _procfs.read_wchan(pid, tid)
        except (FileNotFoundError, ProcessLookupError):
            continue
    return ""


def sample_d_state(pid: int) -> DStateSample | None:
    """Sample ``pid``'s threads once, without caching; None when no thread is in ``D``.

    Raises ``FileNotFoundError``/``ProcessLookupError`` when the process is gone. Costs one
    ``listdir`` and one small read per thread; each ``D`` thread's ``status`` (signal masks and
    context switches) and one wait channel are read only when a ``D`` thread is found.
    """
    return _d_sample(pid, _procfs.read_thread_states(pid))


class ThreadSampler:
    """Samples one process's thread states scan after scan, as cheaply as procfs allows.

    Keeps ``/proc/<pid>/stat`` open (it pins the process: after a reap, reads fail instead of
    showing a process that reused the PID), caches the list of other threads and keeps each one's
    ``/proc/<pid>/task/<tid>/stat`` open while the process-wide budget
    (:data:`KEPT_THREAD_FDS_MAX`) allows (such an fd pins its thread the same way). The cache is
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
        self._thread_fds: dict[int, int] = {}  # kept stat fds of threads in _tids, by tid
        self.state = ""  # the process's state letter at the last sample (``T``: stopped by a signal)

    def sample(self) -> DStateSample | None:
        """Sample once; None when no thread is in ``D``.

        Raises ``ProcessLookupError``/``FileNotFoundError`` when the process is gone (or the
        sampler is closed), another ``OSError`` when procfs cannot be read now (e.g. ``EMFILE``),
        ``ValueError`` on malformed procfs content. Blocks only for procfs reads.
        """
        with self._lock:
            if self._closed:
                raise ProcessLookupError(f"sampler for pid {self.pid} is closed")
            main_state, num_threads = _procfs.parse_state_and(self._read_main(), _procfs.NUM_THREADS_INDEX)
            self.state = main_state
            states = {self.pid: main_state}
            if num_threads > 1:
                states.update(self._other_thread_states(num_threads))
            elif self._tids:
                self._forget_threads()
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
            data = _procfs.read_stat_bytes(self.pid, self.pid)
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
                self._relist()
            states.clear()
            vanished = False
            for tid in self._tids:
                try:
                    data = self._read_thread(tid)
                except (FileNotFoundError, ProcessLookupError):
                    vanished = True
                    continue
                state = _procfs.thread_state_of(data)
                if state:
                    states[tid] = state
            if not vanished:
                break
        return states

    def _relist(self) -> None:
        self._tids = [tid for tid in _procfs.list_tids(self.pid) if tid != self.pid]
        listed = set(self._tids)
        self._close_thread_fds([tid for tid in self._thread_fds if tid not in listed])

    def _forget_threads(self) -> None:
        # The process is down to its main thread: the others' fds pin threads that are gone.
        self._close_thread_fds(list(self._thread_fds))
        self._tids = []

    def _close_thread_fds(self, tids: list[int]) -> None:
        for tid in tids:
            os.close(self._thread_fds.pop(tid))
        _budget.release(len(tids))

    def _read_thread(self, tid: int) -> bytes:
        fd = self._thread_fds.get(tid)
        if fd is not None:
            try:
                return _procfs.pread_stat(fd)
            except (FileNotFoundError, ProcessLookupError):
                del self._thread_fds[tid]
                os.close(fd)
                _budget.release(1)
                raise
        if not _budget.claim():
            return _procfs.read_stat_bytes(self.pid, tid)
        try:
            fd = _procfs.open_stat(self.pid, tid)
        except (FileNotFoundError, ProcessLookupError):
            _budget.release(1)
            raise
        except OSError:
            _budget.release(1)  # out of descriptors (EMFILE): read by path this time
            return _procfs.read_stat_bytes(self.pid, tid)
        try:
            data = _procfs.pread_stat(fd)
        except BaseException:
            os.close(fd)
            _budget.release(1)
            raise
        self._thread_fds[tid] = fd
        return data

    def close(self) -> None:
        """Release the kept fds. Idempotent; waits for a sample in progress (microseconds)."""
        with self._lock:
            self._closed = True
            fd, self._fd = self._fd, None
            thread_fds, self._thread_fds = self._thread_fds, {}
        for kept in ([] if fd is None else [fd]) + list(thread_fds.values()):
            os.close(kept)
        _budget.release(len(thread_fds))
