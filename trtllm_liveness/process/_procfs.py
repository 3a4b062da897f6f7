"""Parsing of Linux procfs files: process and thread state, start time, signals, namespaces.

Pure byte parsing lives here, isolated from syscalls and policy. The procfs root is read from the
module attribute ``PROCFS_PATH`` on every call so that tests can point it at a fake tree.

Every reader raises ``FileNotFoundError``/``ProcessLookupError`` when the process is gone; callers
turn those into this package's errors (:class:`~trtllm_liveness._errors.ProcessGone`) where they need to.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping, Sequence
from typing import NamedTuple

PROCFS_PATH = "/proc"

# Fields after the closing parenthesis of comm, counted from 0: state is 0, starttime (field 22
# of proc(5)) is 19.
_STATE_INDEX = 0
_PPID_INDEX = 1
_PGRP_INDEX = 2
_SESSION_INDEX = 3
_FLAGS_INDEX = 6  # field 9, the kernel's PF_* flags
NUM_THREADS_INDEX = 17  # field 20
_UTIME_INDEX = 11
_STIME_INDEX = 12
STARTTIME_INDEX = 19
_EXIT_CODE_INDEX = 49  # field 52, the waitpid(2)-style status; shown for zombies since Linux 3.5

PF_EXITING = 0x4
"""``include/linux/sched.h``: set when a task begins to exit."""

# The one-letter task states of proc(5), classified here for every caller.
# States in which a task is in uninterruptible sleep. 'D' is TASK_UNINTERRUPTIBLE; kernels
# report a frozen or killable-but-uninterruptible task as 'D' too.
UNINTERRUPTIBLE_STATES = frozenset("D")
EXITED_STATES = frozenset("ZX")
"""Zombie (``Z``) and dead (``X``): the task ran its exit; only its reaping is left."""
STOPPED_STATES = frozenset("Tt")
"""Stopped by a signal (``T``) or by a tracer (``t``)."""


def uninterruptible_tids(states: Mapping[int, str]) -> tuple[int, ...]:
    """The thread ids of ``states`` (thread id to one-letter state) asleep in ``D``, ascending."""
    return tuple(sorted(tid for tid, state in states.items() if state in UNINTERRUPTIBLE_STATES))


class StatInfo(NamedTuple):
    """The fields of ``/proc/<pid>/stat`` this package uses."""

    pid: int
    comm: str
    state: str
    ppid: int
    pgrp: int
    session: int
    start_time: int
    exit_code: int | None = None
    cpu_ticks: int = 0  # utime + stime, in clock ticks (SC_CLK_TCK)
    flags: int = 0  # the task's PF_* flags (field 9)

    @property
    def exiting(self) -> bool:
        """``PF_EXITING``: the task is in its exit path (it took its fatal signal, or called exit)."""
        return bool(self.flags & PF_EXITING)

    @property
    def exited(self) -> bool:
        """Whether the task is a zombie or dead (:data:`EXITED_STATES`): its exit ran."""
        return self.state in EXITED_STATES


def parse_stat(data: bytes) -> StatInfo:
    """Parse the content of a ``stat`` file.

    ``comm`` may contain spaces and parentheses (``a) b (c) d``), so it is everything between
    the first ``(`` and the *last* ``)``. Raises ``ValueError`` on malformed content.
    """
    open_paren = data.find(b"(")
    close_paren = data.rfind(b")")
    if open_paren < 0 or close_paren < open_paren:
        raise ValueError(f"malformed stat content: {data[:80]!r}")
    fields = data[close_paren + 2 :].split()
    if len(fields) <= STARTTIME_INDEX:
        raise ValueError(f"stat content has {len(fields)} fields after comm, expected more")
    return StatInfo(
        pid=int(data[:open_paren]),
        comm=data[open_paren + 1 : close_paren].decode("utf-8", "replace"),
        state=fields[_STATE_INDEX].decode("ascii", "replace"),
        ppid=int(fields[_PPID_INDEX]),
        pgrp=int(fields[_PGRP_INDEX]),
        session=int(fields[_SESSION_INDEX]),
        start_time=int(fields[STARTTIME_INDEX]),
        exit_code=int(fields[_EXIT_CODE_INDEX]) if len(fields) > _EXIT_CODE_INDEX else None,
        cpu_ticks=int(fields[_UTIME_INDEX]) + int(fields[_STIME_INDEX]),
        flags=int(fields[_FLAGS_INDEX]),
    )


def parse_state_and(data: bytes, index: int) -> tuple[str, int]:
    """``(state, field)`` from a ``stat`` file's content without a full parse: the state and the
    numeric field ``index`` after comm (:data:`NUM_THREADS_INDEX`; :data:`STARTTIME_INDEX`, what
    verifying a process's identity needs). Raises ``ValueError`` on malformed content."""
    close_paren = data.rfind(b")")
    if close_paren < 0:
        raise ValueError(f"malformed stat content: {data[:80]!r}")
    fields = data[close_paren + 2 :].split(None, index + 1)
    if len(fields) <= index:
        raise ValueError(f"stat content has {len(fields)} fields after comm, expected more")
    return fields[_STATE_INDEX].decode("ascii", "replace"), int(fields[index])


def thread_state_of(data: bytes) -> str:
    """The one-letter state from a ``stat`` file's content; ``""`` when malformed."""
    close_paren = data.rfind(b")")
    if close_paren < 0 or close_paren + 2 >= len(data):
        return ""
    return chr(data[close_paren + 2])


def _read(path: str) -> bytes:
    # One read is enough for every small procfs file used here; procfs builds them whole.
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, 65536)
    finally:
        os.close(fd)


