"""Python stacks of a rank without ptrace: the rank's own ``faulthandler`` dumps them on a signal.

``py-spy`` needs ptrace rights over a rank, which most containers and MPI-spawned ranks do not
give (docs/diagnosis.md, "Where each stack source works"). Here the rank dumps its own stacks
instead::

    rank start: register_stack_dump()                     snapshot: take_faulthandler_stacks()
      <dir>/<pidns>-<pid>-<start>.stacks  (0600, O_APPEND)    check state: stopped / main in D -> skip
      header line: pid, start, signal, main thread id         open the file, check header + SigCgt
      faulthandler.register(SIG, fd, all_threads=True)        pidfd (verified) -> SIG, every rank first
                                                              wait: file grew, SIG neither pending nor
      handler (C, no GIL needed) appends every thread's       blocked in a thread that had it free
      stack to the file                                       read from the old end, parse -> RankStacks

**Where the file lives.** ``<dir>`` is ``trtllm-liveness-stacks-<euid>`` (mode 0700, checked to be
the user's own and private) under ``/dev/shm`` where that is a writable directory, else the temp
directory. ``/dev/shm`` is memory (tmpfs) in every container: the handler's writes, made inside a
signal handler, never wait on a disk or a stalled network mount, and the file is shared by every
process of the container, whatever their ``TMPDIR``. It is read by path with plain file
permissions (the rank's user, or root), so a reader needs no ptrace right at all: a memfd read
through ``/proc/<pid>/fd/N`` would need the same ptrace check as ``py-spy`` for a non-dumpable
rank. A reader in another mount namespace (a sidecar sharing the PID namespace) finds it through
``/proc/<pid>/root``, which does need ptrace-read access. The name carries the PID namespace, pid
and start time, so a reader finds it from a rank's identity and it is never confused with a later
process; the rank removes it at its interpreter's exit, and each registration removes the files
of processes of its PID namespace that are gone (a rank ended by SIGKILL or ``os._exit``).

**The signal.** A real-time signal near the top of the range (:data:`DUMP_SIGNALS`, the first one
with no handler in the rank): the bottom ones are the most taken by libraries. docs/upstream-contract.md
("Ranks' stack-dump signal") says why not SIGUSR1/SIGUSR2 and why a rank is signalled only when
its file and its ``SigCgt`` show that signal registered.

**When the dump is complete.** ``faulthandler`` writes no end marker. Its handler runs with the
signal blocked in the thread that runs it (no ``SA_NODEFER``), so the dump is complete once the
file has grown and the signal is neither pending nor blocked in any thread that had it unblocked
before the signal was sent.

**Concurrent snapshots of one rank** (the engine's and a CLI scan, two threads) take the dump
file's exclusive ``flock`` around truncate, signal, wait and read: one dump is never truncated or
read from its middle by another; the second waits for the first, within its own deadline.

**Who cannot dump.** A stopped rank (``T``) runs no handler until it is continued; a rank whose
main thread is in ``D`` holds a signal sent to the process until it leaves ``D`` (the kernel
delivers it to the main thread first). Neither is signalled: the result says so at once.

Standard library only; signals only the verified ranks (through pidfds), with their own signal.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import faulthandler
import fcntl
import logging
import os
import re
import signal
import stat
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from .._errors import LivenessError
from ..process import _pidfd, _procfs
from ._stack_records import RankStacks, StackFrame, StackSource, StackStatus, ThreadStack, parse_stack_text

__all__ = ["DUMP_SIGNALS", "DumpRequests", "StackDumpFile", "dump_directory", "parse_faulthandler_dump",
           "register_stack_dump", "register_stack_dump_or_warn", "signal_name", "take_faulthandler_stacks"]

logger = logging.getLogger(__name__)

DUMP_SIGNALS: tuple[int, ...] = tuple(int(signal.SIGRTMAX) - offset for offset in (3, 4, 5))
"""Signals a rank may take for its dumps, in order of preference (SIGRTMAX-3..5: 61, 60, 59 with glibc)."""
SHM_DIR = "/dev/shm"
DEFAULT_TIMEOUT_S = 1.0
MAX_DUMP_BYTES = 1 << 20
"""The most read of one dump (faulthandler writes at most 100 threads of 100 frames)."""
TRUNCATE_AT = 1 << 20
"""A dump file past this size is cut back to its header before the next dump (when writable)."""
_POLL_S = 0.001
_HEADER_MAX = 256
_HEADER = re.compile(rb"^trtllm-liveness stack dump v1 pid=(\d+) start=(\d+) signal=(\d+) main=0x([0-9a-f]+)\n")
_NAME = re.compile(r"^(\d+)-(\d+)-(\d+)\.stacks$")


@dataclass(frozen=True)
class StackDumpFile:
    """A rank's registered dump: the file it writes, the signal that makes it write, and the
    process that registered it (a forked child inherits the hook, not the file)."""

    path: str
    signum: int
    pid: int


# ----------------------------------------------------------------------------- where


def signal_name(signum: int) -> str:
    """``SIGRTMAX-3`` for a real-time signal (the enum names none of them), else the usual name."""
    if signal.SIGRTMIN <= signum <= signal.SIGRTMAX:
        return f"SIGRTMAX-{int(signal.SIGRTMAX) - signum}"
    return signal.Signals(signum).name


def _base_dir() -> str:
    if os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK | os.X_OK):
        return SHM_DIR
    return tempfile.gettempdir()


def dump_directory(uid: int | None = None, base: str | None = None) -> str:
    """The directory of ``uid``'s dump files (default: this process's effective uid) under
    ``base`` (default: ``/dev/shm`` where writable, else the temp directory)."""
    return os.path.join(base if base is not None else _base_dir(),
                        f"trtllm-liveness-stacks-{os.geteuid() if uid is None else uid}")


def _file_name(pid_namespace: int, pid: int, start_time: int) -> str:
    return f"{pid_namespace}-{pid}-{start_time}.stacks"


def _open_private_dir(path: str, uid: int) -> int:
    """An fd of the directory ``path`` (not a symlink); ``PermissionError`` unless private to ``uid``."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    st = os.fstat(fd)
    if st.st_uid != uid or st.st_mode & 0o077:
        os.close(fd)
        raise PermissionError(errno.EPERM, f"{path} is not private to uid {uid} (owner {st.st_uid}, "
                                           f"mode {stat.S_IMODE(st.st_mode):o})")
    return fd


