"""Reads of ``/proc/<pid>`` files that take the target's mmap lock, bounded so they never hang the reader.

``/proc/<pid>/cmdline`` and ``environ`` (``access_remote_vm``), ``smaps``, ``smaps_rollup`` and
``numa_maps`` take the target's ``mmap_lock`` for read. Behind a task that holds that lock while it
waits on a FUSE, NFS or GPU-unified-memory page, with a writer (``mmap``/``munmap``) queued, the
reader sleeps in ``D`` with no timeout: the classic "``ps`` hangs". ``stat``, ``status``, ``wchan``,
``task/*/stat``, ``cgroup`` and ``ns/*`` do not go through the mm and are read directly.

:class:`MmReader` does each such read on a daemon helper thread and waits for it with a deadline
(:func:`read_cmdline` is the command line read that way). Design, and why:

- **One helper at a time, reused while it answers in time, abandoned when stuck.** The scan waits
  for each read in turn, so a pool would buy nothing; a thread per read would cost a thread start
  per process of the host for ``scan --name``. A helper that misses its deadline is never waited
  for again (a thread in ``D`` can be neither killed nor joined): the next read gets a fresh helper,
  so one stuck read does not stall the later ones.
- **Bounded leak.** At most ``max_stuck`` abandoned helpers per reader; after that every further
  read is skipped with that reason instead of leaking more threads. A target whose read timed out
  is not read again (its lock is still held), which costs no second thread.
- **Exit is never blocked.** Helpers are daemon threads, and the lock wait in the kernel
  (``mmap_read_lock_killable``) is killable: ``exit_group`` ends a stuck helper with the process.
- **Tasks seen in ``D`` are not read at all** by callers that can do without the content (the
  scan's report): a thread in ``D`` may be the one holding the lock. Its callers take the thread
  states from ``task/*/stat``, which does not take the lock.

Standard library only. Thread-safe: one reader may be shared; each call waits for its own read.
"""

from __future__ import annotations

import enum
import logging
import threading
from dataclasses import dataclass

from .._record_fields import JsonRecord
from . import _procfs

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 0.5
DEFAULT_MAX_STUCK = 4


class SkipReason(str, enum.Enum):
    """Why a read that takes the target's mm lock was not made or gave no result."""

    TASK_IN_D = "task-in-d"
    TIMED_OUT = "timed-out"
    LOCK_STUCK = "lock-stuck"  # an earlier read of this target timed out: its lock is still held
    NO_HELPER = "no-helper"  # max_stuck helpers are already stuck: no more threads are leaked


@dataclass(frozen=True)
class SkippedRead(JsonRecord):
    """One ``/proc/<pid>/<file>`` read that was skipped, and why (``detail`` is for people)."""

    pid: int
    file: str
    reason: SkipReason
    detail: str


def skip_for_d(pid: int, file: str, tids: list[int]) -> SkippedRead:
    """The record of a read not made because threads ``tids`` of ``pid`` are in ``D``."""
    shown = " ".join(map(str, tids[:4])) + (" ..." if len(tids) > 4 else "")
    return SkippedRead(pid, file, SkipReason.TASK_IN_D,
                       f"{file} skipped: task in D (thread {shown}); reading it could hang on its mm lock")


class _Job:
    __slots__ = ("data", "done", "error", "path")

    def __init__(self, path: str) -> None:
        self.path = path
        self.done = threading.Event()
        self.data = b""
        self.error: OSError | None = None


class _Helper:
    """A daemon thread that reads one job after another until it is abandoned or stopped."""

    def __init__(self, index: int) -> None:
        self._cond = threading.Condition()
        self._job: _Job | None = None
        self.abandoned = False
        self._thread = threading.Thread(target=self._run, name=f"trtllm-liveness-mm-read-{index}", daemon=True)
        self._thread.start()

    def submit(self, job: _Job) -> None:
        with self._cond:
            self._job = job
            self._cond.notify()

    def abandon(self) -> None:
        """Never give it work again; it exits once its read returns (if ever). Never blocks."""
        with self._cond:
            self.abandoned = True
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                # Idle helpers wake now and then, so that one left behind by a reader that was
                # dropped without close() still ends (it is a daemon: it never delays exit).
                while self._job is None and not self.abandoned:
                    self._cond.wait(5.0)
                job, self._job = self._job, None
            if job is None:
                return
            try:
                job.data = _procfs.read_whole(job.path)
            except OSError as exc:
                job.error = exc
            job.done.set()
            with self._cond:
                if self.abandoned:
                    return


