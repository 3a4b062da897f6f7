"""What :func:`~._bounded_stop.stop_processes` returns: one record per target and the unkillable.

:class:`StopReport` holds a :class:`StoppedWorker` per target (its :class:`StopOutcome`) and an
:class:`UnkillableWorker` per process that survived SIGKILL, as sampled right after the deadline.
All are frozen and have a JSON-ready ``to_dict`` that ``from_dict`` reads back (strictly);
:meth:`StopReport.events` turns the unkillable into non-restartable events for
:class:`~trtllm_liveness.WorkerFailedError`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .._events import EventKind, WorkerEvent
from .._record_fields import JsonRecord
from ..process._identity import ProcessIdentity
from ._survivor import StuckThread, UnkillableBasis

__all__ = ["StopOutcome", "StopReport", "StoppedWorker", "UnkillableWorker"]


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
class UnkillableWorker(JsonRecord):
    """A process that survived SIGKILL past the kill deadline, as sampled right after it.

    Unkillable whatever its state (:mod:`._survivor`): ``basis`` says why (SIGKILL still pending,
    its exit stuck, or just still there). ``state`` is the main thread's one-letter state, ``wchan``
    its wait channel; ``d_tids`` the threads found in ``D`` and ``d_wchan`` the wait channel of the
    first of them (a driver or NCCL thread may be stuck while the main thread sleeps in ``S``).
    ``threads`` are the main thread and the threads in ``D`` or ``R`` with their kernel stacks
    where readable (root). ``leader_pid`` is set when this is a member of a worker's process group
    rather than the worker itself. The JSON form has no ``identity`` (None when read back);
    ``message`` and ``kernel_stack`` in it must be what the other fields give.
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
    basis: UnkillableBasis = UnkillableBasis.SIGKILL_PENDING
    exiting: bool = False
    threads: tuple[StuckThread, ...] = ()

    json_form = ("rank", "pid", "hostname", "state", "wchan", "d_tids", "d_wchan", "kill_pending", "signal",
                 "waited_s", "leader_pid", "message", "basis", "exiting", "kernel_stack", "threads")
    json_optional = ("basis", "exiting", "threads")

    @property
    def kernel_stack(self) -> tuple[str, ...]:
        """The kernel stack of the first thread in ``D``, else of the main thread (empty where
        unreadable)."""
        first = next((thread for thread in self.threads if thread.tid in self.d_tids), None)
        main = next((thread for thread in self.threads if thread.tid == self.pid), None)
        chosen = first or main
        return chosen.kernel_stack if chosen is not None else ()

    def _where(self) -> str:
        if self.basis is UnkillableBasis.EXITING:
            return ("its exit is stuck in the kernel (it took SIGKILL but did not go: a driver's release of its "
                    "device files)")
        if self.state == "R" and not self.d_tids:
            return ("it is running in the kernel and never returns to user space, where SIGKILL would act "
                    "(a driver spin loop)")
        if self.state in ("D", "") or self.d_tids:
            return "it is probably in uninterruptible sleep in the kernel (GPU driver, NCCL, RDMA)"
        return f"it is stuck in the kernel in state {self.state}"

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
            f"{'yes' if self.kill_pending else 'no'}); {self._where()}. Giving up on it: the host may need "
            f"recycling before its GPUs/NICs are reused"
        )


@dataclass(frozen=True)
class StoppedWorker(JsonRecord):
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


@dataclass(frozen=True)
class StopReport(JsonRecord):
    """What :func:`stop_processes` did: one :class:`StoppedWorker` per target, in input order.

    ``restartable`` is False when anything was unkillable: a task stuck in ``D`` still holds its
    GPU/NIC, so a new worker group on this host would conflict with it (torchrun's policy for
    ``uninterruptible_state_timeout``). Callers should then stop instead of restarting here. The
    JSON form's ``restartable`` and ``all_stopped`` must be what the rest gives.
    """

    workers: tuple[StoppedWorker, ...]
    unkillable: tuple[UnkillableWorker, ...]
    grace_s: float
    kill_s: float
    term_signal: str
    elapsed_s: float
    started_wall: float

    json_form = ("restartable", "all_stopped", "grace_s", "kill_s", "term_signal", "elapsed_s", "started_wall",
                 "workers", "unkillable")

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

    def outcome_of(self, pid: int | None) -> StopOutcome | None:
        """The outcome of the worker with ``pid``; None if it is not in the report."""
        return next((worker.outcome for worker in self.workers if worker.pid == pid), None)