# ----------------------------------------------------------------------------- the rank's side

_registered: StackDumpFile | None = None
_register_lock = threading.Lock()


def _free_signal() -> int | None:
    status = _procfs.read_status("self")
    for signum in DUMP_SIGNALS:
        bit = _procfs.signal_bit(signum)
        taken = (status.caught | status.ignored | status.blocked) & bit
        # getsignal() is None for a handler installed outside Python (C code, faulthandler).
        if not taken and signal.getsignal(signum) is signal.SIG_DFL:
            return signum
    return None


def _sweep(dir_fd: int, pid_namespace: int) -> None:
    """Remove the files of processes of this PID namespace that are gone (SIGKILL, ``os._exit``)."""
    for name in os.listdir(dir_fd):
        match = _NAME.match(name)
        if match is None or int(match.group(1)) != pid_namespace:
            continue
        pid, start = int(match.group(2)), int(match.group(3))
        if _procfs.start_time_or_none(pid) != start:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=dir_fd)


def register_stack_dump(*, base: str | None = None) -> StackDumpFile | None:
    """Make this process dump every thread's Python stack into its own file on a signal.

    Called once at a rank's start (by the worker entry); later calls in the same process return
    the same registration. Creates the private directory (:func:`dump_directory`) if needed,
    removes gone processes' files, creates this process's file (0600, append-only writes) with
    its header and registers ``faulthandler`` on the first free signal of :data:`DUMP_SIGNALS`.
    Returns None (one WARNING) when no signal is free, or the directory is not this user's own
    and private. Raises ``OSError`` when the file cannot be made. Never blocks beyond a few
    local file operations; thread-safe.
    """
    global _registered
    with _register_lock:
        pid = os.getpid()
        if _registered is not None and _registered.pid == pid:
            return _registered
        signum = _free_signal()
        if signum is None:
            logger.warning("liveness: no stack-dump signal is free in this process (%s all have handlers); "
                           "its stacks can be taken by py-spy only", ", ".join(map(signal_name, DUMP_SIGNALS)))
            return None
        uid = os.geteuid()
        directory = dump_directory(uid, base)
        with contextlib.suppress(FileExistsError):
            os.mkdir(directory, 0o700)
        try:
            dir_fd = _open_private_dir(directory, uid)
        except PermissionError as exc:
            logger.warning("liveness: no stack dumps for this process: %s", exc.strerror)
            return None
        try:
            start = _procfs.read_start_time(pid)
            pid_namespace = _procfs.pid_namespace_inode()
            _sweep(dir_fd, pid_namespace)
            name = _file_name(pid_namespace, pid, start)
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o600, dir_fd=dir_fd)
        finally:
            os.close(dir_fd)
        try:
            os.fchmod(fd, 0o600)
            main_ident = threading.main_thread().ident or 0
            os.write(fd, b"trtllm-liveness stack dump v1 pid=%d start=%d signal=%d main=0x%016x\n"
                     % (pid, start, signum, main_ident))
            faulthandler.register(signum, file=fd, all_threads=True, chain=False)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(directory, name))
            raise
        _registered = StackDumpFile(os.path.join(directory, name), signum, pid)
        atexit.register(_remove_file, _registered)  # the fd stays open: the handler writes to it
        logger.debug("liveness: stack dumps of pid %d on %s into %s", pid, signal_name(signum),
                     _registered.path)
        return _registered


