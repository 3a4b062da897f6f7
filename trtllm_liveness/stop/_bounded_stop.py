"""Bounded shutdown: stop worker processes with a deadline that always holds, report the unkillable.

torchrun's close used to send SIGTERM, wait, send SIGKILL and then ``join()`` without a timeout;
a worker in uninterruptible sleep (``D``: GPU driver, NCCL, RDMA) survives SIGKILL, so the
launcher never exited. Here every wait has a deadline::

    t0 ---- TERM (pidfd) ---- poll(pidfds) until grace deadline ----+
                                                                    |  survivors
          +---- KILL (pidfd) ---- poll(pidfds) until kill deadline -+
          |
          +--> survivors: sampled (state, wchan, D threads), logged at ERROR, reported unkillable

Signals go only through pidfds opened *and then* verified against the target's start time, so a
recycled PID is never signalled; a whole process group is signalled through its leader's pidfd
(``PIDFD_SIGNAL_PROCESS_GROUP``, Linux 6.9+) or, on older kernels, with ``killpg`` while its
verified leader still pins the group id (the window that leaves is described in
:func:`stop_processes`). Exits are awaited with one ``poll`` over the pidfds per phase (no busy
loop). Children the caller owns (``Popen``, ``multiprocessing.Process``) are reaped with a bounded
wait.
"""

from __future__ import annotations

import enum
import errno
import logging
import math
import multiprocessing.process
import os
import select
import signal
import subprocess
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Union

from .._errors import AccessDenied, InvalidIdentityError, PidReused, ProcessGone, ProcessZombie
from .._events import EventKind, WorkerEvent
from ..monitor._wedge import sample_d_state
from ..process import _pidfd, _procfs
from ..process._identity import ProcessIdentity, local_hostname, local_pid_namespace, parse_identities

__all__ = ["StopOutcome", "StopReport", "StoppedWorker", "UnkillableWorker", "stop_processes"]

logger = logging.getLogger(__name__)

StopTarget = Union[  # a runtime alias: the string part stays lazy
    ProcessIdentity, int, "subprocess.Popen[Any]", multiprocessing.process.BaseProcess
]

# Budget for reaping owned children after the kill phase, all of them together. Reaping a zombie
# takes microseconds; the budget only matters when another thread holds Popen's waitpid lock.
_REAP_BUDGET_S = 0.2
# Upper bound on the members of one process group tracked individually (a /proc scan finds them).
_MAX_GROUP_MEMBERS = 4096
_POLL_FLAGS = select.POLLIN | select.POLLHUP | select.POLLERR


class StopOutcome(str, enum.Enum):
    """How one worker ended in :func:`stop_processes`."""

    ALREADY_GONE = "already-gone"
    """Exited (or a zombie) before any signal; nothing was sent."""
    EXITED_AFTER_TERM = "exited-after-term"
    """Exited during the grace period, after the polite signal."""
    EXITED_AFTER_KILL = "exited-after-kill"
    """Exited during the kill period, after SIGKILL."""
    UNKILLABLE = "unkillable"
    """Still there after SIGKILL and the kill deadline (or one of its group members is)."""
    UNVERIFIED = "unverified"
    """Its identity did not verify (PID reused, wrong start time, bad input, no pidfd): not signalled."""
    NOT_LOCAL = "not-local"
    """On another host or in another PID namespace: its PID means nothing here; not signalled."""


