"""Real uninterruptible sleep without cgroup v1: a FUSE mount whose lookups are never answered (root).

:class:`FuseStall` mounts a file system (:mod:`._fuse_mounts`) served by a thread of this process
that speaks the raw FUSE protocol on ``/dev/fuse`` (:mod:`._fuse_server`, no libfuse). It answers
``FUSE_INIT`` and otherwise reads every request and never replies, so a process that calls
``stat()`` on a path inside the mount waits in the kernel for an answer that never comes. It is a
second stand-in, next to the cgroup v1 freezer (:mod:`._cgroup_faults`), for a worker wedged in a
GPU driver, and works where cgroup v2 is mounted instead. The tests' stall
(``tests/support/fuse_stall.py``) serves two files in the mount besides: one whose READ is held
(a process stuck in a page fault) and one whose every READ is answered late (the healthy
look-alike of a wedge).

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
from ._fuse_server import FuseServer

# The mount helpers are re-exported: callers set up and clean up FUSE stalls through this module.
__all__ = ["MOUNT_PREFIX", "FuseStall", "fuse_available", "fuse_mounts", "remove_leftover_mounts"]

logger = logging.getLogger(__name__)

# The stuck child: one stat() into the mount; an error after release (ENOTCONN) exits quietly.
_STAT_CODE = "import os, sys\ntry:\n    os.stat(sys.argv[1])\nexcept OSError:\n    sys.exit(3)\n"

_DEFAULT_TIMEOUT_S = 10.0


class FuseStall(FuseServer):
    """A FUSE mount where ``stat()`` of any name blocks in ``D`` until :meth:`release`.

    Use it as a context manager. :meth:`__enter__` raises ``OSError`` when it cannot be made (see
    :func:`fuse_available`). A caller that stats a :meth:`new_path` shows ``D`` at
    once (wchan ``request_wait_answer``); once :meth:`wait_held` is true for it, SIGKILL stays
    pending and it stays in ``D`` until :meth:`release`, which ends every wait.

    It is its own server (:class:`~._fuse_server.FuseServer`): the query ``wait_held`` is the server's.
    """

    def __init__(self, timeout: float = _DEFAULT_TIMEOUT_S) -> None:
        super().__init__()
        self.timeout = timeout
        self.mountpoint = ""
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
