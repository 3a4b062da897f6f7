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
from typing import Any

from .._events import EventKind, WorkerEvent
from .._record_fields import JsonFields
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
class UnkillableWorker:
    """A process that survived SIGKILL past the kill deadline, as sampled right after it.

    Unkillable whatever its state (:mod:`._survivor`): ``basis`` says why (SIGKILL still pending,
    its exit stuck, or just still there). ``state`` is the main thread's one-letter state, ``wchan``
    its wait channel; ``d_tids`` the threads found in ``D`` and ``d_wchan`` the wait channel of the
    first of them (a driver or NCCL thread may be stuck while the main thread sleeps in ``S``).
    ``threads`` are the main thread and the threads in ``D`` or ``R`` with their kernel stacks
    where readable (root). ``leader_pid`` is set when this is a member of a worker's process group
    rather than the worker itself.
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

    @classmethod
    def from_dict(cls, data: object) -> UnkillableWorker:
        """The record :meth:`to_dict` wrote. That form has no ``identity`` (None here); ``message``,
        where present, must be what the other fields give. ``ValueError`` naming the field otherwise."""
        fields = JsonFields("UnkillableWorker", data, required=(
            "rank", "pid", "hostname", "state", "wchan", "d_tids", "d_wchan", "kill_pending", "signal", "waited_s",
            "leader_pid"), optional=("message",))
        worker = cls(rank=fields.integer("rank"), pid=fields.integer("pid"), hostname=fields.text("hostname"),
                     state=fields.text("state"), wchan=fields.text("wchan"), d_tids=fields.integers("d_tids"),
                     d_wchan=fields.text("d_wchan"), kill_pending=fields.flag("kill_pending"),
                     signal=fields.text("signal"), waited_s=fields.number("waited_s"),
                     leader_pid=fields.integer_or_none("leader_pid"))
        fields.agrees("message", worker.message)
        return worker

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (:meth:`from_dict` reads it back)."""
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
            "basis": self.basis.value,
            "exiting": self.exiting,
            "kernel_stack": list(self.kernel_stack),
            "threads": [thread.to_dict() for thread in self.threads],
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

    @classmethod
    def from_dict(cls, data: object) -> StoppedWorker:
        """The record :meth:`to_dict` wrote; ``ValueError`` naming the field for anything else."""
        fields = JsonFields("StoppedWorker", data, required=(
            "rank", "pid", "hostname", "outcome", "detail", "returncode", "exited_after_s", "signals_sent"))
        return cls(rank=fields.integer("rank"), pid=fields.integer_or_none("pid"), hostname=fields.text("hostname"),
                   outcome=fields.choice("outcome", StopOutcome), detail=fields.text("detail"),
                   returncode=fields.integer_or_none("returncode"),
                   exited_after_s=fields.number_or_none("exited_after_s"), signals_sent=fields.texts("signals_sent"))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (:meth:`from_dict` reads it back)."""
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

    def outcome_of(self, pid: int | None) -> StopOutcome | None:
        """The outcome of the worker with ``pid``; None if it is not in the report."""
        return next((worker.outcome for worker in self.workers if worker.pid == pid), None)

    @classmethod
    def from_dict(cls, data: object) -> StopReport:
        """The report :meth:`to_dict` wrote (its workers and unkillable through their own
        ``from_dict``); ``restartable`` and ``all_stopped``, where present, must be what the rest
        gives. ``ValueError`` naming the field (or the worker) for anything else."""
        fields = JsonFields("StopReport", data, required=(
            "grace_s", "kill_s", "term_signal", "elapsed_s", "started_wall", "workers", "unkillable"),
            optional=("restartable", "all_stopped"))
        report = cls(workers=tuple(StoppedWorker.from_dict(item) for item in fields.objects("workers")),
                     unkillable=tuple(UnkillableWorker.from_dict(item) for item in fields.objects("unkillable")),
                     grace_s=fields.number("grace_s"), kill_s=fields.number("kill_s"),
                     term_signal=fields.text("term_signal"), elapsed_s=fields.number("elapsed_s"),
                     started_wall=fields.number("started_wall"))
        fields.agrees("restartable", report.restartable)
        fields.agrees("all_stopped", report.all_stopped)
        return report

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (:meth:`from_dict` reads it back)."""
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
