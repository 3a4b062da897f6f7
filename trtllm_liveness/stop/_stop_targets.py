"""Stop targets: each input of :func:`~._bounded_stop.stop_processes` turned into a verified pidfd or a
reported non-target, before any signal is sent.

A :class:`ProcessIdentity` is verified against its start time; a plain pid, a ``Popen`` or a
``multiprocessing.Process`` gets a pidfd on whatever process has that pid now, then its start
time read from it. With process groups, one ``/proc`` scan finds the members of each group a
verified worker leads. Bad input of any kind becomes an ``unverified`` target, never an exception.
"""

from __future__ import annotations

import errno
import logging
import multiprocessing.process
import os
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Union

from .._errors import AccessDenied, InvalidIdentityError, PidReused, ProcessGone, ProcessZombie
from ..process import _pidfd, _procfs
from ..process._identity import ProcessIdentity, local_pid_namespace, parse_identities
from ._signal_ledger import Key
from ._stop_report import StopOutcome, UnkillableWorker

__all__ = ["AwaitedProc", "PreparedTarget", "StopTarget", "prepare", "prepare_groups"]

logger = logging.getLogger(__name__)

StopTarget = Union[  # a runtime alias: the string part stays lazy
    ProcessIdentity, int, "subprocess.Popen[Any]", multiprocessing.process.BaseProcess
]

# Upper bound on the members of one process group tracked individually (a /proc scan finds them).
_MAX_GROUP_MEMBERS = 4096
_NO_SUCH_PROCESS = "already exited (no such process)"


@dataclass
class AwaitedProc:
    """One process this call waits for: a worker or a member of its process group."""

    pid: int
    start_time: int
    pidfd: int
    exited_at: float | None = None
    after_kill: bool = False
    unkillable: UnkillableWorker | None = None

    @property
    def key(self) -> Key:
        return (self.pid, self.start_time)


@dataclass
class PreparedTarget:
    """One input of a stop call: its verified leader (and group members) to signal and await, or
    the ``outcome`` already decided (gone, unverified, not local); filled in as the call runs."""

    rank: int
    pid: int | None
    hostname: str
    owner: Any = None  # the Popen or Process the caller handed in, for reaping
    outcome: StopOutcome | None = None
    detail: str = ""
    identity: ProcessIdentity | None = None
    leader: AwaitedProc | None = None
    members: list[AwaitedProc] = field(default_factory=list)
    pgid: int | None = None
    returncode: int | None = None
    signals: list[str] = field(default_factory=list)

    def procs(self) -> list[AwaitedProc]:
        return ([self.leader] if self.leader is not None else []) + self.members

    def settle(self, outcome: StopOutcome, detail: str) -> PreparedTarget:
        """Decide this target's ``outcome`` before any signal (a non-target); returns it."""
        self.outcome, self.detail = outcome, detail
        return self


def prepare(index: int, raw: object, hostname: str) -> PreparedTarget:
    """Turn one input into a target with a verified pidfd, or into a reported non-target."""
    try:
        if isinstance(raw, subprocess.Popen):
            target = _prepare_child(index, raw.pid, hostname, raw, raw.returncode, lambda: raw.returncode)
        elif isinstance(raw, multiprocessing.process.BaseProcess):
            target = _prepare_mp_process(index, raw, hostname)
        elif isinstance(raw, (ProcessIdentity, tuple, list)):
            target = _prepare_identity(index, raw, hostname)
        elif isinstance(raw, int) and not isinstance(raw, bool):
            target = _prepare_pid(index, raw, hostname)
        else:
            target = PreparedTarget(index, None, hostname).settle(
                StopOutcome.UNVERIFIED, f"unsupported target type {type(raw).__name__}; not signalled")
    except Exception as exc:  # bad input must never crash a shutdown path
        logger.warning("liveness: cannot prepare stop target #%d (%r): %s", index, raw, exc)
        target = PreparedTarget(index, None, hostname).settle(
            StopOutcome.UNVERIFIED, f"could not be verified ({exc}); not signalled")
    return target


def _prepare_identity(index: int, raw: object, hostname: str) -> PreparedTarget:
    try:
        identity = parse_identities([raw])[0]
    except InvalidIdentityError as exc:
        return PreparedTarget(index, None, hostname).settle(StopOutcome.UNVERIFIED,
                                                            f"invalid identity ({exc}); not signalled")
    target = PreparedTarget(identity.rank, identity.pid, identity.hostname, identity=identity)
    if identity.hostname != hostname:
        return target.settle(StopOutcome.NOT_LOCAL, f"on host {identity.hostname}, not {hostname}; not signalled")
    if identity.start_time is None or identity.pid_namespace is None:
        # The worker could not read its own /proc entry: nothing to verify its pid against.
        return target.settle(StopOutcome.UNVERIFIED,
                             "identity without a start time or PID namespace (cannot be verified); not signalled")
    if identity.pid_namespace != local_pid_namespace():
        return target.settle(StopOutcome.NOT_LOCAL, f"in PID namespace {identity.pid_namespace}, not "
                             f"{local_pid_namespace()}; not signalled")
    try:
        fd = _pidfd.open_verified_pidfd(identity.pid, identity.start_time)
    except PidReused:
        return target.settle(StopOutcome.UNVERIFIED,
                             "start time differs (PID reused, or a wrong identity); not signalled")
    except ProcessZombie:
        return target.settle(StopOutcome.ALREADY_GONE, "already exited (zombie, not yet reaped by its parent)")
    except ProcessGone:
        return target.settle(StopOutcome.ALREADY_GONE, _NO_SUCH_PROCESS)
    except AccessDenied:
        return target.settle(StopOutcome.UNVERIFIED, "access denied to its /proc entry; not signalled")
    except OSError as exc:
        return target.settle(StopOutcome.UNVERIFIED, _pidfd_open_failed(exc))
    target.leader = AwaitedProc(identity.pid, identity.start_time, fd)
    return target