@dataclass(frozen=True)
class UnkillableWorker:
    """A process that survived SIGKILL past the kill deadline, as sampled right after it.

    ``state`` is the main thread's one-letter state, ``wchan`` its wait channel; ``d_tids`` the
    threads found in ``D`` and ``d_wchan`` the wait channel of the first of them (a driver or NCCL
    thread may be stuck while the main thread sleeps in ``S``). ``leader_pid`` is set when this is
    a member of a worker's process group rather than the worker itself.
    """

    rank: int
    pid: int
    hostname: str
    state: str
    wchan: str
    d_tids: tuple[int, ...]
    d_wchan: str
    kill_pending: bool
    signal: str
    waited_s: float
    identity: ProcessIdentity | None = None
    leader_pid: int | None = None

    @property
    def message(self) -> str:
        """One ERROR-log line naming the pid, the failed signal and the host-recycling advice."""
        who = f"rank {self.rank} (pid {self.pid}"
        who += f", in the process group of pid {self.leader_pid})" if self.leader_pid else ")"
        threads = ",".join(map(str, self.d_tids[:8])) or "none"
        return (
            f"{who} on host {self.hostname} did not exit {self.waited_s:.2f}s after {self.signal} "
            f"(state {self.state or '?'}, wchan {self.wchan or '?'}, D threads {threads}"
            f"{', wchan ' + self.d_wchan if self.d_wchan else ''}, SIGKILL pending: "
            f"{'yes' if self.kill_pending else 'no'}); it is probably in uninterruptible sleep in "
            f"the kernel (GPU driver, NCCL, RDMA). Giving up on it: the host may need recycling "
            f"before its GPUs/NICs are reused"
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "rank": self.rank,
            "pid": self.pid,
            "hostname": self.hostname,
            "state": self.state,
            "wchan": self.wchan,
            "d_tids": list(self.d_tids),
            "d_wchan": self.d_wchan,
            "kill_pending": self.kill_pending,
            "signal": self.signal,
            "waited_s": self.waited_s,
            "leader_pid": self.leader_pid,
            "message": self.message,
        }


@dataclass(frozen=True)
class StoppedWorker:
    """The result for one target of :func:`stop_processes`.

    ``pid`` is None for a target that had none (a ``Process`` never started, bad input).
    ``returncode`` is set for owned children that were reaped (``Popen`` convention: negative for
    a signal). ``exited_after_s`` is the time from the call's start until the exit was seen.
    """

    rank: int
    pid: int | None
    hostname: str
    outcome: StopOutcome
    detail: str = ""
    returncode: int | None = None
    exited_after_s: float | None = None
    signals_sent: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "rank": self.rank,
            "pid": self.pid,
            "hostname": self.hostname,
            "outcome": self.outcome.value,
            "detail": self.detail,
            "returncode": self.returncode,
            "exited_after_s": self.exited_after_s,
            "signals_sent": list(self.signals_sent),
        }


@dataclass(frozen=True)
class StopReport:
    """What :func:`stop_processes` did: one :class:`StoppedWorker` per target, in input order.

    ``restartable`` is False when anything was unkillable: a task stuck in ``D`` still holds its
    GPU/NIC, so a new worker group on this host would conflict with it (torchrun's policy for
    ``uninterruptible_state_timeout``). Callers should then stop instead of restarting here.
    """

    workers: tuple[StoppedWorker, ...]
    unkillable: tuple[UnkillableWorker, ...]
    grace_s: float
    kill_s: float
    term_signal: str
    elapsed_s: float
    started_wall: float

    @property
    def restartable(self) -> bool:
        """Whether a new worker group may be started on this host."""
        return not self.unkillable

    @property
    def all_stopped(self) -> bool:
        """Whether every target is known to be gone (none unkillable, unverified or not local)."""
        done = (StopOutcome.ALREADY_GONE, StopOutcome.EXITED_AFTER_TERM, StopOutcome.EXITED_AFTER_KILL)
        return all(worker.outcome in done for worker in self.workers)

    def by_outcome(self, outcome: StopOutcome) -> list[StoppedWorker]:
        """The workers that ended with ``outcome``, in input order."""
        return [worker for worker in self.workers if worker.outcome is outcome]

    def events(self) -> list[WorkerEvent]:
        """One non-restartable ``UNKILLABLE`` :class:`WorkerEvent` per unkillable process.

        Feed one to :class:`~trtllm_liveness.WorkerFailedError` to make a launcher stop for good.
        Processes without a known identity get one built from the report (namespace 0).
        """
        events = []
        for item in self.unkillable:
            identity = item.identity or ProcessIdentity(item.rank, item.pid, 0, item.hostname, 0)
            cause = f"survived {item.signal} for {item.waited_s:.2f}s (state {item.state}, wchan {item.wchan or '?'})"
            events.append(WorkerEvent(EventKind.UNKILLABLE, identity, cause,
                                      tid=item.d_tids[0] if item.d_tids else None,
                                      wchan=item.d_wchan or item.wchan))
        return events

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "restartable": self.restartable,
            "all_stopped": self.all_stopped,
            "grace_s": self.grace_s,
            "kill_s": self.kill_s,
            "term_signal": self.term_signal,
            "elapsed_s": self.elapsed_s,
            "started_wall": self.started_wall,
            "workers": [worker.to_dict() for worker in self.workers],
            "unkillable": [item.to_dict() for item in self.unkillable],
        }


