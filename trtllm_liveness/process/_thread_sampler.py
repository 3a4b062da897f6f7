"""Per-thread sampling of a process for uninterruptible sleep (``D``).

A worker wedged in the GPU driver, NCCL or RDMA often has its *main* thread in ``S`` while one
helper thread is stuck in ``D``; torchrun's check reads only the main thread and misses it. Here
every thread of ``/proc/<pid>/task`` is sampled. A thread in ``D`` with SIGKILL pending cannot die
until the kernel lets go: that is "unkillable".

Sampling is the watcher's only periodic cost, so :class:`ThreadSampler` keeps it small: one
``pread`` of a kept ``/proc/<pid>/stat`` fd for a single-threaded process, plus one small read per
extra thread, with the thread list cached between scans. :func:`sample_d_state` is the one-off
form (a stop's report on a survivor, a scan). What a run of samples means (wedged after a timeout,
unkillable) is :mod:`trtllm_liveness.monitor._wedge`'s job.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

from . import _procfs

__all__ = ["DStateSample", "ThreadSampler", "sample_d_state"]


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
