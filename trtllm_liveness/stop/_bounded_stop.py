"""Bounded shutdown: stop worker processes with a deadline that always holds, report the unkillable.

A close that sends SIGTERM, waits, sends SIGKILL and then joins the worker without a timeout never
returns when a worker is in uninterruptible sleep (``D``: GPU driver, NCCL, RDMA): such a worker
survives SIGKILL, so the launcher never exits. Here every wait has a deadline::

    t0 ---- TERM (pidfd) ---- poll(pidfds) until grace deadline ----+
                                                                    |  survivors
          +---- KILL (pidfd) ---- poll(pidfds) until kill deadline -+
          |
          +--> survivors: sampled (state, wchan, D threads, SIGKILL pending, kernel stacks), logged at
               ERROR, reported unkillable whatever their state (D, R, ...: see _survivor.py)

Signals go only through pidfds opened *and then* verified against the target's start time, so a
recycled PID is never signalled; a whole process group is signalled through its leader's pidfd
(``PIDFD_SIGNAL_PROCESS_GROUP``, Linux 6.9+) or, on older kernels, with ``killpg`` while its
verified leader still pins the group id (the window that leaves is described in
:func:`stop_processes`). Exits are awaited with one ``poll`` over the pidfds per phase (no busy
loop). Children the caller owns (``Popen``, ``multiprocessing.Process``) are reaped with a bounded
wait.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import select
import signal
import subprocess
import time
from collections.abc import Iterable

from ..process import _pidfd, _procfs
from ..process._identity import ProcessIdentity, local_hostname, local_pid_namespace
from ..process._mm_read import MmReader
from . import _signal_ledger
from ._stop_report import StopOutcome, StoppedWorker, StopReport, UnkillableWorker
from ._stop_targets import AwaitedProc, PreparedTarget, StopTarget, prepare, prepare_groups
from ._survivor import STACK_READ_TIMEOUT_S, sample_survivor

__all__ = ["StopOutcome", "StopReport", "StoppedWorker", "UnkillableWorker", "stop_processes"]

logger = logging.getLogger(__name__)

# Budget for reaping owned children after the kill phase, all of them together. Reaping a zombie
# takes microseconds; the budget only matters when another thread holds Popen's waitpid lock.
_REAP_BUDGET_S = 0.2
_POLL_FLAGS = select.POLLIN | select.POLLHUP | select.POLLERR


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
    of SIGKILL is reported unkillable whatever its state (a task stuck in ``D``, one looping in the
    kernel in ``R`` with SIGKILL pending, one whose exit is stuck), with its kernel stack where
    readable and one ERROR log line each, and makes :attr:`StopReport.restartable` False; it is left
    as it is (an owned one unreaped). A SIGKILL pending during the kill grace is no verdict.

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

    Blocks for at most ``grace_s + kill_s`` plus procfs reads, reaping (bounded by 0.2 s in
    all) and, per survivor, kernel-stack reads (0.2 s each at most); every wait is a ``poll`` on
    pidfds with a deadline. Raises ``ValueError`` only for a
    negative or non-finite ``grace_s``/``kill_s``, an invalid ``term_signal`` or a ``targets``
    that is not iterable. A ``KeyboardInterrupt`` while waiting closes every pidfd and propagates.

    Thread-safe: it may run in several threads at once, also on the same processes (a given
    signal reaches a given process once across concurrent calls; each call keeps its own
    deadlines and report), and beside a :class:`~trtllm_liveness.monitor.WorkerProcessMonitor`, which
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

    prepared: list[PreparedTarget] = []
    keys: list[_signal_ledger.Key] = []
    poller = select.poll()
    waiting: dict[int, AwaitedProc] = {}
    try:
        for index, raw in enumerate(items):
            prepared.append(prepare(index, raw, hostname))
        if process_group:
            prepare_groups(prepared)
        for target in prepared:
            for proc in target.procs():
                keys.append(proc.key)
                _signal_ledger.acquire(proc.key)
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
            with MmReader(STACK_READ_TIMEOUT_S) as stacks:
                for proc in list(waiting.values()):
                    if _pidfd.is_exited(proc.pidfd):  # exited right at the deadline
                        _mark_exited(proc, time.monotonic())
                        continue
                    owner = owners[id(proc)]
                    proc.unkillable = _sample_unkillable(owner, proc, waited, stacks)
                    logger.error("liveness: %s", proc.unkillable.message)

        _reap_owned(prepared, time.monotonic() + _REAP_BUDGET_S)
    finally:
        for target in prepared:
            for proc in target.procs():
                with contextlib.suppress(OSError):
                    os.close(proc.pidfd)
        for key in keys:
            _signal_ledger.release(key)

    workers = tuple(_finish(target, t0) for target in prepared)
    unkillable = tuple(proc.unkillable for target in prepared for proc in target.procs() if proc.unkillable)
    return StopReport(workers, unkillable, float(grace_s), float(kill_s), term.name,
                      time.monotonic() - t0, started_wall)


# --------------------------------------------------------------------- signalling and waiting


def _signal_all(targets: list[PreparedTarget], sig: signal.Signals, waiting: dict[int, AwaitedProc]) -> None:
    for target in targets:
        live = [proc for proc in target.procs() if proc.pidfd in waiting]
        if not live:
            continue
        if target.pgid is not None and _signal_group(target, sig):
            continue
        for proc in live:
            if not _signal_ledger.claim(proc.key, sig):
                continue
            try:
                if _pidfd.send_signal(proc.pidfd, sig) and proc is target.leader:
                    target.signals.append(sig.name)
            except OSError as exc:
                logger.warning("liveness: pidfd_send_signal(pid %d, %s) failed: %s", proc.pid, sig.name, exc)


def _signal_group(target: PreparedTarget, sig: signal.Signals) -> bool:
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
    if not _signal_ledger.claim(leader.key, sig):
        return True  # another call in flight already sent it to this group
    for member in target.members:
        _signal_ledger.claim(member.key, sig)
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
                _signal_ledger.unclaim([proc.key for proc in target.procs()], sig)
                return False
    try:
        os.killpg(target.pgid, sig)
        target.signals.append(label)
    except ProcessLookupError:
        pass
    except OSError as exc:
        logger.warning("liveness: killpg(%d, %s) failed: %s", target.pgid, sig.name, exc)
    return True


def _group_pinned(target: PreparedTarget) -> bool:
    """Whether the group id still names the verified leader's group.

    A process-group id cannot be reused while its leader exists, even as an unreaped zombie.
    """
    leader = target.leader
    if leader is None:
        return False
    if not _pidfd.is_exited(leader.pidfd):
        return True
    info = _procfs.stat_or_none(leader.pid)
    return info is not None and info.start_time == leader.start_time and info.state == "Z"


def _wait_exits(poller: select.poll, waiting: dict[int, AwaitedProc], deadline: float) -> None:
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


def _mark_exited(proc: AwaitedProc, now: float) -> None:
    proc.exited_at = now
    proc.after_kill = _signal_ledger.was_sent(proc.key, signal.SIGKILL)


def _sample_unkillable(target: PreparedTarget, proc: AwaitedProc, waited: float, stacks: MmReader) -> UnkillableWorker:
    sample = sample_survivor(proc.pid, reader=stacks)  # never raises: it may be exiting right now
    is_leader = proc is target.leader
    identity = target.identity if is_leader else None
    if identity is None:
        identity = ProcessIdentity(target.rank, proc.pid, proc.start_time, target.hostname, local_pid_namespace())
    return UnkillableWorker(
        rank=target.rank, pid=proc.pid, hostname=target.hostname, state=sample.state, wchan=sample.wchan,
        d_tids=sample.d_tids, d_wchan=sample.d_wchan, kill_pending=sample.kill_pending, signal=signal.SIGKILL.name,
        waited_s=waited, identity=identity, leader_pid=None if is_leader else target.pid, basis=sample.basis,
        exiting=sample.exiting, threads=sample.threads,
    )


def _reap_owned(targets: list[PreparedTarget], deadline: float) -> None:
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


def _finish(target: PreparedTarget, t0: float) -> StoppedWorker:
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
    if target.returncode is not None:  # Popen's form (-N: killed by signal N) as a waitpid(2) status
        code = target.returncode
        details.append(_procfs.describe_wait_status(-code if code < 0 else code << 8))
    exited = None if leader.exited_at is None else leader.exited_at - t0
    return StoppedWorker(target.rank, target.pid, target.hostname, outcome, "; ".join(details),
                         target.returncode, exited, signals)