# --------------------------------------------------------------------- cross-call signal ledger
#
# Two concurrent calls (a health path and an atexit path, say) may stop the same process. Each
# call waits on its own pidfds and keeps its own deadlines, but a given signal is sent to a given
# process (pid, start time) once across all calls in flight: a second SIGTERM could cut short the
# cleanup handler the first one started. A re-entrant lock keeps a call made from a signal handler
# that interrupted this very thread from deadlocking (though that use is discouraged, see below).

_Key = tuple[int, int]


@dataclass
class _Ledger:
    refs: int = 0
    sent: set[int] = field(default_factory=set)


_ledger_lock = threading.RLock()
_ledgers: dict[_Key, _Ledger] = {}


def _reset_ledger_after_fork() -> None:
    # A forked child must not inherit a lock held by a thread that does not exist there.
    global _ledger_lock
    _ledger_lock = threading.RLock()
    _ledgers.clear()


os.register_at_fork(after_in_child=_reset_ledger_after_fork)


def _ledger_acquire(key: _Key) -> None:
    with _ledger_lock:
        _ledgers.setdefault(key, _Ledger()).refs += 1


def _ledger_release(key: _Key) -> None:
    with _ledger_lock:
        entry = _ledgers.get(key)
        if entry is not None:
            entry.refs -= 1
            if entry.refs <= 0:
                del _ledgers[key]


def _claim(key: _Key, sig: int) -> bool:
    """Reserve sending ``sig`` to ``key``; False when some call already sent it."""
    with _ledger_lock:
        entry = _ledgers.setdefault(key, _Ledger())
        if sig in entry.sent:
            return False
        entry.sent.add(sig)
        return True


def _was_sent(key: _Key, sig: int) -> bool:
    with _ledger_lock:
        entry = _ledgers.get(key)
        return entry is not None and sig in entry.sent


# --------------------------------------------------------------------- per-call state


@dataclass
class _Proc:
    """One process this call waits for: a worker or a member of its process group."""

    pid: int
    start_time: int
    pidfd: int
    exited_at: float | None = None
    after_kill: bool = False
    unkillable: UnkillableWorker | None = None

    @property
    def key(self) -> _Key:
        return (self.pid, self.start_time)


@dataclass
class _Target:
    rank: int
    pid: int | None
    hostname: str
    owner: Any = None  # the Popen or Process the caller handed in, for reaping
    outcome: StopOutcome | None = None
    detail: str = ""
    identity: ProcessIdentity | None = None
    leader: _Proc | None = None
    members: list[_Proc] = field(default_factory=list)
    pgid: int | None = None
    returncode: int | None = None
    signals: list[str] = field(default_factory=list)

    def procs(self) -> list[_Proc]:
        return ([self.leader] if self.leader is not None else []) + self.members


