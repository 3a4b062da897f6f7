"""The FUSE stall of tests and benchmarks: :class:`~trtllm_liveness.demo._fuse_stall.FuseStall`
serving two files in its mount, with the queries only tests make and the argv of a process that
gets stuck in it.

Node 2 is the held-read file (:data:`HELD_READ_NAME`, :attr:`FuseStall.read_path`): its lookup,
attributes, open, flush and release are answered and only its ``READ`` is held, so a process can
open and ``mmap`` it and then gets stuck in the page fault (a stand-in for a fault on an NFS or
GPU-unified-memory mapping). Node 3 is the slow-read file (:data:`SLOW_READ_NAME`,
:attr:`FuseStall.slow_read_path`), answered the same way, whose every READ is answered too, each
after a delay drawn uniformly from the stall's ``read_delay_s`` range (100-300 ms by default): its
reader sleeps in ``D`` (``request_wait_answer``) most of the time, yet every read completes, as
one streaming weights from a network file system does (the healthy look-alike of a wedge;
``tests/support/slow_reads.py`` runs such a reader). The server thread never sleeps for a delay:
due answers wait in a heap, and the thread's ``poll`` wakes when the first is due.

A page fault on :attr:`FuseStall.read_path` holds the target's mmap lock only on some paths:
the ordinary fault (``filemap_fault``) drops it (or the per-VMA lock) before it waits for the
READ, but a fault made by ``get_user_pages`` without ``FOLL_UNLOCKABLE`` (``/proc/PID/mem``,
``ptrace(PEEKDATA)``) keeps ``mmap_read_lock`` for the whole wait: a writer (``mmap``/``munmap``)
then queues behind it, and every later reader of that mm (``/proc/PID/cmdline``, ``environ``,
``maps``) queues behind the writer. ``tests/unittest/diagnose/test_scan_nonblocking.py`` builds exactly that process.
"""

from __future__ import annotations

import errno
import functools
import heapq
import math
import os
import random
import struct
import sys
import time

from trtllm_liveness.demo import _fuse_stall
from trtllm_liveness.demo._fuse_stall import _IN_HEADER

__all__ = ["HELD_READ_NAME", "HELD_READ_SIZE", "SLOW_READ_DELAY_S", "SLOW_READ_NAME", "SLOW_READ_PERIOD",
           "SLOW_READ_SIZE", "FuseStall"]

_READ_IN = struct.Struct("<QQI")  # the start of struct fuse_read_in: fh, offset, size
_FUSE_LOOKUP = 1
_FUSE_GETATTR = 3
_FUSE_OPEN = 14
_FUSE_READ = 15
_FUSE_RELEASE = 18
_FUSE_FLUSH = 25

# The one file whose READ (only) is held: see FuseStall.read_path.
HELD_READ_NAME = "held-read"
HELD_READ_SIZE = 1 << 20
# The file whose every READ is answered late: see FuseStall.slow_read_path. Byte ``i`` of it is
# ``i % SLOW_READ_PERIOD``, so a reader can check what it got.
SLOW_READ_NAME = "slow-read"
SLOW_READ_SIZE = 1 << 40
SLOW_READ_PERIOD = 251
_ROOT_NODEID = 1
_HELD_READ_NODEID = 2
_SLOW_READ_NODEID = 3
_FILES = {HELD_READ_NAME.encode(): (_HELD_READ_NODEID, HELD_READ_SIZE),
          SLOW_READ_NAME.encode(): (_SLOW_READ_NODEID, SLOW_READ_SIZE)}
