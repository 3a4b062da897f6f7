"""The raw FUSE protocol server behind :class:`~._fuse_stall.FuseStall`: no libfuse, a thread that
reads requests from ``/dev/fuse`` and answers only what a stall needs.

The wire format is Linux's ``include/uapi/linux/fuse.h``: each request starts with a
``fuse_in_header`` (length, opcode, unique id, node id, caller's uid/gid/pid), each reply with a
``fuse_out_header`` (length, negative errno, unique id). The server claims protocol 7.38 but uses
nothing beyond 7.23's layouts, and answers an older kernel with the shorter ``fuse_init_out``.
Node 1 is the root directory; a subclass may serve files in it (:meth:`FuseServer._answer_file`),
and answer some requests late (:meth:`FuseServer._answer_due`, woken by
:meth:`FuseServer._until_due_ms`): the tests' held-read and slow-read files
(``tests/support/fuse_stall.py``).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import select
import struct
import threading
from collections.abc import Callable

__all__ = ["FuseServer"]

logger = logging.getLogger(__name__)

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


def _is_own_thread(tid: int) -> bool:
    # /proc/self/task lists only this thread group: another process's tid is not found there.
    return tid > 0 and os.path.exists(f"/proc/self/task/{tid}")


class FuseServer:
    """The thread that serves one ``/dev/fuse`` connection and holds its requests unanswered.

    It answers ``FUSE_INIT`` (asking for ``FUSE_PARALLEL_DIROPS``), an ``FUSE_INTERRUPT`` with
    ``ENOSYS`` (which sets the connection's ``no_interrupt``; the interrupted request of the
    priming child, :attr:`prime_pid`, is then answered ``ENOENT`` so the child can die), what the
    files of a subclass need (:meth:`_answer_file`), and ``EIO`` to this process's own threads; every
    other request is read and held: its caller waits in the kernel until the connection is aborted.

    Lifecycle: :meth:`start` on the connection's descriptor (owned by the caller, who aborts the
    connection and closes it), :meth:`stop` the thread, then :meth:`close` (the wake-up pipe and
    the held requests). The queries and waits are thread-safe.
    """

    def __init__(self) -> None:
        self.prime_pid = 0  # the priming child: its interrupted request is answered
        self._dev_fd = -1
        self._wake_r = self._wake_w = -1
        self._thread: threading.Thread | None = None
        self._cond = threading.Condition()
        self._stopped = False
        self._primed = False
        self._held: dict[int, int] = {}  # unique id of each unanswered request -> caller tid

    def start(self, dev_fd: int) -> None:
        """Serve ``dev_fd`` (opened ``O_NONBLOCK``) on a daemon thread until :meth:`stop`."""
        self._dev_fd = dev_fd
        # A wake-up pipe polled with the connection: a thread blocked in read(2) keeps the file
        # alive, and closing it alone would not end the thread.
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._thread = threading.Thread(target=self._serve, name="trtllm-liveness-fuse-stall", daemon=True)
        self._thread.start()

    def stop(self, timeout: float) -> None:
        """Make the thread stop reading and wait for it at most ``timeout`` seconds. Idempotent."""
        self._stopped = True
        if self._wake_w >= 0:
            with contextlib.suppress(OSError):
                os.write(self._wake_w, b"x")
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.debug("FUSE stall server thread did not stop within %.1f s", timeout)

    def close(self) -> None:
        """Close the wake-up pipe (after :meth:`stop`), forget every held request (their callers were
        released with the connection) and wake every waiter. Idempotent."""
        self._close_fds("_wake_r", "_wake_w")
        with self._cond:
            self._held.clear()
            self._cond.notify_all()

    def _close_fds(self, *names: str) -> None:
        """Close each descriptor attribute named in ``names`` that is open, and mark it closed (-1)."""
        for name in names:
            fd = getattr(self, name)
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError as exc:
                    logger.debug("closing %s failed: %s", name, exc)
                setattr(self, name, -1)

    # ------------------------------------------------------------------ queries

    def wait_held(self, tid: int, timeout: float) -> bool:
        """Wait until a request from thread ``tid`` (a pid for a one-thread process) is held; False
        on timeout or after :meth:`stop`. From then on SIGKILL cannot end that thread before the
        connection is aborted."""
        return self._wait_until(lambda: tid in self._held.values(), timeout)

    def _wait_until(self, held: Callable[[], bool], timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: held() or self._stopped, timeout) and held()

    def wait_primed(self, timeout: float) -> bool:
        """Wait until an INTERRUPT was answered ``ENOSYS`` (``no_interrupt`` set); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._primed, timeout)

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
        elif _is_own_thread(tid):
            self._reply(unique, -errno.EIO)
        elif not self._answer_file(opcode, unique, nodeid, data):
            with self._cond:
                self._held[unique] = tid
                self._cond.notify_all()

    def _answer_file(self, opcode: int, unique: int, nodeid: int, data: bytes) -> bool:
        """Answer a request for a file the server serves (server thread); False leaves it held. A
        plain server serves none: it holds every such request."""
        return False