def stop_processes(
    targets: Iterable[StopTarget],
    *,
    grace_s: float = 5.0,
    kill_s: float = 5.0,
    term_signal: int = signal.SIGTERM,
    process_group: bool = False,
    host: str | None = None,
) -> StopReport:
    """Stop worker processes within ``grace_s + kill_s`` plus a few milliseconds, and report.

    Each target is a :class:`ProcessIdentity` (verified against its start time), a plain pid
    (whatever process has that pid when the call starts), a ``subprocess.Popen`` or a
    ``multiprocessing.Process`` (children the caller owns: they are reaped). The call sends
    ``term_signal`` to every live target, waits until they exit or ``grace_s`` passes, sends
    SIGKILL to the survivors, waits until they exit or ``kill_s`` passes, and returns. A survivor
    of SIGKILL (a task stuck in ``D``) is reported unkillable, with one ERROR log line each, and
    makes :attr:`StopReport.restartable` False; it is left as it is (an owned one unreaped).

    With ``process_group=True`` a target that leads its own process group is signalled as a group
    (its children too, also those forked after the call started), and the group's members found at
    the start are awaited and reported as well. A target that is not a group leader, or whose group
    is the caller's own, is signalled alone. Where the kernel has ``PIDFD_SIGNAL_PROCESS_GROUP``
    (Linux 6.9+, probed once) the group signal goes through the verified leader's pidfd: the kernel
    picks the group from the process the fd pins, so no other group can be reached, even after the
    leader exited and was reaped. On older kernels it is ``killpg`` by number, sent only while the
    verified leader (alive, or a zombie not yet reaped) still holds the group id. That leaves a
    window between the check and the ``killpg``: if in it the leader is reaped, every member exits,
    the number is reused and the new process makes itself a group leader (``setsid``/``setpgid``),
    that unrelated group gets the signal. The window is microseconds wide and needs all four
    events; where the leader was already reaped at the check, each member is signalled through
    its own pidfd instead (members forked after the start are then missed).

    Never signals: an identity whose start time differs (PID reused) or cannot be read, an
    identity of another host (``host``, default this machine's hostname) or PID namespace, the
    calling process, pid 1, malformed input; those are reported, not raised.

    Blocks for at most ``grace_s + kill_s`` plus procfs reads and reaping (bounded by 0.2 s in
    all); every wait is a ``poll`` on pidfds with a deadline. Raises ``ValueError`` only for a
    negative or non-finite ``grace_s``/``kill_s``, an invalid ``term_signal`` or a ``targets``
    that is not iterable. A ``KeyboardInterrupt`` while waiting closes every pidfd and propagates.

    Thread-safe: it may run in several threads at once, also on the same processes (a given
    signal reaches a given process once across concurrent calls; each call keeps its own
    deadlines and report), and beside a :class:`~trtllm_liveness.WorkerProcessMonitor`, which
    never signals. Do not call it *inside* a signal handler (it blocks for up to the deadlines):
    have the handler set a flag or wake the main loop, and call it from there or from a thread.
    """
    for name, value in (("grace_s", grace_s), ("kill_s", kill_s)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    try:
        term = signal.Signals(term_signal)
    except (ValueError, TypeError):
        raise ValueError(f"term_signal must be a signal number, got {term_signal!r}") from None
    if term == 0:
        raise ValueError("term_signal must not be 0")
    t0 = time.monotonic()
    started_wall = time.time()
    hostname = host if isinstance(host, str) and host else local_hostname()
    try:
        items = list(targets)
    except TypeError:
        raise ValueError(f"targets must be an iterable, got {type(targets).__name__}") from None

    prepared: list[_Target] = []
    keys: list[_Key] = []
    poller = select.poll()
    waiting: dict[int, _Proc] = {}
    try:
        for index, raw in enumerate(items):
            prepared.append(_prepare(index, raw, hostname))
        if process_group:
            _prepare_groups(prepared)
        for target in prepared:
            for proc in target.procs():
                keys.append(proc.key)
                _ledger_acquire(proc.key)
                waiting[proc.pidfd] = proc
                poller.register(proc.pidfd, _POLL_FLAGS)

        # Phase 1: the polite signal, then wait until the grace deadline.
        grace_deadline = t0 + grace_s
        _signal_all(prepared, term, waiting)
        _wait_exits(poller, waiting, grace_deadline)

        # Phase 2: SIGKILL to the survivors, then wait until the kill deadline.
        if waiting:
            kill_start = time.monotonic()
            _signal_all(prepared, signal.SIGKILL, waiting)
            _wait_exits(poller, waiting, kill_start + kill_s)
            waited = time.monotonic() - kill_start
            owners = {id(proc): target for target in prepared for proc in target.procs()}
            for proc in list(waiting.values()):
                if _pidfd.is_exited(proc.pidfd):  # exited right at the deadline
                    _mark_exited(proc, time.monotonic())
                    continue
                owner = owners[id(proc)]
                proc.unkillable = _sample_unkillable(owner, proc, waited)
                logger.error("liveness: %s", proc.unkillable.message)

        _reap_owned(prepared, time.monotonic() + _REAP_BUDGET_S)
    finally:
        for target in prepared:
            for proc in target.procs():
                try:
                    os.close(proc.pidfd)
                except OSError:
                    pass
        for key in keys:
            _ledger_release(key)

    workers = tuple(_finish(target, t0) for target in prepared)
    unkillable = tuple(proc.unkillable for target in prepared for proc in target.procs() if proc.unkillable)
    return StopReport(workers, unkillable, float(grace_s), float(kill_s), term.name,
                      time.monotonic() - t0, started_wall)


# --------------------------------------------------------------------- preparation


def _prepare(index: int, raw: object, hostname: str) -> _Target:
    """Turn one input into a target with a verified pidfd, or into a reported non-target."""
    try:
        if isinstance(raw, subprocess.Popen):
            target = _prepare_popen(index, raw, hostname)
        elif isinstance(raw, multiprocessing.process.BaseProcess):
            target = _prepare_mp_process(index, raw, hostname)
        elif isinstance(raw, (ProcessIdentity, tuple, list)):
            target = _prepare_identity(index, raw, hostname)
        elif isinstance(raw, int) and not isinstance(raw, bool):
            target = _prepare_pid(index, raw, hostname)
        else:
            target = _Target(index, None, hostname, outcome=StopOutcome.UNVERIFIED,
                             detail=f"unsupported target type {type(raw).__name__}; not signalled")
    except Exception as exc:  # bad input must never crash a shutdown path
        logger.warning("liveness: cannot prepare stop target #%d (%r): %s", index, raw, exc)
        target = _Target(index, None, hostname, outcome=StopOutcome.UNVERIFIED,
                         detail=f"could not be verified ({exc}); not signalled")
    return target


def _prepare_identity(index: int, raw: object, hostname: str) -> _Target:
    try:
        identity = parse_identities([raw])[0]
    except InvalidIdentityError as exc:
        return _Target(index, None, hostname, outcome=StopOutcome.UNVERIFIED,
                       detail=f"invalid identity ({exc}); not signalled")
    target = _Target(identity.rank, identity.pid, identity.hostname, identity=identity)
    if identity.hostname != hostname:
        target.outcome = StopOutcome.NOT_LOCAL
        target.detail = f"on host {identity.hostname}, not {hostname}; not signalled"
        return target
    if identity.start_time is None or identity.pid_namespace is None:
        # The worker could not read its own /proc entry: nothing to verify its pid against.
        target.outcome = StopOutcome.UNVERIFIED
        target.detail = "identity without a start time or PID namespace (cannot be verified); not signalled"
        return target
    if identity.pid_namespace != local_pid_namespace():
        target.outcome = StopOutcome.NOT_LOCAL
        target.detail = f"in PID namespace {identity.pid_namespace}, not {local_pid_namespace()}; not signalled"
        return target
    try:
        fd = _pidfd.open_verified_pidfd(identity.pid, identity.start_time)
    except PidReused:
        target.outcome = StopOutcome.UNVERIFIED
        target.detail = "start time differs (PID reused, or a wrong identity); not signalled"
    except ProcessZombie:
        target.outcome = StopOutcome.ALREADY_GONE
        target.detail = "already exited (zombie, not yet reaped by its parent)"
    except ProcessGone:
        target.outcome = StopOutcome.ALREADY_GONE
        target.detail = "already exited (no such process)"
    except AccessDenied:
        target.outcome = StopOutcome.UNVERIFIED
        target.detail = "access denied to its /proc entry; not signalled"
    except OSError as exc:
        target.outcome = StopOutcome.UNVERIFIED
        target.detail = f"pidfd_open failed ({errno.errorcode.get(exc.errno or 0, exc)}); not signalled"
    else:
        target.leader = _Proc(identity.pid, identity.start_time, fd)
    return target


def _prepare_pid(index: int, pid: int, hostname: str) -> _Target:
    target = _Target(index, pid, hostname)
    if pid <= 1 or pid == os.getpid():
        target.outcome = StopOutcome.UNVERIFIED
        target.detail = "pid 1, the calling process or a non-positive pid is never signalled"
        return target
    _open_current(target, pid)
    if target.leader is not None:
        target.identity = ProcessIdentity(index, pid, target.leader.start_time, hostname, local_pid_namespace())
    return target


def _prepare_popen(index: int, popen: subprocess.Popen[Any], hostname: str) -> _Target:
    target = _Target(index, popen.pid, hostname, owner=popen)
    if popen.returncode is not None:
        target.outcome = StopOutcome.ALREADY_GONE
        target.returncode = popen.returncode
        target.detail = "already exited and reaped"
        return target
    _open_current(target, popen.pid)
    # An unreaped child pins its pid, so the pidfd is the child's unless another thread reaped it
    # in between; then the returncode is already set and the fd is not trusted.
    if target.leader is not None and popen.returncode is not None:
        os.close(target.leader.pidfd)
        target.leader = None
        target.outcome = StopOutcome.ALREADY_GONE
        target.returncode = popen.returncode
        target.detail = "already exited and reaped"
    return target


def _prepare_mp_process(index: int, process: multiprocessing.process.BaseProcess, hostname: str) -> _Target:
    pid = process.pid
    if pid is None:
        return _Target(index, None, hostname, outcome=StopOutcome.ALREADY_GONE, detail="never started")
    if getattr(process, "_parent_pid", None) != os.getpid():
        return _prepare_pid(index, pid, hostname)  # not our child (inherited object): not ours to reap
    exitcode = process.exitcode  # reaps it if it has exited
    target = _Target(index, pid, hostname, owner=process)
    if exitcode is not None:
        target.outcome = StopOutcome.ALREADY_GONE
        target.returncode = exitcode
        target.detail = "already exited and reaped"
        return target
    _open_current(target, pid)
    popen = getattr(process, "_popen", None)
    returncode = getattr(popen, "returncode", None)
    if target.leader is not None and returncode is not None:  # reaped meanwhile by another thread
        os.close(target.leader.pidfd)
        target.leader = None
        target.outcome = StopOutcome.ALREADY_GONE
        target.returncode = returncode
        target.detail = "already exited and reaped"
    return target


def _open_current(target: _Target, pid: int) -> None:
    """Open a pidfd on whatever process has ``pid`` now, then read its start time from it."""
    try:
        fd = _pidfd.open_pidfd(pid)
    except ProcessLookupError:
        target.outcome, target.detail = StopOutcome.ALREADY_GONE, "already exited (no such process)"
        return
    except OSError as exc:
        if exc.errno == errno.ESRCH:
            target.outcome, target.detail = StopOutcome.ALREADY_GONE, "already exited (no such process)"
        else:
            target.outcome = StopOutcome.UNVERIFIED
            target.detail = f"pidfd_open failed ({errno.errorcode.get(exc.errno or 0, exc)}); not signalled"
        return
    try:
        info = _procfs.read_stat(pid)
    except OSError:
        # Gone between the open and the read: the fd pins the exited process, nothing to signal.
        os.close(fd)
        target.outcome, target.detail = StopOutcome.ALREADY_GONE, "already exited (no such process)"
        return
    except ValueError as exc:  # malformed stat: cannot verify, so never signal (and keep no fd)
        os.close(fd)
        target.outcome, target.detail = StopOutcome.UNVERIFIED, f"unreadable /proc stat ({exc}); not signalled"
        return
    if info.state in ("Z", "X") or _pidfd.is_exited(fd):
        os.close(fd)
        target.outcome, target.detail = StopOutcome.ALREADY_GONE, "already exited (zombie, not yet reaped)"
        return
    target.leader = _Proc(pid, info.start_time, fd)


def _prepare_groups(targets: list[_Target]) -> None:
    """Decide where ``killpg`` may be used and open pidfds on the members of those groups.

    A group is used only when the verified worker leads it (pgid == pid) and it is not the
    caller's own group. One scan of ``/proc`` finds the members of every such group.
    """
    by_pgid: dict[int, _Target] = {}
    for target in targets:
        leader = target.leader
        if leader is None:
            continue
        try:
            info = _procfs.read_stat(leader.pid)
        except (OSError, ValueError):
            continue  # exited meanwhile; the pidfd reports it
        if info.start_time != leader.start_time:
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
        try:
            member = _procfs.read_stat(pid)
        except (OSError, ValueError):
            continue
        group = by_pgid.get(member.pgrp)
        if group is None or pid == member.pgrp or member.state in ("Z", "X"):
            continue
        if len(group.members) >= _MAX_GROUP_MEMBERS:
            continue
        try:
            fd = _pidfd.open_verified_pidfd(pid, member.start_time)
        except (ProcessGone, AccessDenied, OSError):
            continue
        group.members.append(_Proc(pid, member.start_time, fd))


# --------------------------------------------------------------------- signalling and waiting


def _signal_all(targets: list[_Target], sig: signal.Signals, waiting: dict[int, _Proc]) -> None:
    for target in targets:
        live = [proc for proc in target.procs() if proc.pidfd in waiting]
        if not live:
            continue
        if target.pgid is not None and _signal_group(target, sig):
            continue
        for proc in live:
            if not _claim(proc.key, sig):
                continue
            try:
                if _pidfd.send_signal(proc.pidfd, sig) and proc is target.leader:
                    target.signals.append(sig.name)
            except OSError as exc:
                logger.warning("liveness: pidfd_send_signal(pid %d, %s) failed: %s", proc.pid, sig.name, exc)


def _signal_group(target: _Target, sig: signal.Signals) -> bool:
    """Signal ``target``'s whole process group once; False when it must be signalled member by member.

    One signal reaches the whole group, also members forked after the scan. Where the kernel has
    ``PIDFD_SIGNAL_PROCESS_GROUP`` it goes through the leader's pidfd: the group is the one that
    pidfd pins, whatever became of its number. Elsewhere ``killpg`` by number, and only while the
    verified leader pins the number (see :func:`stop_processes` for the window that remains).
    """
    leader = target.leader
    if leader is None or target.pgid is None:
        return False
    use_pidfd = _pidfd.group_signal_supported()
    if not use_pidfd and not _group_pinned(target):
        return False
    if not _claim(leader.key, sig):
        return True  # another call in flight already sent it to this group
    for member in target.members:
        _claim(member.key, sig)
    label = f"{sig.name} (group {target.pgid})"
    if use_pidfd:
        try:
            if _pidfd.send_group_signal(leader.pidfd, sig):
                target.signals.append(label)
            return True  # ESRCH: no member is left to signal
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.ENOSYS):
                logger.warning("liveness: pidfd_send_signal(group %d, %s) failed: %s", target.pgid, sig.name, exc)
                return True
            # Probed as supported but refused (a seccomp filter, say): today's path, for this call.
            logger.debug("liveness: group signal through a pidfd refused (%s); using killpg", exc)
            if not _group_pinned(target):
                _unclaim_group(target, sig)
                return False
    try:
        os.killpg(target.pgid, sig)
        target.signals.append(label)
    except ProcessLookupError:
        pass
    except OSError as exc:
        logger.warning("liveness: killpg(%d, %s) failed: %s", target.pgid, sig.name, exc)
    return True