_FILE_SIZES = dict(_FILES.values())
# FOPEN_DIRECT_IO: every read(2) of the slow-read file is a READ request, none is served from the page cache.
_FOPEN_DIRECT_IO = 1
# The most a READ asks for: FUSE_MAX_MAX_PAGES (256) pages of 4 KiB; a larger request gets a short answer.
_MAX_READ_ANSWER = 256 * 4096
# How late each READ of the slow-read file is answered by default, in seconds (drawn per READ).
SLOW_READ_DELAY_S = (0.1, 0.3)
_MAX_READ_DELAY_S = 10.0  # a late answer is still an answer: waits on it stay bounded
# struct fuse_attr: ino, size, blocks, atime, mtime, ctime, atimensec, mtimensec, ctimensec, mode,
# nlink, uid, gid, rdev, blksize, flags.
_ATTR = struct.Struct("<QQQQQQIIIIIIIIII")
_ENTRY_OUT_HEAD = struct.Struct("<QQQQII")  # nodeid, generation, entry_valid, attr_valid, *_nsec
_ATTR_OUT_HEAD = struct.Struct("<QII")  # attr_valid, attr_valid_nsec, dummy
_OPEN_OUT = struct.Struct("<QIi")  # fh, open_flags, backing_id
# Long validity, so the kernel does not come back to revalidate while a caller is stuck.
_VALID_S = 3600