class MmReader:
    """Reads ``/proc/<pid>/<file>`` on an abandonable helper thread, each with a deadline.

    :meth:`read` blocks at most ``timeout_s``. After ``max_stuck`` helpers got stuck, reads are
    skipped at once. :meth:`close` stops the idle helper (stuck ones end with their read, or with
    the process). Usable as a context manager; thread-safe.
    """

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S, max_stuck: int = DEFAULT_MAX_STUCK) -> None:
        if not timeout_s > 0:
            raise ValueError("timeout_s must be positive")
        if max_stuck < 1:
            raise ValueError("max_stuck must be at least 1")
        self.timeout_s = timeout_s
        self.max_stuck = max_stuck
        self._lock = threading.Lock()  # one read at a time: the helper serves one job
        self._helper: _Helper | None = None
        self._started = 0
        self._stuck_pids: set[int] = set()
        self.stuck_helpers = 0

    def __enter__(self) -> MmReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Let the idle helper exit. Idempotent; never blocks."""
        with self._lock:
            if self._helper is not None:
                self._helper.abandon()
                self._helper = None

    def read(self, pid: int, file: str) -> bytes | SkippedRead:
        """The content of ``/proc/<pid>/<file>``, or why it was skipped.

        Raises ``OSError`` as the read did (``FileNotFoundError``/``ProcessLookupError`` when the
        process is gone, ``PermissionError``). Blocks at most ``timeout_s`` (plus waiting for a
        concurrent call of the same reader).
        """
        with self._lock:
            if pid in self._stuck_pids:
                return SkippedRead(pid, file, SkipReason.LOCK_STUCK,
                                   f"{file} skipped: an earlier read of this process timed out (its mm lock is held)")
            if self.stuck_helpers >= self.max_stuck:
                return SkippedRead(pid, file, SkipReason.NO_HELPER,
                                   f"{file} skipped: {self.stuck_helpers} earlier reads are still stuck")
            if self._helper is None:
                self._started += 1
                self._helper = _Helper(self._started)
            job = _Job(f"{_procfs.PROCFS_PATH}/{pid}/{file}")
            self._helper.submit(job)
            if not job.done.wait(self.timeout_s):
                self._helper.abandon()
                self._helper = None
                self.stuck_helpers += 1
                self._stuck_pids.add(pid)
                logger.warning("reading /proc/%d/%s timed out after %.2g s (its mm lock is held); the helper "
                               "thread is abandoned (%d stuck)", pid, file, self.timeout_s, self.stuck_helpers)
                return SkippedRead(pid, file, SkipReason.TIMED_OUT,
                                   f"{file} read timed out after {self.timeout_s:g} s (its mm lock is held)")
        if job.error is not None:
            raise job.error
        return job.data


def read_cmdline(pid: int, reader: MmReader, d_tids: list[int] | None) -> tuple[tuple[str, ...], SkippedRead | None]:
    """The command line of ``pid`` read through ``reader``; skipped when ``d_tids`` is not empty.

    ``d_tids=None`` reads even a process in D (with the reader's deadline). Empty when unreadable
    or gone (kernel threads and zombies have none).
    """
    if d_tids:
        return (), skip_for_d(pid, "cmdline", d_tids)
    try:
        data = reader.read(pid, "cmdline")
    except OSError:
        return (), None
    if isinstance(data, SkippedRead):
        return (), data
    return tuple(part.decode("utf-8", "replace") for part in data.split(b"\0") if part), None