def _unclaim_group(target: _Target, sig: signal.Signals) -> None:
    with _ledger_lock:
        for proc in target.procs():
            entry = _ledgers.get(proc.key)
            if entry is not None:
                entry.sent.discard(sig)


def _group_pinned(target: _Target) -> bool:
    """Whether the group id still names the verified leader's group.

    A process-group id cannot be reused while its leader exists, even as an unreaped zombie.
    """
    leader = target.leader
    if leader is None:
        return False
    if not _pidfd.is_exited(leader.pidfd):
        return True
    try:
        info = _procfs.read_stat(leader.pid)
    except OSError:
        return False
    return info.start_time == leader.start_time and info.state == "Z"


def _wait_exits(poller: select.poll, waiting: dict[int, _Proc], deadline: float) -> None:
    """Wait until every pidfd in ``waiting`` is readable or ``deadline`` passes (one poll per wakeup)."""
    while waiting:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return
        # poll rounds the timeout up to whole milliseconds, so this never spins near the deadline.
        ready = poller.poll(remaining * 1000.0)
        now = time.monotonic()
        for fd, _mask in ready:
            proc = waiting.pop(fd, None)
            if proc is not None:
                poller.unregister(fd)
                _mark_exited(proc, now)


def _mark_exited(proc: _Proc, now: float) -> None:
    proc.exited_at = now
    proc.after_kill = _was_sent(proc.key, signal.SIGKILL)