class FuseStall(_fuse_stall.FuseStall):
    """A :class:`~trtllm_liveness.demo._fuse_stall.FuseStall` with the held-read and slow-read files.

    :attr:`read_path` is a regular read-only file of :data:`HELD_READ_SIZE` bytes that opens and
    maps normally; reading it (``read(2)`` or a page fault on a mapping) blocks the same way, in
    the READ request (:meth:`wait_read_held`).

    :attr:`slow_read_path` is a regular read-only file (opened for direct I/O: no page cache) whose
    every READ is answered, after a delay drawn uniformly from ``read_delay_s`` (seconds, at most
    10) for each READ (a pending answer is dropped when the connection is aborted); byte ``i`` is
    ``i % SLOW_READ_PERIOD``. A reader shows ``D`` in ``request_wait_answer`` most of the time, and
    its context-switch count grows with each answer. Raises ``ValueError`` for a ``read_delay_s``
    outside ``0 <= low <= high <= 10``.

    The queries ``held_tids``, ``wait_held``, ``wait_read_held`` and ``slow_reads_answered`` are
    thread-safe.
    """

    def __init__(self, timeout: float = _fuse_stall._DEFAULT_TIMEOUT_S,
                 read_delay_s: tuple[float, float] = SLOW_READ_DELAY_S) -> None:
        low, high = read_delay_s
        if not 0 <= low <= high <= _MAX_READ_DELAY_S:
            raise ValueError(f"read_delay_s must be 0 <= low <= high <= {_MAX_READ_DELAY_S:g}, not {read_delay_s}")
        super().__init__(timeout)
        self.read_delay_s = read_delay_s
        self.read_path = ""  # <mountpoint>/held-read: opens and maps; its READ is never answered
        self.slow_read_path = ""  # <mountpoint>/slow-read: every READ answered, late
        self._held_reads: set[int] = set()  # unique ids in _held that are READs of the held-read file
        self._slow_answers = 0  # READs of the slow-read file answered
        # Owned by the server thread: (due monotonic time, unique id, payload) of each late answer.
        self._due: list[tuple[float, int, bytes]] = []
        self._random = random.Random()

    def __enter__(self) -> FuseStall:
        super().__enter__()
        return self

    def _start(self) -> None:
        super()._start()
        self.read_path = os.path.join(self.mountpoint, HELD_READ_NAME)
        self.slow_read_path = os.path.join(self.mountpoint, SLOW_READ_NAME)

    # ------------------------------------------------------------------ queries

    def held_tids(self) -> set[int]:
        """Thread ids whose request the server has read and holds unanswered."""
        with self._cond:
            return set(self._held.values())

    def wait_read_held(self, tid: int, timeout: float) -> bool:
        """Wait until a READ of the held-read file from thread ``tid`` is held; False on timeout.

        The kernel sends the READ from the thread that reads or faults (readahead here is
        synchronous: INIT does not offer ``FUSE_ASYNC_READ``).
        """
        return self._wait_until(lambda: any(self._held.get(unique) == tid for unique in self._held_reads), timeout)

    def slow_reads_answered(self) -> int:
        """How many READs of the slow-read file were answered (with data) so far."""
        with self._cond:
            return self._slow_answers

    def stuck_child_cmd(self, path: str | None = None) -> list[str]:
        """argv of a process that stats ``path`` (default: a :meth:`new_path`) and so gets stuck.

        Start it with ``start_new_session=True`` and wait for :meth:`wait_held` before killing it.
        After :meth:`release` it exits (status 3 when it was not killed).
        """
        return [sys.executable, "-I", "-S", "-c", _fuse_stall._STAT_CODE, path or self.new_path()]

    # ------------------------------------------------------------------ server thread

    def _until_due_ms(self) -> int:
        """The poll timeout: until the first late answer is due (-1: none pending, wait for input)."""
        if not self._due:
            return -1
        return max(0, math.ceil((self._due[0][0] - time.monotonic()) * 1000))

    def _answer_due(self) -> None:
        now = time.monotonic()
        answered = 0
        while self._due and self._due[0][0] <= now:
            _, unique, payload = heapq.heappop(self._due)
            answered += self._reply(unique, 0, payload)
        if answered:
            with self._cond:
                self._slow_answers += answered
                self._cond.notify_all()

    def _answer_file(self, opcode: int, unique: int, nodeid: int, data: bytes) -> bool:
        """Answer what the held-read and slow-read files need to be opened and mapped, and the
        slow-read file's READ (late); False leaves the request held.

        Everything but the held-read file's READ is answered: the lookup of their names, their
        attributes, open, flush (sent by every close) and release; an opcode this server does not
        implement gets ENOSYS.
        """
        if opcode == _FUSE_LOOKUP:
            name = data[_IN_HEADER.size:].split(b"\0", 1)[0]
            if nodeid != _ROOT_NODEID or name not in _FILES:
                return False
            file_nodeid, _ = _FILES[name]
            entry = _ENTRY_OUT_HEAD.pack(file_nodeid, 0, _VALID_S, _VALID_S, 0, 0)
            self._reply(unique, 0, entry + self._file_attr(file_nodeid))
            return True
        if nodeid not in _FILE_SIZES:
            return False
        if opcode == _FUSE_READ and nodeid == _HELD_READ_NODEID:
            with self._cond:
                self._held_reads.add(unique)
            return False
        if opcode == _FUSE_READ:
            _, offset, size = _READ_IN.unpack_from(data, _IN_HEADER.size)
            self._answer_late(unique, offset, min(size, _MAX_READ_ANSWER, max(0, SLOW_READ_SIZE - offset)))
        elif opcode == _FUSE_GETATTR:
            self._reply(unique, 0, _ATTR_OUT_HEAD.pack(_VALID_S, 0, 0) + self._file_attr(nodeid))
        elif opcode == _FUSE_OPEN:
            flags = _FOPEN_DIRECT_IO if nodeid == _SLOW_READ_NODEID else 0
            self._reply(unique, 0, _OPEN_OUT.pack(0, flags, 0))
        elif opcode in (_FUSE_FLUSH, _FUSE_RELEASE):
            self._reply(unique, 0)
        else:
            self._reply(unique, -errno.ENOSYS)
        return True

    def _answer_late(self, unique: int, offset: int, size: int) -> None:
        """Queue the answer to a READ of the slow-read file: its bytes, due after a random delay."""
        start = offset % SLOW_READ_PERIOD
        payload = _slow_read_pattern()[start:start + size]
        low, high = self.read_delay_s
        heapq.heappush(self._due, (time.monotonic() + self._random.uniform(low, high), unique, payload))

    @staticmethod
    def _file_attr(nodeid: int) -> bytes:
        mode = 0o100444  # S_IFREG | r--r--r--
        size = _FILE_SIZES[nodeid]
        return _ATTR.pack(nodeid, size, size // 512, 0, 0, 0, 0, 0, 0, mode, 1, os.geteuid(), os.getegid(), 0, 4096, 0)


@functools.cache
def _slow_read_pattern() -> bytes:
    """The slow-read file's repeating content, long enough for any answer from any offset."""
    return bytes(range(SLOW_READ_PERIOD)) * (_MAX_READ_ANSWER // SLOW_READ_PERIOD + 2)
