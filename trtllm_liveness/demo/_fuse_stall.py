"""Real uninterruptible sleep without cgroup v1: a FUSE mount whose lookups are never answered (root).

:class:`FuseStall` mounts a file system (:mod:`._fuse_mounts`) served by a thread of this process
that speaks the raw FUSE protocol on ``/dev/fuse`` (:mod:`._fuse_server`, no libfuse). It answers
``FUSE_INIT`` and otherwise reads every request and never replies, so a process that calls
``stat()`` on a path inside the mount waits in the kernel for an answer that never comes. One file
is the exception, :attr:`FuseStall.read_path`: its lookup, attributes, open, flush and release are
answered and only its ``READ`` is held, so a process can open and ``mmap`` it and then gets stuck
in the page fault (a stand-in for a fault on an NFS or GPU-unified-memory mapping). The other
exception is the healthy look-alike of a wedge, :attr:`FuseStall.slow_read_path`: every ``READ`` of
it is answered, each after a delay of 100-300 ms (``read_delay_s``), so its reader sleeps in ``D``
most of the time while it makes progress, as one streaming weights from a network file system does
(``tests/support/slow_reads.py`` runs such a reader). It is a second
stand-in, next to the cgroup v1 freezer (:mod:`._cgroup_faults`), for a worker wedged in a GPU
driver, and works where cgroup v2 is mounted instead.

What the kernel does (Linux ``fs/fuse``; measured on 6.18, see the tests):

- Until ``FUSE_INIT`` is answered, a request waits in ``fuse_get_req`` in a *killable* sleep: the
  task shows ``D`` but SIGKILL ends it. That is not a wedge, so :class:`FuseStall` answers INIT.
- Once INIT is answered, a request that the server has read waits in ``request_wait_answer``:
  first *interruptibly* (state ``S``: any signal turns into a ``FUSE_INTERRUPT`` request for the
  server), then killably (``D``), and once a fatal signal is pending and the server holds the
  request, *uninterruptibly* (``D``): SIGKILL stays pending and the task cannot die.
- A server that answers an INTERRUPT with ``ENOSYS`` sets the connection's ``no_interrupt``: from
  then on every request skips the interruptible wait. :class:`FuseStall` provokes one INTERRUPT at
  start-up (a short-lived "priming" child whose held lookup is SIGKILLed, then answered ``ENOENT``
  so it can die), so that every later caller shows ``D`` at once, like a task stuck in a driver.
- A SIGKILL that arrives before the server has *read* the request still ends the caller (the kernel
  drops the unsent request). :meth:`FuseStall.wait_held` tells when a caller's request is read;
  from then on the caller is unkillable until :meth:`FuseStall.release`. The kill wakes it from the
  killable wait into the uninterruptible one, so it shows ``R`` for a moment (~1-10 ms) in between.
- Aborting the connection (the last ``/dev/fuse`` file closed, or ``umount2`` with ``MNT_FORCE``)
  ends every wait with ``ENOTCONN``: the callers return, and those with SIGKILL pending die.

A page fault on :attr:`FuseStall.read_path` holds the target's mmap lock only on some paths:
the ordinary fault (``filemap_fault``) drops it (or the per-VMA lock) before it waits for the
READ, but a fault made by ``get_user_pages`` without ``FOLL_UNLOCKABLE`` (``/proc/PID/mem``,
``ptrace(PEEKDATA)``) keeps ``mmap_read_lock`` for the whole wait: a writer (``mmap``/``munmap``)
then queues behind it, and every later reader of that mm (``/proc/PID/cmdline``, ``environ``,
``maps``) queues behind the writer. ``tests/unittest/diagnose/test_scan_nonblocking.py`` builds exactly that process.

Each caller should use its own name (:meth:`FuseStall.new_path`): a second lookup of a name that
is already being looked up waits on the first one in the VFS (``d_alloc_parallel``), not in FUSE,
so the server never sees it (INIT asks for ``FUSE_PARALLEL_DIROPS``: without it even different
names in one directory queue on a mutex in ``fuse_lock_inode``). Requests from this process's own
threads are answered ``EIO`` at once, so that a stray ``os.path.exists()`` in the owner cannot hang
it (SIGALRM-based test timeouts could not end it). Not thread-safe apart from the query methods;
one owner each.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import subprocess
import sys
import tempfile
from types import TracebackType

from ._fuse_mounts import (
    DEV_FUSE,
    MOUNT_PREFIX,
    fuse_available,
    fuse_mounts,
    mount_fuse,
    remove_leftover_mounts,
    umount_fuse,
)
from ._fuse_server import HELD_READ_NAME, SLOW_READ_DELAY_S, SLOW_READ_NAME, FuseServer

# The mount helpers are re-exported: callers set up and clean up FUSE stalls through this module.
__all__ = ["MOUNT_PREFIX", "FuseStall", "fuse_available", "fuse_mounts", "remove_leftover_mounts"]

logger = logging.getLogger(__name__)

# The stuck child: one stat() into the mount; an error after release (ENOTCONN) exits quietly.
_STAT_CODE = "import os, sys\ntry:\n    os.stat(sys.argv[1])\nexcept OSError:\n    sys.exit(3)\n"

_DEFAULT_TIMEOUT_S = 10.0
_MAX_READ_DELAY_S = 10.0  # a late answer is still an answer: waits on it stay bounded


class FuseStall(FuseServer):
    """A FUSE mount where ``stat()`` of any name blocks in ``D`` until :meth:`release`.

    Use it as a context manager. :meth:`__enter__` raises ``OSError`` when it cannot be made (see
    :func:`fuse_available`). A caller that stats a :meth:`new_path` shows ``D`` at
    once (wchan ``request_wait_answer``); once :meth:`wait_held` is true for it, SIGKILL stays
    pending and it stays in ``D`` until :meth:`release`, which ends every wait.

    :attr:`read_path` is a regular read-only file of :data:`~._fuse_server.HELD_READ_SIZE` bytes that opens and
    maps normally; reading it (``read(2)`` or a page fault on a mapping) blocks the same way, in
    the READ request (:meth:`wait_read_held`).

    :attr:`slow_read_path` is a regular read-only file (opened for direct I/O: no page cache) whose
    every READ is answered, after a delay drawn uniformly from ``read_delay_s`` (seconds, at most
    10) for each READ; byte ``i`` is ``i % SLOW_READ_PERIOD``. A reader shows ``D`` in
    ``request_wait_answer`` most of the time, and its context-switch count grows with each answer.
    Raises ``ValueError`` for a ``read_delay_s`` outside ``0 <= low <= high <= 10``.

    It is its own server (:class:`~._fuse_server.FuseServer`): the queries ``held_tids``,
    ``wait_held``, ``wait_read_held`` and ``slow_reads_answered`` are the server's.
    """

    def __init__(self, timeout: float = _DEFAULT_TIMEOUT_S,
                 read_delay_s: tuple[float, float] = SLOW_READ_DELAY_S) -> None:
        low, high = read_delay_s
        if not 0 <= low <= high <= _MAX_READ_DELAY_S:
            raise ValueError(f"read_delay_s must be 0 <= low <= high <= {_MAX_READ_DELAY_S:g}, not {read_delay_s}")
        super().__init__(read_delay_s)
        self.timeout = timeout
        self.mountpoint = ""
        self.read_path = ""  # <mountpoint>/held-read: opens and maps; its READ is never answered
        self.slow_read_path = ""  # <mountpoint>/slow-read: every READ answered, late
        self._mounted = False
        self._released = False
        self._names = 0

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> FuseStall:
        try:
            self._start()
        except BaseException:
            self.release()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()

    def _start(self) -> None:
        if self._released or self._mounted:
            raise RuntimeError("a FuseStall is entered once")
        self.mountpoint = tempfile.mkdtemp(prefix=f"{MOUNT_PREFIX}-{os.getpid()}-")
        self.read_path = os.path.join(self.mountpoint, HELD_READ_NAME)
        self.slow_read_path = os.path.join(self.mountpoint, SLOW_READ_NAME)
        # Non-blocking, so that the server thread can poll it together with its wake-up pipe.
        self._dev_fd = os.open(DEV_FUSE, os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK)
        code = mount_fuse(self._dev_fd, self.mountpoint)
        if code:
            raise OSError(code, f"mount(2) of a fuse file system failed: {os.strerror(code)}", self.mountpoint)
        self._mounted = True
        self.start(self._dev_fd)
        self._prime()

    def _prime(self) -> None:
        """Get the connection's ``no_interrupt`` set, so that callers sleep in ``D`` from the start.

        The kernel sends an INTERRUPT only for a request the server has read and a caller that got
        a signal; the priming child is that caller. Its request is then answered, so it dies.
        """
        child = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _STAT_CODE, os.path.join(self.mountpoint, ".prime")],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.prime_pid = child.pid
        try:
            if not self.wait_held(child.pid, self.timeout):
                raise OSError(errno.ETIMEDOUT, "the priming child's request never reached the FUSE server")
            child.kill()
            if not self.wait_primed(self.timeout):
                raise OSError(errno.ETIMEDOUT, "the kernel sent no FUSE_INTERRUPT for the priming child")
            try:
                child.wait(self.timeout)
            except subprocess.TimeoutExpired:
                raise OSError(errno.ETIMEDOUT, "the priming child did not exit once answered") from None
        finally:
            if child.returncode is None:
                with contextlib.suppress(OSError):
                    child.kill()
                self.release()  # aborting the connection lets the killed child die
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.wait(self.timeout)

    def release(self) -> None:
        """End every stuck caller's wait, unmount and remove the mountpoint. Idempotent; never raises.

        Callers with SIGKILL pending die at once; the others get ``ENOTCONN``.
        """
        if self._released:
            return
        self._released = True
        self.stop(self.timeout)
        if self._mounted:
            umount_fuse(self.mountpoint)  # aborts the connection: releases the callers
            self._mounted = False
        self._close_fds("_dev_fd")
        if self.mountpoint:
            try:
                os.rmdir(self.mountpoint)
            except FileNotFoundError:
                pass
            except OSError as exc:
                logger.debug("cannot remove FUSE mountpoint %s: %s", self.mountpoint, exc)
        self.close()

    # ------------------------------------------------------------------ queries

    def new_path(self) -> str:
        """A fresh path in the mount for one more caller (each name is looked up once at a time)."""
        self._names += 1
        return os.path.join(self.mountpoint, f"stall-{self._names}")

    def stuck_child_cmd(self, path: str | None = None) -> list[str]:
        """argv of a process that stats ``path`` (default: a :meth:`new_path`) and so gets stuck.

        Start it with ``start_new_session=True`` and wait for :meth:`wait_held` before killing it.
        After :meth:`release` it exits (status 3 when it was not killed).
        """
        return [sys.executable, "-I", "-S", "-c", _STAT_CODE, path or self.new_path()]