def _sample_unkillable(target: _Target, proc: _Proc, waited: float) -> UnkillableWorker:
    state = wchan = d_wchan = ""
    d_tids: tuple[int, ...] = ()
    kill_pending = False
    try:
        state = _procfs.read_stat(proc.pid).state
        wchan = _procfs.read_wchan(proc.pid)
        sample = sample_d_state(proc.pid)
        if sample is not None:
            d_tids, kill_pending, d_wchan = sample.d_tids, sample.kill_pending, sample.wchan
        else:
            kill_pending = _procfs.sigkill_pending(proc.pid)
    except (OSError, ValueError):
        pass  # it may be exiting right now; report what was read
    is_leader = proc is target.leader
    identity = target.identity if is_leader else None
    if identity is None:
        identity = ProcessIdentity(target.rank, proc.pid, proc.start_time, target.hostname, local_pid_namespace())
    return UnkillableWorker(
        rank=target.rank, pid=proc.pid, hostname=target.hostname, state=state, wchan=wchan,
        d_tids=d_tids, d_wchan=d_wchan, kill_pending=kill_pending, signal=signal.SIGKILL.name,
        waited_s=waited, identity=identity, leader_pid=None if is_leader else target.pid,
    )


def _reap_owned(targets: list[_Target], deadline: float) -> None:
    """Reap exited children the caller handed in, so none is left a zombie (bounded)."""
    for target in targets:
        if target.owner is None or target.returncode is not None:
            continue
        leader = target.leader
        if leader is not None and leader.exited_at is None:
            continue  # still alive (unkillable): it cannot be reaped now
        if leader is None and target.outcome is not StopOutcome.ALREADY_GONE:
            continue
        remaining = max(0.0, deadline - time.monotonic())
        try:
            if isinstance(target.owner, subprocess.Popen):
                code = target.owner.poll()
                if code is None and remaining > 0:
                    # poll() returns None when another thread holds Popen's waitpid lock.
                    code = target.owner.wait(timeout=remaining)
                target.returncode = code
            else:
                target.owner.join(timeout=remaining)
                target.returncode = target.owner.exitcode
        except subprocess.TimeoutExpired:
            pass
        except Exception as exc:  # reaping is best effort: the report must come back
            logger.debug("liveness: reaping pid %s failed: %s", target.pid, exc)