def register_stack_dump_or_warn() -> StackDumpFile | None:
    """:func:`register_stack_dump` for a rank's start: any failure is one WARNING and None (the
    rank's stacks can then be taken by ``py-spy`` only); never raises."""
    try:
        return register_stack_dump()
    except Exception:
        logger.warning("liveness: could not register this rank's stack dump; only py-spy can take its stacks",
                       exc_info=True)
        return None


def _remove_file(dump: StackDumpFile) -> None:
    if os.getpid() != dump.pid:
        return  # a forked child inherited the hook: the file is its parent's
    with contextlib.suppress(OSError):
        faulthandler.unregister(dump.signum)
        os.unlink(dump.path)


# ----------------------------------------------------------------------------- parsing

_THREAD_HEAD = re.compile(r"^(Current thread|Thread) 0x([0-9a-fA-F]+) \(most recent call first\):\s*$")
_FRAME = re.compile(r'^  File (?:"(.*)"|\?\?\?), line (\d+|\?\?\?) in (.*)$')


def parse_faulthandler_dump(text: str, *, main_ident: int | None = None, pid: int | None = None
                            ) -> tuple[ThreadStack, ...]:
    """The threads of the first ``faulthandler`` dump in ``text``, innermost frame first.

    A dump is ``Thread 0x<id> (most recent call first):`` (``Current thread`` for the one that ran
    the handler) followed by ``  File "<file>", line <n> in <function>`` lines, threads separated
    by a blank line; a header right after a frame line starts the next dump, which is not read.
    The thread whose id is ``main_ident`` gets ``tid=pid`` and the name ``MainThread``; the others
    have no OS thread id. Lines it does not know (``<no Python frame>``, ``...``) are skipped.
    """
    def thread(head: re.Match[str], frames: tuple[StackFrame, ...]) -> ThreadStack:
        is_main = main_ident is not None and int(head.group(2), 16) == main_ident
        return ThreadStack(pid if is_main else None, "MainThread" if is_main else "", False, False, frames)

    def frame(found: re.Match[str]) -> StackFrame:
        number = found.group(2)
        return StackFrame(found.group(3), found.group(1) or "???", int(number) if number.isdigit() else 0)

    return parse_stack_text(text, _THREAD_HEAD, _FRAME, thread, frame, one_dump=True)


# ----------------------------------------------------------------------------- the snapshot's side


