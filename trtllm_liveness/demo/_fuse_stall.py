"""Real uninterruptible sleep without cgroup v1: a FUSE mount whose lookups are never answered (root).

:class:`FuseStall` mounts a file system served by a thread of this process that speaks the raw
FUSE protocol on ``/dev/fuse`` (no libfuse). It answers ``FUSE_INIT`` and otherwise reads every
request and never replies, so a process that calls ``stat()`` on a path inside the mount waits in
the kernel for an answer that never comes. One file is the exception,
:attr:`FuseStall.read_path`: its lookup, attributes, open, flush and release are answered and only
its ``READ`` is held, so a process can open and ``mmap`` it and then gets stuck in the page fault
(a stand-in for a fault on an NFS or GPU-unified-memory mapping). It is a second stand-in, next to the cgroup v1 freezer
(:mod:`._faults`), for a worker wedged in a GPU driver, and works where cgroup v2 is mounted instead.

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
``maps``) queues behind the writer. :data:`MEM_FAULT_TARGET_CODE` builds exactly that process.

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
import ctypes
import errno
import functools
import logging
import os
import select
import struct
import subprocess
import sys
import tempfile
import threading
from types import TracebackType

__all__ = [
    "FUSE_FSTYPE",
    "FUSE_SOURCE",
    "HELD_READ_NAME",
    "HELD_READ_SIZE",
    "MEM_FAULT_TARGET_CODE",
    "MOUNT_PREFIX",
    "FuseStall",
    "fuse_available",
    "fuse_mounts",
    "remove_leftover_mounts",
]

logger = logging.getLogger(__name__)

DEV_FUSE = "/dev/fuse"
FUSE_SOURCE = "trtllm-liveness"
# "fuse.<subtype>": the kernel's fuse file system with a subtype, so /proc/mounts tells ours apart.
FUSE_FSTYPE = "fuse.trtllm-liveness"
# Mountpoints are <tmp>/<MOUNT_PREFIX>-<owner pid>-<random>: leftovers of a dead owner are found by name.
MOUNT_PREFIX = "trtllm-liveness-fuse"

_MS_NOSUID = 2
_MS_NODEV = 4
_MNT_FORCE = 1  # runs fuse_umount_begin(), which aborts the connection
_MNT_DETACH = 2  # lazy: detach now even while busy

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
_FUSE_LOOKUP = 1
_FUSE_FORGET = 2
_FUSE_GETATTR = 3
_FUSE_OPEN = 14
_FUSE_READ = 15
_FUSE_RELEASE = 18
_FUSE_FLUSH = 25
_FUSE_INIT = 26
_FUSE_INTERRUPT = 36
_FUSE_BATCH_FORGET = 42
_NO_REPLY_OPCODES = frozenset({_FUSE_FORGET, _FUSE_BATCH_FORGET})

# The one file whose READ (only) is held: see FuseStall.read_path.
HELD_READ_NAME = "held-read"
HELD_READ_SIZE = 1 << 20
_ROOT_NODEID = 1
_HELD_READ_NODEID = 2
# struct fuse_attr: ino, size, blocks, atime, mtime, ctime, atimensec, mtimensec, ctimensec, mode,
# nlink, uid, gid, rdev, blksize, flags.
_ATTR = struct.Struct("<QQQQQQIIIIIIIIII")
_ENTRY_OUT_HEAD = struct.Struct("<QQQQII")  # nodeid, generation, entry_valid, attr_valid, *_nsec
_ATTR_OUT_HEAD = struct.Struct("<QII")  # attr_valid, attr_valid_nsec, dummy
_OPEN_OUT = struct.Struct("<QIi")  # fh, open_flags, backing_id
# Long validity, so the kernel does not come back to revalidate while a caller is stuck.
_VALID_S = 3600

# The stuck child: one stat() into the mount; an error after release (ENOTCONN) exits quietly.
_STAT_CODE = "import os, sys\ntry:\n    os.stat(sys.argv[1])\nexcept OSError:\n    sys.exit(3)\n"

# A process stuck in a page fault on the held READ while holding its mmap lock, with a second
# thread queued on that lock for write. argv: the held-read path, then a name for the process's
# comm (prctl PR_SET_NAME; at most 15 bytes). Both threads are started first (starting a thread
# maps its stack, which would queue on the lock too), then it prints "<fault tid> <mmap tid>" and
# lets them go. The fault goes through /proc/self/mem: get_user_pages without FOLL_UNLOCKABLE
# keeps mmap_read_lock across the READ (an ordinary fault would drop it); the other thread's
# mmap(2) then waits for mmap_write_lock. After release the read fails and the process exits 3.
MEM_FAULT_TARGET_CODE = """\
import ctypes, mmap, os, sys, threading, time
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.prctl(15, sys.argv[2].encode()[:15], 0, 0, 0)
fd = os.open(sys.argv[1], os.O_RDONLY)
addr = libc.mmap(None, 4096, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
if addr in (None, ctypes.c_void_p(-1).value):
    sys.exit(f"mmap failed: {os.strerror(ctypes.get_errno())}")
mem = os.open("/proc/self/mem", os.O_RDONLY)
go = threading.Event()
def fault():
    go.wait(60)
    try:
        os.pread(mem, 1, addr)
    except OSError:
        pass
def remap():
    go.wait(60)
    time.sleep(0.2)  # let the fault take the lock first: the writer must queue behind it
    try:
        mmap.mmap(-1, 4096).close()
    except OSError:
        pass
a = threading.Thread(target=fault, daemon=True)
b = threading.Thread(target=remap, daemon=True)
a.start(); b.start()
sys.stdout.write(f"{a.native_id} {b.native_id}\\n"); sys.stdout.flush()
go.set()
a.join(3600); b.join(3600)  # stuck until the test releases the FUSE server (or kills this)
sys.exit(3)
"""

_DEFAULT_TIMEOUT_S = 10.0


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    libc.mount.restype = ctypes.c_int
    libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
    libc.umount2.restype = ctypes.c_int
    return libc


def _mount(fd: int, mountpoint: str) -> int:
    """Mount a fuse file system served on ``fd`` at ``mountpoint``; 0 or the errno.

    ``rootmode=40000`` makes the root a directory; ``user_id``/``group_id`` name the only user the
    kernel lets in without ``allow_other`` (the owner, root here).
    """
    options = f"fd={fd},rootmode=40000,user_id={os.geteuid()},group_id={os.getegid()}"
    libc = _libc()
    if libc.mount(FUSE_SOURCE.encode(), os.fsencode(mountpoint), FUSE_FSTYPE.encode(),
                  _MS_NOSUID | _MS_NODEV, options.encode()) == 0:
        return 0
    return ctypes.get_errno() or errno.EIO


def _umount(mountpoint: str) -> None:
    """Abort the connection (``MNT_FORCE``) and detach the mount (``MNT_DETACH``). Never raises.

    Forcing matters: it releases every stuck caller even when a forked copy of the ``/dev/fuse``
    descriptor keeps the connection open; detaching succeeds while the mount is still busy.
    """
    libc = _libc()
    path = os.fsencode(mountpoint)
    for flags in (_MNT_FORCE | _MNT_DETACH, _MNT_DETACH):
        if libc.umount2(path, flags) == 0:
            return
        code = ctypes.get_errno()
        if code == errno.EINVAL:  # not a mount point (any more)
            return
        logger.debug("umount2(%s, %#x) failed: %s", mountpoint, flags, os.strerror(code))


def _unescape_mount_field(field: str) -> str:
    """Undo the octal escapes (``\\040`` for a space) that /proc/self/mounts uses in paths."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 3 < len(field) and all(c in "01234567" for c in field[i + 1:i + 4]):
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def fuse_mounts() -> list[str]:
    """Mountpoints of every file system of type :data:`FUSE_FSTYPE` in this mount namespace."""
    found = []
    try:
        with open("/proc/self/mounts") as handle:
            for line in handle:
                fields = line.split()
                if len(fields) >= 3 and fields[2] == FUSE_FSTYPE:
                    found.append(_unescape_mount_field(fields[1]))
    except OSError as exc:
        logger.debug("cannot read /proc/self/mounts: %s", exc)
    return found


def _is_own_thread(tid: int) -> bool:
    # /proc/self/task lists only this thread group: another process's tid is not found there.
    return tid > 0 and os.path.exists(f"/proc/self/task/{tid}")


def fuse_available() -> str | None:
    """None if a :class:`FuseStall` can be made here, else the reason it cannot.

    Cheap: checks ``/dev/fuse`` and the kernel's file system list, then mounts and unmounts a trial
    file system (never left behind; no process is started).
    """
    if not sys.platform.startswith("linux"):
        return "FUSE stalls need Linux"
    if not sys.executable:
        return "sys.executable is unknown (needed to start the priming child)"
    if not os.path.exists(DEV_FUSE):
        return f"{DEV_FUSE} does not exist (no fuse module, or not exposed to this container)"
    try:
        with open("/proc/filesystems") as handle:
            if "fuse" not in handle.read().split():
                return "the kernel has no fuse file system (/proc/filesystems)"
    except OSError as exc:
        return f"cannot read /proc/filesystems: {exc.strerror}"
    try:
        fd = os.open(DEV_FUSE, os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        return f"cannot open {DEV_FUSE}: {exc.strerror} (needs root)"
    mountpoint = ""
    code = -1
    try:
        mountpoint = tempfile.mkdtemp(prefix=f"{MOUNT_PREFIX}-{os.getpid()}-")
        code = _mount(fd, mountpoint)
    except OSError as exc:
        return f"cannot make a mountpoint: {exc.strerror}"
    finally:
        os.close(fd)  # nobody answers INIT: closing aborts the connection
        if code == 0:
            _umount(mountpoint)
        if mountpoint:
            with contextlib.suppress(OSError):
                os.rmdir(mountpoint)
    if code == errno.EPERM:
        return "mount(2) of a fuse file system failed: EPERM (needs root / CAP_SYS_ADMIN)"
    if code:
        return f"mount(2) of a fuse file system failed: {errno.errorcode.get(code, code)} ({os.strerror(code)})"
    return None


def _owner_alive(name: str) -> bool:
    owner = name[len(MOUNT_PREFIX) + 1:].split("-", 1)[0]
    if not owner.isdigit():
        return True  # not one of ours: leave it
    return os.path.exists(f"/proc/{owner}")


def remove_leftover_mounts() -> list[str]:
    """Unmount and remove the mountpoints that dead owners left behind; returns their paths.

    An owner that died (even by SIGKILL) closed its ``/dev/fuse`` descriptor, which released its
    stuck callers; its mount stays, answering ``ENOTCONN``. Only mounts and empty directories named
    after a pid that no longer runs are touched, so a live owner's stall is safe. A reused pid
    merely leaves a leftover in place. Never raises.
    """
    removed = []
    tmp = tempfile.gettempdir()
    for mountpoint in fuse_mounts():
        name = os.path.basename(mountpoint)
        if name.startswith(MOUNT_PREFIX + "-") and not _owner_alive(name):
            _umount(mountpoint)
            removed.append(mountpoint)
    try:
        names = os.listdir(tmp)
    except OSError:
        names = []
    mounted = set(fuse_mounts())
    for name in names:
        path = os.path.join(tmp, name)
        # rmdir only: never stat a path that may be a live mount (that could hang the caller).
        if name.startswith(MOUNT_PREFIX + "-") and path not in mounted and not _owner_alive(name):
            try:
                os.rmdir(path)
            except OSError:
                continue
            if path not in removed:
                removed.append(path)
    return removed


class FuseStall:
    """A FUSE mount where ``stat()`` of any name blocks in ``D`` until :meth:`release`.

    Use it as a context manager. :meth:`__enter__` raises ``OSError`` when it cannot be made (see
    :func:`fuse_available`). A caller that stats :attr:`path` or a :meth:`new_path` shows ``D`` at
    once (wchan ``request_wait_answer``); once :meth:`wait_held` is true for it, SIGKILL stays
    pending and it stays in ``D`` until :meth:`release`, which ends every wait.

    :attr:`read_path` is a regular read-only file of :data:`HELD_READ_SIZE` bytes that opens and
    maps normally; reading it (``read(2)`` or a page fault on a mapping) blocks the same way, in
    the READ request (:meth:`wait_read_held`).
    """

    def __init__(self, timeout: float = _DEFAULT_TIMEOUT_S) -> None:
        self.timeout = timeout
        self.mountpoint = ""
        self.path = ""  # <mountpoint>/stall, for one caller
        self.read_path = ""  # <mountpoint>/held-read: opens and maps; its READ is never answered
        self._fd = -1
        self._wake_r = self._wake_w = -1
        self._mounted = False
        self._released = False
        self._thread: threading.Thread | None = None
        self._cond = threading.Condition()
        self._initialized = False
        self._primed = False
        self._prime_pid = 0
        self._held: dict[int, int] = {}  # unique id of each unanswered request -> caller tid
        self._held_reads: set[int] = set()  # unique ids in _held that are READs of read_path
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
        self.path = os.path.join(self.mountpoint, "stall")
        self.read_path = os.path.join(self.mountpoint, HELD_READ_NAME)
        # Non-blocking, so that the server thread can poll it together with a wake-up pipe: a
        # thread blocked in read(2) keeps the file alive, and close() alone would not end it.
        self._fd = os.open(DEV_FUSE, os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK)
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        code = _mount(self._fd, self.mountpoint)
        if code:
            raise OSError(code, f"mount(2) of a fuse file system failed: {os.strerror(code)}", self.mountpoint)
        self._mounted = True
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
        self._prime_pid = child.pid
        try:
            if not self.wait_held(child.pid, self.timeout):
                raise OSError(errno.ETIMEDOUT, "the priming child's request never reached the FUSE server")
            child.kill()
            with self._cond:
                if not self._cond.wait_for(lambda: self._primed, self.timeout):
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
        if self._wake_w >= 0:
            with contextlib.suppress(OSError):
                os.write(self._wake_w, b"x")
        if self._thread is not None:
            self._thread.join(self.timeout)
            if self._thread.is_alive():
                logger.debug("FUSE stall server thread did not stop within %.1f s", self.timeout)
        if self._mounted:
            _umount(self.mountpoint)  # aborts the connection: releases the callers
            self._mounted = False
        for name in ("_fd", "_wake_r", "_wake_w"):
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
            self._held_reads.clear()
            self._cond.notify_all()

    @property
    def released(self) -> bool:
        """Whether :meth:`release` ran (the mount is gone or was never made)."""
        return self._released

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

    def held_tids(self) -> set[int]:
        """Thread ids whose request the server has read and holds unanswered."""
        with self._cond:
            return set(self._held.values())

    def wait_held(self, tid: int, timeout: float) -> bool:
        """Wait until the server holds a request from thread ``tid`` (a pid for a one-thread process).

        From then on SIGKILL cannot end that thread before :meth:`release`. False on timeout.
        """
        with self._cond:
            return self._cond.wait_for(lambda: tid in self._held.values() or self._released, timeout) and (
                tid in self._held.values()
            )

    def wait_read_held(self, tid: int, timeout: float) -> bool:
        """Wait until the server holds a READ of :attr:`read_path` from thread ``tid``.

        The kernel sends the READ from the thread that reads or faults (readahead here is
        synchronous: INIT does not offer ``FUSE_ASYNC_READ``). False on timeout.
        """
        def held() -> bool:
            return any(self._held.get(unique) == tid for unique in self._held_reads)

        with self._cond:
            return self._cond.wait_for(lambda: held() or self._released, timeout) and held()

    # ------------------------------------------------------------------ server thread

    def _serve(self) -> None:
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        try:
            while True:
                ready = poller.poll()
                if any(fd == self._wake_r for fd, _ in ready):
                    return
                try:
                    data = os.read(self._fd, _READ_SIZE)
                except BlockingIOError:
                    continue
                except OSError as exc:  # ENODEV: the connection was aborted
                    logger.debug("FUSE stall server stops: %s", exc)
                    return
                self._handle(data)
        except Exception:  # never let the thread die with a traceback on stderr
            logger.debug("FUSE stall server failed", exc_info=True)

    def _reply(self, unique: int, error: int, payload: bytes = b"") -> bool:
        try:
            os.write(self._fd, _OUT_HEADER.pack(_OUT_HEADER.size + len(payload), error, unique) + payload)
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
            if self._reply(unique, 0, out if minor >= 23 else out[:_INIT_OUT_COMPAT_SIZE]):
                with self._cond:
                    self._initialized = True
                    self._cond.notify_all()
        elif opcode == _FUSE_INTERRUPT:
            (target,) = _INTERRUPT_IN.unpack_from(data, _IN_HEADER.size)
            # ENOSYS must come while the interrupted request is still unanswered (the kernel looks
            # it up); it sets no_interrupt for the connection.
            primed = self._reply(unique, -errno.ENOSYS)
            with self._cond:
                self._primed = self._primed or primed
                release = self._held.get(target) == self._prime_pid
                if release:
                    del self._held[target]
                self._cond.notify_all()
            if release:
                self._reply(target, -errno.ENOENT)
        elif opcode in _NO_REPLY_OPCODES:
            pass
        elif _is_own_thread(tid):
            self._reply(unique, -errno.EIO)
        elif not self._answer_read_file(opcode, unique, nodeid, data):
            with self._cond:
                self._held[unique] = tid
                if opcode == _FUSE_READ and nodeid == _HELD_READ_NODEID:
                    self._held_reads.add(unique)
                self._cond.notify_all()

    def _answer_read_file(self, opcode: int, unique: int, nodeid: int, data: bytes) -> bool:
        """Answer what :attr:`read_path` needs to be opened and mapped; False leaves it held.

        Everything but its READ is answered: the lookup of its name, its attributes, open, flush
        (sent by every close) and release; an opcode this server does not implement gets ENOSYS.
        """
        if opcode == _FUSE_LOOKUP:
            name = data[_IN_HEADER.size:].split(b"\0", 1)[0]
            if nodeid != _ROOT_NODEID or name != HELD_READ_NAME.encode():
                return False
            entry = _ENTRY_OUT_HEAD.pack(_HELD_READ_NODEID, 0, _VALID_S, _VALID_S, 0, 0)
            self._reply(unique, 0, entry + self._read_file_attr())
            return True
        if nodeid != _HELD_READ_NODEID or opcode == _FUSE_READ:
            return False
        if opcode == _FUSE_GETATTR:
            self._reply(unique, 0, _ATTR_OUT_HEAD.pack(_VALID_S, 0, 0) + self._read_file_attr())
        elif opcode == _FUSE_OPEN:
            self._reply(unique, 0, _OPEN_OUT.pack(0, 0, 0))
        elif opcode in (_FUSE_FLUSH, _FUSE_RELEASE):
            self._reply(unique, 0)
        else:
            self._reply(unique, -errno.ENOSYS)
        return True

    @staticmethod
    def _read_file_attr() -> bytes:
        mode = 0o100444  # S_IFREG | r--r--r--
        return _ATTR.pack(_HELD_READ_NODEID, HELD_READ_SIZE, HELD_READ_SIZE // 512, 0, 0, 0, 0, 0, 0, mode, 1,
                          os.geteuid(), os.getegid(), 0, 4096, 0)