def _prepare_pid(index: int, pid: int, hostname: str) -> PreparedTarget:
    target = PreparedTarget(index, pid, hostname)
    if pid <= 1 or pid == os.getpid():
        return target.settle(StopOutcome.UNVERIFIED,
                             "pid 1, the calling process or a non-positive pid is never signalled")
    _open_current(target, pid)
    if target.leader is not None:
        target.identity = ProcessIdentity(index, pid, target.leader.start_time, hostname, local_pid_namespace())
    return target


def _prepare_mp_process(index: int, process: multiprocessing.process.BaseProcess, hostname: str) -> PreparedTarget:
    pid = process.pid
    if pid is None:
        return PreparedTarget(index, None, hostname).settle(StopOutcome.ALREADY_GONE, "never started")
    if getattr(process, "_parent_pid", None) != os.getpid():
        return _prepare_pid(index, pid, hostname)  # not our child (inherited object): not ours to reap
    # exitcode reaps it if it has exited; the returncode of its Popen is set once it was reaped.
    return _prepare_child(index, pid, hostname, process, process.exitcode,
                          lambda: getattr(getattr(process, "_popen", None), "returncode", None))


def _prepare_child(index: int, pid: int, hostname: str, owner: Any, exited: int | None,
                   reaped: Callable[[], int | None]) -> PreparedTarget:
    """A child the caller owns (``owner``, reaped at the end): ``exited`` is its status where it has
    exited already, ``reaped`` reads it again after its pidfd was opened."""
    target = PreparedTarget(index, pid, hostname, owner=owner)
    if exited is not None:
        return _reaped(target, exited)
    _open_current(target, pid)
    # An unreaped child pins its pid, so the pidfd is the child's unless another thread reaped it
    # in between; then the returncode is already set and the fd is not trusted.
    returncode = reaped()
    if target.leader is not None and returncode is not None:
        return _reaped(target, returncode)
    return target


def _reaped(target: PreparedTarget, returncode: int) -> PreparedTarget:
    """``target``, a child of the caller, as already exited and reaped with ``returncode``; a pidfd
    opened on its pid meanwhile is closed (the pid may be another process's by now)."""
    if target.leader is not None:
        os.close(target.leader.pidfd)
        target.leader = None
    target.returncode = returncode
    return target.settle(StopOutcome.ALREADY_GONE, "already exited and reaped")


def _open_current(target: PreparedTarget, pid: int) -> None:
    """Open a pidfd on whatever process has ``pid`` now, then read its start time from it."""
    try:
        fd = _pidfd.open_pidfd(pid)
    except OSError as exc:
        if exc.errno == errno.ESRCH:  # ProcessLookupError
            target.settle(StopOutcome.ALREADY_GONE, _NO_SUCH_PROCESS)
        else:
            target.settle(StopOutcome.UNVERIFIED, _pidfd_open_failed(exc))
        return
    try:
        info = _procfs.read_stat(pid)
    except OSError:
        # Gone between the open and the read: the fd pins the exited process, nothing to signal.
        os.close(fd)
        target.settle(StopOutcome.ALREADY_GONE, _NO_SUCH_PROCESS)
        return
    except ValueError as exc:  # malformed stat: cannot verify, so never signal (and keep no fd)
        os.close(fd)
        target.settle(StopOutcome.UNVERIFIED, f"unreadable /proc stat ({exc}); not signalled")
        return
    if info.exited or _pidfd.is_exited(fd):
        os.close(fd)
        target.settle(StopOutcome.ALREADY_GONE, "already exited (zombie, not yet reaped)")
        return
    target.leader = AwaitedProc(pid, info.start_time, fd)


def _pidfd_open_failed(exc: OSError) -> str:
    return f"pidfd_open failed ({errno.errorcode.get(exc.errno or 0, exc)}); not signalled"


def prepare_groups(targets: list[PreparedTarget]) -> None:
    """Decide where ``killpg`` may be used and open pidfds on the members of those groups.

    A group is used only when the verified worker leads it (pgid == pid) and it is not the
    caller's own group. One scan of ``/proc`` finds the members of every such group.
    """
    by_pgid: dict[int, PreparedTarget] = {}
    for target in targets:
        leader = target.leader
        if leader is None:
            continue
        info = _procfs.stat_or_none(leader.pid)  # None: exited meanwhile; the pidfd reports it
        if info is None or info.start_time != leader.start_time:
            continue
        if info.pgrp != leader.pid:
            target.detail = f"not a process-group leader (pgid {info.pgrp}); signalled alone"
        elif info.pgrp == os.getpgrp():
            target.detail = "its process group is the caller's own; signalled alone"
        elif info.pgrp not in by_pgid:
            target.pgid = info.pgrp
            by_pgid[info.pgrp] = target
    if not by_pgid:
        return
    for pid in _procfs.list_pids():
        member = _procfs.stat_or_none(pid)
        if member is None:
            continue
        group = by_pgid.get(member.pgrp)
        if group is None or pid == member.pgrp or member.exited:
            continue
        if len(group.members) >= _MAX_GROUP_MEMBERS:
            continue
        try:
            fd = _pidfd.open_verified_pidfd(pid, member.start_time)
        except (ProcessGone, AccessDenied, OSError):
            continue
        group.members.append(AwaitedProc(pid, member.start_time, fd))