class _Unavailable(Exception):
    """No dump can be had from this rank; ``status`` and the message say why."""

    def __init__(self, status: StackStatus, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


def _open_dump_file(pid: int, start_time: int) -> tuple[int, re.Match[bytes], int]:
    """``(fd, its header, signal)`` of ``pid``'s dump file, checked. Raises :class:`_Unavailable`."""
    try:
        status = _procfs.read_status(pid)
        pid_namespace = _procfs.pid_namespace_inode()
    except (OSError, ValueError) as exc:
        raise _Unavailable(StackStatus.SKIPPED_NOT_RUNNING, f"cannot read its /proc entry: {exc}") from None
    uid = status.uids[1] if len(status.uids) > 1 else os.geteuid()
    path = os.path.join(dump_directory(uid), _file_name(pid_namespace, pid, start_time))
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        # Another mount namespace (a sidecar sharing the PID namespace): its /dev/shm is not ours.
        try:
            fd = os.open(f"{_procfs.PROCFS_PATH}/{pid}/root{path}", flags)
        except OSError as exc:
            raise _Unavailable(StackStatus.NOT_REGISTERED,
                               f"no stack dump registered: {path} does not exist ({exc.strerror} through "
                               f"/proc/{pid}/root)") from None
    except OSError as exc:
        raise _Unavailable(StackStatus.FAILED, f"cannot open {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != uid or st.st_mode & 0o077:
            raise _Unavailable(StackStatus.FAILED, f"{path} is not the rank's private file")
        header = os.pread(fd, _HEADER_MAX, 0)
        match = _HEADER.match(header)
        if match is None or (int(match.group(1)), int(match.group(2))) != (pid, start_time):
            raise _Unavailable(StackStatus.FAILED, f"{path} has no header of pid {pid}")
        signum = int(match.group(3))
        if not status.caught & _procfs.signal_bit(signum):
            raise _Unavailable(StackStatus.NOT_REGISTERED, f"no handler for signal {signum} any more "
                                                           "(the process replaced its image or unregistered it)")
        return fd, match, signum
    except BaseException:
        os.close(fd)
        raise


def _signal_state(pid: int, signum: int) -> tuple[bool, set[int]]:
    """``(pending anywhere, threads that block it)``; threads that vanish are skipped."""
    bit = _procfs.signal_bit(signum)
    pending = False
    blocked: set[int] = set()
    for tid in _procfs.list_tids(pid):
        try:
            status = _procfs.read_status(pid, tid)
        except (FileNotFoundError, ProcessLookupError):
            continue
        pending = pending or bool((status.pending | status.shared_pending) & bit)
        if status.blocked & bit:
            blocked.add(tid)
    return pending, blocked


class _DumpRequest:
    """One rank's dump: check, signal, wait until complete, read, parse. Runs in its own thread."""

    def __init__(self, pid: int, start_time: int | None, deadline: float) -> None:
        self.pid = pid
        self.start_time = start_time
        self.deadline = deadline
        self.result: RankStacks | None = None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"trtllm-liveness-stacks-{pid}", daemon=True)

    def _run(self) -> None:
        started = time.monotonic()
        try:
            self.result = self._take(started)
        except Exception as exc:  # the snapshot must come back whatever happened here
            status, detail = ((exc.status, exc.detail) if isinstance(exc, _Unavailable) else
                              (StackStatus.FAILED, f"stack dump failed: {exc!r}"[:300]))
            self.result = RankStacks(status, detail, (time.monotonic() - started) * 1000, StackSource.FAULTHANDLER)
        finally:
            self.done.set()

    def _take(self, started: float) -> RankStacks:
        pid, start_time = self.pid, self.start_time
        if start_time is None:
            raise _Unavailable(StackStatus.SKIPPED_NOT_RUNNING, "no start time known: a dump signal goes only to a "
                                                                "verified process")
        try:
            states = _procfs.read_thread_states(pid)
        except OSError:
            states = {}
        main = states.get(pid, "")
        if not main or main in _procfs.EXITED_STATES:
            raise _Unavailable(StackStatus.SKIPPED_NOT_RUNNING, "stacks skipped: gone or exited")
        if main in _procfs.STOPPED_STATES:
            raise _Unavailable(StackStatus.SKIPPED_STOPPED, "stopped (T): its dump handler cannot run until it is "
                                                            "continued; not signalled")
        if main in _procfs.UNINTERRUPTIBLE_STATES:
            d_tids = _procfs.uninterruptible_tids(states)
            raise _Unavailable(StackStatus.SKIPPED_TASK_IN_D,
                               f"stacks skipped: task in D (main thread, {len(d_tids)} of {len(states)} threads): "
                               "a dump signal would wait for it to leave D; not signalled")
        fd, header, signum = _open_dump_file(pid, start_time)
        try:
            self._lock(fd, signum)
            return self._signal_and_read(fd, header, signum, start_time, started)
        finally:
            os.close(fd)  # releases the lock too

    def _lock(self, fd: int, signum: int) -> None:
        """Take the dump file's exclusive ``flock`` before anything is truncated, signalled or read:
        another snapshot of the same rank (another thread, another process: a CLI scan beside the
        engine's) would otherwise truncate this one's dump while it is read, or read from the middle
        of it. Waits for the other snapshot until this one's deadline; released by the ``close``."""
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                pass
            if time.monotonic() >= self.deadline:
                raise _Unavailable(StackStatus.TIMED_OUT, "another snapshot of this rank held its dump file until the "
                                                          f"deadline ({signal_name(signum)} not sent)")
            time.sleep(_POLL_S)

    def _signal_and_read(self, fd: int, header: re.Match[bytes], signum: int, start_time: int,
                         started: float) -> RankStacks:
        pid = self.pid
        pending, blocked_before = _signal_state(pid, signum)
        size = os.fstat(fd).st_size
        if size > TRUNCATE_AT and not pending and not blocked_before:
            with contextlib.suppress(OSError):  # no write access (another user's rank read by root is fine)
                os.truncate(f"/proc/self/fd/{fd}", header.end())  # the file opened read-only, by its path
                size = header.end()
        baseline = size
        if not pending:  # one already pending (an earlier snapshot's) makes the same dump
            try:
                pidfd = _pidfd.open_verified_pidfd(pid, start_time)
            except (LivenessError, OSError) as exc:
                raise _Unavailable(StackStatus.SKIPPED_NOT_RUNNING, f"not signalled: {exc}") from None
            try:
                if not _pidfd.send_signal(pidfd, signum):
                    raise _Unavailable(StackStatus.SKIPPED_NOT_RUNNING, "exited before the signal")
            finally:
                os.close(pidfd)
        while True:
            if os.fstat(fd).st_size > baseline:
                try:
                    pending, blocked = _signal_state(pid, signum)
                except OSError:
                    raise _Unavailable(StackStatus.SKIPPED_NOT_RUNNING, "exited during its dump") from None
                if not pending and not (blocked - blocked_before):
                    break
            if time.monotonic() >= self.deadline:
                grew = os.fstat(fd).st_size > baseline
                raise _Unavailable(StackStatus.TIMED_OUT,
                                   f"its dump handler {'did not finish' if grew else 'did not run'} within the "
                                   f"deadline ({signal_name(signum)} sent)")
            time.sleep(_POLL_S)
        data = os.pread(fd, MAX_DUMP_BYTES, baseline)
        threads = parse_faulthandler_dump(data.decode("ascii", "replace"), main_ident=int(header.group(4), 16), pid=pid)
        if not threads:
            raise _Unavailable(StackStatus.FAILED, f"its dump had no thread ({len(data)} bytes)")
        return RankStacks(StackStatus.TAKEN, "", (time.monotonic() - started) * 1000, StackSource.FAULTHANDLER,
                          threads=threads)


class DumpRequests:
    """Dumps under way, one per rank, started together and collected under one deadline (a rank
    whose start time is unknown, None, is not signalled: its result says so)."""

    def __init__(self, targets: Sequence[tuple[int, int | None]], deadline: float) -> None:
        self.deadline = deadline
        self._requests = [_DumpRequest(pid, start_time, deadline) for pid, start_time in targets]
        for request in self._requests:
            request.thread.start()

    def collect(self) -> dict[int, RankStacks]:
        """Each rank's result; blocks until all are done or the deadline (plus 20 ms) passes."""
        late = RankStacks(StackStatus.TIMED_OUT, "reading its dump did not finish by the deadline",
                          source=StackSource.FAULTHANDLER)
        results: dict[int, RankStacks] = {}
        for request in self._requests:
            request.done.wait(max(0.0, self.deadline - time.monotonic()) + _POLL_S * 20)
            results[request.pid] = request.result or late
        return results


def take_faulthandler_stacks(targets: Sequence[tuple[int, int]], *, timeout_s: float = DEFAULT_TIMEOUT_S
                             ) -> dict[int, RankStacks]:
    """Python stacks of ``targets`` (``(pid, start_time)``) by their registered dump handlers.

    Each rank is checked (not stopped, main thread not in ``D``, a dump registered with a handler
    installed), signalled through a pidfd verified against ``start_time``, and its dump read
    once complete (see the module docstring); all ranks at once, each in a daemon thread, under
    one deadline. Blocks at most ``timeout_s`` (a thread stuck on a file is left behind and its
    rank reported ``timed-out``). Never raises for a rank: that is its :class:`RankStacks`, whose
    ``source`` is ``faulthandler``. Thread-safe.
    """
    return DumpRequests(targets, time.monotonic() + timeout_s).collect()
