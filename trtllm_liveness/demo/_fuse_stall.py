"""Real uninterruptible sleep without cgroup v1: a FUSE mount whose lookups are never answered (root).

:class:`FuseStall` mounts a file system (:mod:`._fuse_mounts`) served by a thread of this process
that speaks the raw FUSE protocol on ``/dev/fuse`` (no libfuse). It answers
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

The wire format is Linux's ``include/uapi/linux/fuse.h``: each request starts with a
``fuse_in_header`` (length, opcode, unique id, node id, caller's uid/gid/pid), each reply with a
``fuse_out_header`` (length, negative errno, unique id). The server claims protocol 7.38 but uses
nothing beyond 7.23's layouts, and answers an older kernel with the shorter ``fuse_init_out``.
Node 1 is the root directory; a subclass may serve files in it (:meth:`FuseStall._answer_file`),
and answer some requests late (:meth:`FuseStall._answer_due`, woken by
:meth:`FuseStall._until_due_ms`): the tests' held-read and slow-read files.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import select
import struct
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
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

# The mount helpers are re-exported: callers set up and clean up FUSE stalls through this module.
__all__ = ["MOUNT_PREFIX", "FuseStall", "fuse_available", "fuse_mounts", "remove_leftover_mounts"]

logger = logging.getLogger(__name__)

# The stuck child: one stat() into the mount; an error after release (ENOTCONN) exits quietly.
_STAT_CODE = "import os, sys\ntry:\n    os.stat(sys.argv[1])\nexcept OSError:\n    sys.exit(3)\n"

_DEFAULT_TIMEOUT_S = 10.0

# read(2) on /dev/fuse fails with EINVAL when the buffer is smaller than FUSE_MIN_READ_BUFFER (8192)
# or the largest request the connection may send (max_write plus a page of headers).
_READ_SIZE = 1 << 20

# struct fuse_in_header: len, opcode, unique, nodeid, uid, gid, pid, total_extlen, padding.
_IN_HEADER = struct.Struct("<IIQQIIIHH")
# struct fuse_out_header: len, error (a negative errno), unique.
_OUT_HEADER = struct.Struct("<IiQ")
# struct fuse_init_out (64 bytes since protocol 7.23): major, minor, max_readahead, flags,
# max_background, congestion_threshold, max_write, time_gran, max_pages, map_alignment, flags2,
# unused[7]. Zero limits keep the kernel's defaults.
_INIT_OUT = struct.Struct("<IIIIHHIIHHI7I")
_INIT_OUT_COMPAT_SIZE = 24  # what a kernel older than 7.23 expects
_INIT_IN = struct.Struct("<II")  # the start of struct fuse_init_in: major, minor
_INTERRUPT_IN = struct.Struct("<Q")  # struct fuse_interrupt_in: the unique id of the interrupted request

_FUSE_MAJOR = 7
_FUSE_MINOR = 38  # the highest minor this server claims; it uses nothing beyond 7.23's layout
# The one optional feature asked for. Without it the kernel serializes lookups in a directory on a
# mutex (fuse_lock_inode), so a second caller would sleep there, never reaching the server.
_FUSE_PARALLEL_DIROPS = 1 << 18
_FUSE_FORGET = 2
_FUSE_INIT = 26
_FUSE_INTERRUPT = 36
_FUSE_BATCH_FORGET = 42
_NO_REPLY_OPCODES = frozenset({_FUSE_FORGET, _FUSE_BATCH_FORGET})


class FuseStall:
    """A FUSE mount where ``stat()`` of any name blocks in ``D`` until :meth:`release`.

    Use it as a context manager. :meth:`__enter__` raises ``OSError`` when it cannot be made (see
    :func:`fuse_available`). A caller that stats a :meth:`new_path` shows ``D`` at
    once (wchan ``request_wait_answer``); once :meth:`wait_held` is true for it, SIGKILL stays
    pending and it stays in ``D`` until :meth:`release`, which ends every wait.

    It is its own server: a thread that serves the mount's ``/dev/fuse`` connection and holds its
    requests unanswered. It answers ``FUSE_INIT`` (asking for ``FUSE_PARALLEL_DIROPS``), an
    ``FUSE_INTERRUPT`` with ``ENOSYS`` (which sets the connection's ``no_interrupt``; the interrupted
    request of the priming child, :attr:`prime_pid`, is then answered ``ENOENT`` so the child can
    die), what the files of a subclass need (:meth:`_answer_file`), and ``EIO`` to this process's own
    threads; every other request is read and held: its caller waits in the kernel until
    :meth:`release` aborts the connection. The queries and waits are thread-safe.
    """

    def __init__(self, timeout: float = _DEFAULT_TIMEOUT_S) -> None:
        self.timeout = timeout
        self.mountpoint = ""
        self.prime_pid = 0  # the priming child: its interrupted request is answered
        self._mounted = False
        self._released = False
        self._names = 0
        self._dev_fd = -1
        self._wake_r = self._wake_w = -1
        self._thread: threading.Thread | None = None
        self._cond = threading.Condition()
        self._stopped = False
        self._primed = False
        self._held: dict[int, int] = {}  # unique id of each unanswered request -> caller tid

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
        # A wake-up pipe polled with the connection: a thread blocked in read(2) keeps the file
        # alive, and closing it alone would not end the thread.
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._thread = threading.Thread(target=self._serve, name="trtllm-liveness-fuse-stall", daemon=True)
        self._thread.start()
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

        Callers with SIGKILL pending die at once; the others get ``ENOTCONN``. The server thread
        stops first (waited for at most the stall's timeout); every held request is forgotten and
        every waiter woken at the end.
        """
        if self._released:
            return
        self._released = True
        self._stopped = True
        if self._wake_w >= 0:
            with contextlib.suppress(OSError):
                os.write(self._wake_w, b"x")
        if self._thread is not None:
            self._thread.join(self.timeout)
            if self._thread.is_alive():
                logger.debug("FUSE stall server thread did not stop within %.1f s", self.timeout)
        if self._mounted:
            umount_fuse(self.mountpoint)  # aborts the connection: releases the callers
            self._mounted = False
        for name in ("_dev_fd", "_wake_r", "_wake_w"):
            fd = getattr(self, name)
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError as exc:
                    logger.debug("closing %s failed: %s", name, exc)
                setattr(self, name, -1)
        if self.mountpoint:
            try:
                os.rmdir(self.mountpoint)
            except FileNotFoundError:
                pass
            except OSError as exc:
                logger.debug("cannot remove FUSE mountpoint %s: %s", self.mountpoint, exc)
        with self._cond:
            self._held.clear()
            self._cond.notify_all()

    # ------------------------------------------------------------------ queries

    def new_path(self) -> str:
        """A fresh path in the mount for one more caller (each name is looked up once at a time)."""
        self._names += 1
        return os.path.join(self.mountpoint, f"stall-{self._names}")

    def wait_held(self, tid: int, timeout: float) -> bool:
        """Wait until a request from thread ``tid`` (a pid for a one-thread process) is held; False
        on timeout or after the release. From then on SIGKILL cannot end that thread before the
        connection is aborted."""
        return self._wait_until(lambda: tid in self._held.values(), timeout)

    def _wait_until(self, held: Callable[[], bool], timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: held() or self._stopped, timeout) and held()

    def wait_primed(self, timeout: float) -> bool:
        """Wait until an INTERRUPT was answered ``ENOSYS`` (``no_interrupt`` set); False on timeout."""
        return self._wait_until(lambda: self._primed, timeout)

    # ------------------------------------------------------------------ server thread

    def _serve(self) -> None:
        poller = select.poll()
        poller.register(self._dev_fd, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        try:
            while True:
                ready = poller.poll(self._until_due_ms())
                if any(fd == self._wake_r for fd, _ in ready):
                    return
                self._answer_due()
                if not any(fd == self._dev_fd for fd, _ in ready):
                    continue
                try:
                    data = os.read(self._dev_fd, _READ_SIZE)
                except BlockingIOError:
                    continue
                except OSError as exc:  # ENODEV: the connection was aborted
                    logger.debug("FUSE stall server stops: %s", exc)
                    return
                self._handle(data)
        except Exception:  # never let the thread die with a traceback on stderr
            logger.debug("FUSE stall server failed", exc_info=True)

    def _until_due_ms(self) -> int:
        """The poll timeout: until the first late answer is due (-1: none pending, wait for input).
        A plain server has no late answers; a subclass that queues some overrides it."""
        return -1

    def _answer_due(self) -> None:
        """Send the late answers that are due (server thread): none in a plain server."""

    def _reply(self, unique: int, error: int, payload: bytes = b"") -> bool:
        try:
            os.write(self._dev_fd, _OUT_HEADER.pack(_OUT_HEADER.size + len(payload), error, unique) + payload)
        except OSError as exc:  # ENOENT: the request is gone (its caller was released)
            logger.debug("FUSE reply to %d failed: %s", unique, exc)
            return False
        return True

    def _handle(self, data: bytes) -> None:
        if len(data) < _IN_HEADER.size:
            return
        _, opcode, unique, nodeid, _, _, tid, _, _ = _IN_HEADER.unpack_from(data)
        if opcode == _FUSE_INIT:
            _, minor = _INIT_IN.unpack_from(data, _IN_HEADER.size)
            minor = min(minor, _FUSE_MINOR)
            out = _INIT_OUT.pack(_FUSE_MAJOR, minor, 0, _FUSE_PARALLEL_DIROPS, 0, 0, 0, 0, 0, 0, 0, *([0] * 7))
            self._reply(unique, 0, out if minor >= 23 else out[:_INIT_OUT_COMPAT_SIZE])
        elif opcode == _FUSE_INTERRUPT:
            (target,) = _INTERRUPT_IN.unpack_from(data, _IN_HEADER.size)
            # ENOSYS must come while the interrupted request is still unanswered (the kernel looks
            # it up); it sets no_interrupt for the connection.
            primed = self._reply(unique, -errno.ENOSYS)
            with self._cond:
                self._primed = self._primed or primed
                release = self._held.get(target) == self.prime_pid
                if release:
                    del self._held[target]
                self._cond.notify_all()
            if release:
                self._reply(target, -errno.ENOENT)
        elif opcode in _NO_REPLY_OPCODES:
            pass
        elif tid > 0 and os.path.exists(f"/proc/self/task/{tid}"):
            # One of this process's own threads: /proc/self/task lists only this thread group.
            self._reply(unique, -errno.EIO)
        elif not self._answer_file(opcode, unique, nodeid, data):
            with self._cond:
                self._held[unique] = tid
                self._cond.notify_all()

    def _answer_file(self, opcode: int, unique: int, nodeid: int, data: bytes) -> bool:
        """Answer a request for a file the server serves (server thread); False leaves it held. A
        plain server serves none: it holds every such request."""
        return False