def read_whole(path: str) -> bytes:
    """The whole content of ``path``, however long (``cmdline``, ``environ`` and ``cgroup.procs`` can
    exceed one read)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _path(pid: int | str, tid: int | None, name: str) -> str:
    """``/proc/<pid>/<name>``, or ``/proc/<pid>/task/<tid>/<name>`` for one thread."""
    return f"{PROCFS_PATH}/{pid}/{name}" if tid is None else f"{PROCFS_PATH}/{pid}/task/{tid}/{name}"


def open_stat(pid: int, tid: int | None = None) -> int:
    """Open ``/proc/<pid>/stat`` (or one thread's) for repeated :func:`pread_stat` calls; the caller
    owns the fd.

    The fd pins the process (or thread) it was opened for: once that one is reaped, reads fail with
    ``ProcessLookupError`` instead of showing a process that reused the PID.
    """
    return os.open(_path(pid, tid, "stat"), os.O_RDONLY | os.O_CLOEXEC)


def pread_stat(fd: int) -> bytes:
    """Re-read a ``stat`` file opened by :func:`open_stat` (procfs regenerates it at offset 0)."""
    data = os.pread(fd, 4096, 0)
    if not data:
        raise ProcessLookupError("stat file is empty: process gone")
    return data


def list_tids(pid: int) -> list[int]:
    """Thread ids of ``pid`` (``/proc/<pid>/task``)."""
    return [int(name) for name in os.listdir(f"{PROCFS_PATH}/{pid}/task") if name.isdigit()]


def read_stat_bytes(pid: int, tid: int | None = None) -> bytes:
    """Raw content of ``/proc/<pid>/stat``, or ``/proc/<pid>/task/<tid>/stat`` for one thread."""
    return _read(_path(pid, tid, "stat"))


def read_stat(pid: int, tid: int | None = None) -> StatInfo:
    """Read ``/proc/<pid>/stat``, or ``/proc/<pid>/task/<tid>/stat`` for one thread."""
    return parse_stat(_read(_path(pid, tid, "stat")))


def read_start_time(pid: int) -> int:
    """Start time of ``pid`` in clock ticks since boot (field 22 of ``stat``)."""
    return read_stat(pid).start_time


def stat_or_none(pid: int, tid: int | None = None) -> StatInfo | None:
    """:func:`read_stat`, or None where the process (thread) is gone or its ``stat`` unreadable."""
    try:
        return read_stat(pid, tid)
    except (OSError, ValueError):
        return None


def start_time_or_none(pid: int) -> int | None:
    """:func:`read_start_time`, or None where ``pid`` is gone or its ``stat`` unreadable."""
    info = stat_or_none(pid)
    return None if info is None else info.start_time


def read_thread_states(pid: int) -> dict[int, str]:
    """Map each thread id of ``pid`` to its one-letter state.

    Threads that exit while being listed are skipped. The main thread's state alone is not
    enough: a driver or NCCL thread may sit in ``D`` while the main thread sleeps in ``S``.
    """
    states: dict[int, str] = {}
    for tid in list_tids(pid):
        try:
            data = read_stat_bytes(pid, tid)
        except (FileNotFoundError, ProcessLookupError):
            continue
        state = thread_state_of(data)
        if state:
            states[tid] = state
    return states


class StatusInfo(NamedTuple):
    """The fields of ``/proc/<pid>/status`` (or a thread's) this package uses beyond the state.

    Signal masks and capability sets are bit masks (bit ``n - 1`` for signal ``n``, bit ``c`` for
    capability ``c``); ``uids``/``gids`` are (real, effective, saved, filesystem). Fields missing
    from the file (a fake tree, an old kernel) read as 0 / empty; ``context_switches`` as None.

    ``context_switches`` is ``voluntary_ctxt_switches + nonvoluntary_ctxt_switches`` (the kernel's
    ``nvcsw + nivcsw``, which its hung-task detector compares): unchanged between two reads of one
    thread means the thread never ran in between (a task that stayed asleep in ``D``).
    """

    uids: tuple[int, ...] = ()
    gids: tuple[int, ...] = ()
    pending: int = 0  # SigPnd: this thread's own queue
    shared_pending: int = 0  # ShdPnd: the process's queue
    blocked: int = 0  # SigBlk
    ignored: int = 0  # SigIgn
    caught: int = 0  # SigCgt: signals with a handler installed
    cap_permitted: int = 0
    cap_effective: int = 0
    context_switches: int | None = None

    @property
    def sigkill_pending(self) -> bool:
        """Whether SIGKILL is queued for this thread or its process, but not delivered."""
        return bool((self.pending | self.shared_pending) & signal_bit(signal.SIGKILL))


_STATUS_MASKS = {b"SigPnd": "pending", b"ShdPnd": "shared_pending", b"SigBlk": "blocked", b"SigIgn": "ignored",
                 b"SigCgt": "caught", b"CapPrm": "cap_permitted", b"CapEff": "cap_effective"}
_SWITCH_COUNTS = (b"voluntary_ctxt_switches", b"nonvoluntary_ctxt_switches")


def parse_status(data: bytes) -> StatusInfo:
    """Parse the content of a ``status`` file. Raises ``ValueError`` on a malformed known field."""
    fields: dict[str, object] = {}
    switches: int | None = None
    for line in data.splitlines():
        key, _, value = line.partition(b":")
        name = _STATUS_MASKS.get(key)
        if name is not None:
            fields[name] = int(value.split()[0], 16)
        elif key in (b"Uid", b"Gid"):
            fields["uids" if key == b"Uid" else "gids"] = tuple(int(part) for part in value.split())
        elif key in _SWITCH_COUNTS:
            switches = (switches or 0) + int(value)
    return StatusInfo(**fields, context_switches=switches)  # type: ignore[arg-type]


def read_status(pid: int | str, tid: int | None = None) -> StatusInfo:
    """Read ``/proc/<pid>/status`` (``pid`` may be ``"self"``), or one thread's."""
    return parse_status(_read(_path(pid, tid, "status")))


def signal_bit(signum: int) -> int:
    """The bit of signal ``signum`` in the masks of :class:`StatusInfo`."""
    return 1 << (signum - 1)


def sigkill_pending(pid: int, tid: int | None = None) -> bool:
    """Whether SIGKILL is queued for the process (shared) or for one thread, but not delivered.

    A task in uninterruptible sleep cannot act on SIGKILL; a pending SIGKILL on a ``D`` task is
    what makes it unkillable.
    """
    return read_status(pid, tid).sigkill_pending


def sigkill_stuck(pid: int, info: StatInfo, d_tids: Sequence[int] = ()) -> bool:
    """Whether SIGKILL is pending on a task that does not act on it: with a thread of ``d_tids``
    (asleep in ``D``) holding it, or with the process in any other state holding it while not in
    its exit path.

    ``info`` is the process's :class:`StatInfo` from the same sample. A task with ``PF_EXITING``
    keeps SIGKILL pending until it is reaped, also while it runs its exit (``exit_mmap``,
    ``exit_files``) in ``R`` still holding its devices: that is a normal exit, not an unkillable
    task. A zombie leader (its other threads may still run) is judged by its ``D`` threads only.
    """
    if d_tids and (sigkill_pending(pid) or sigkill_pending(pid, d_tids[0])):
        return True
    return not info.exited and not info.exiting and sigkill_pending(pid)


def read_wchan(pid: int, tid: int | None = None) -> str:
    """The kernel function the task is waiting in, or ``""`` when running or unknown."""
    try:
        text = _read(_path(pid, tid, "wchan")).decode("ascii", "replace").strip()
    except PermissionError:
        return ""
    return "" if text in ("0", "") else text


def parse_kernel_stack(data: bytes, limit: int = 32) -> tuple[str, ...]:
    """The function names of a ``stack`` file, innermost first (``[<0>] uvm_spin_loop+0x12/0x40
    [nvidia_uvm]`` gives ``uvm_spin_loop+0x12/0x40 [nvidia_uvm]``), at most ``limit``."""
    frames: list[str] = []
    for line in data.decode("ascii", "replace").splitlines():
        text = line.split("]", 1)[1].strip() if line.startswith("[") and "]" in line else line.strip()
        if text:
            frames.append(text)
        if len(frames) >= limit:
            break
    return tuple(frames)


def pid_namespace_inode(pid: int | str = "self") -> int:
    """Inode number of the PID namespace of ``pid`` (``/proc/<pid>/ns/pid``)."""
    return os.stat(f"{PROCFS_PATH}/{pid}/ns/pid").st_ino


def own_pid_namespace() -> int:
    """:func:`pid_namespace_inode` of this process, 0 where it cannot be read (no namespace's inode)."""
    try:
        return pid_namespace_inode()
    except OSError:
        return 0


INITIAL_PID_NAMESPACE_INODE = 0xEFFFFFFC
"""The inode of the kernel's initial (the host's) PID namespace: ``PROC_PID_INIT_INO``, fixed."""

INIT_PROGRAMS = frozenset({"init", "systemd", "tini", "tini-static", "dumb-init", "catatonit", "pause",
                           "s6-svscan", "runsvdir", "my_init", "docker-init"})
"""Names of programs that run as PID 1 to reap and forward signals: never a worker or a server."""


def pid1_role() -> str:
    """What PID 1 is, seen from this process: ``"host-init"`` in the initial PID namespace (the
    host's init), ``"container-init"`` when PID 1 of this (container's) namespace runs an init
    program of :data:`INIT_PROGRAMS` (tini, dumb-init, ...), else ``"server"``: the container's
    own entrypoint (in a Kubernetes container without an init, the inference server itself)."""
    try:
        if pid_namespace_inode() == INITIAL_PID_NAMESPACE_INODE:
            return "host-init"
        comm = _read(f"{PROCFS_PATH}/1/comm").decode(errors="replace").strip()
    except OSError:
        return "host-init"  # unknown: the careful answer
    return "container-init" if comm in INIT_PROGRAMS else "server"


def boot_id() -> str:
    """The kernel's boot id, or ``""`` when unreadable."""
    try:
        return _read(f"{PROCFS_PATH}/sys/kernel/random/boot_id").decode().strip()
    except OSError:
        return ""


def list_pids() -> list[int]:
    """Every numeric entry of the procfs root."""
    return [int(name) for name in os.listdir(PROCFS_PATH) if name.isdigit()]


def describe_wait_status(status: int) -> str:
    """Render a waitpid(2)-style status as ``exit code N`` or ``killed by SIGNAME``."""
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        try:
            return f"killed by {signal.Signals(number).name}"
        except ValueError:
            return f"killed by signal {number}"
    if os.WIFEXITED(status):
        return f"exit code {os.WEXITSTATUS(status)}"
    return f"wait status {status:#x}"