def _finish(target: _Target, t0: float) -> StoppedWorker:
    signals = tuple(target.signals)
    if target.outcome is not None:
        return StoppedWorker(target.rank, target.pid, target.hostname, target.outcome, target.detail,
                             target.returncode, None, signals)
    leader = target.leader
    assert leader is not None
    stuck = [proc for proc in target.procs() if proc.unkillable is not None]
    details = [target.detail] if target.detail else []
    if leader.unkillable is not None:
        outcome = StopOutcome.UNKILLABLE
        details.append(f"survived SIGKILL (state {leader.unkillable.state or '?'}); not reaped")
    elif stuck:
        outcome = StopOutcome.UNKILLABLE
        details.append("group member(s) " + ", ".join(str(proc.pid) for proc in stuck) + " survived SIGKILL")
    elif leader.after_kill:
        outcome = StopOutcome.EXITED_AFTER_KILL
    else:
        outcome = StopOutcome.EXITED_AFTER_TERM
    if target.members:
        details.append(f"{len(target.members)} group member(s) awaited")
    if target.returncode is not None:
        details.append(_describe_returncode(target.returncode))
    exited = None if leader.exited_at is None else leader.exited_at - t0
    return StoppedWorker(target.rank, target.pid, target.hostname, outcome, "; ".join(details),
                         target.returncode, exited, signals)


def _describe_returncode(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
