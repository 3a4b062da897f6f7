"""The health model: per-rank states, the events the monitor delivers, and the fatal error.

A death, a wedge and an unkillable worker are all *fatal* to the engine: one rank gone means the
collective the others are in will never finish. Wedged and unkillable are also *not restartable*
on this host: the stuck task still holds the GPU or NIC, so a new worker group there would
conflict with it (the policy of torchrun's ``uninterruptible_state_timeout``).
"""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field
from typing import Any

from ._config import TextEnum
from .process._identity import ProcessIdentity


class WorkerState(str, enum.Enum):
    """What the monitor knows about one rank."""

    ALIVE = "alive"
    EXITED = "exited"
    ZOMBIE = "zombie"
    EXITED_EXPECTED = "exited-expected"  # exited after a shutdown began: not a failure
    WEDGED = "wedged"
    UNKILLABLE = "unkillable"
    STALLED = "stalled"  # alive, not in D, but the engine makes no progress (see monitor/_stall_timer.py)
    LOST = "lost"  # on another host whose agent fell silent or dropped its connection (multihost/_hub.py)
    SUSPECT = "suspect"  # on another host whose agent is silent while the engine still progresses (not fatal)
    UNMONITORED_REMOTE = "unmonitored-remote"
    UNMONITORED_OTHER_NAMESPACE = "unmonitored-other-namespace"

    @property
    def is_dead(self) -> bool:
        """The process is gone or finished (exited, zombie, PID reused)."""
        return self in (WorkerState.EXITED, WorkerState.ZOMBIE, WorkerState.EXITED_EXPECTED)

    @property
    def is_fatal(self) -> bool:
        """The engine cannot go on with a rank in this state (one that raises an event)."""
        return self in EVENT_OF_STATE


class MonitorMethod(TextEnum):
    """How the monitor watches one rank (:attr:`RankStatus.method`).

    A ``str`` enum whose ``str()`` and ``format()`` are the value, so JSON, logs and metrics labels
    read ``"pidfd"``, never ``"MonitorMethod.PIDFD"``.
    """

    PIDFD = "pidfd"  # a pidfd opened after verifying the start time; the watcher sleeps on it
    PROCFS = "procfs"  # pidfd unavailable: /proc/<pid>/stat polled instead
    NONE = "none"  # not watched here: another host or PID namespace, or unreadable
    AGENT = "agent"  # another host's, watched by that host's agent (multihost/_agent.py)

    @property
    def signals(self) -> bool:
        """Whether a rank watched this way is observed on this host, so may be a signal target
        (once its start time was verified); ``none`` and ``agent`` ranks never are."""
        return self in (MonitorMethod.PIDFD, MonitorMethod.PROCFS)


class EventKind(str, enum.Enum):
    """Why the monitor raised an event."""

    DIED = "died"
    WEDGED = "wedged"
    UNKILLABLE = "unkillable"
    STALLED = "stalled"  # only with stall_action=fatal: the engine made no progress for the timeout
    LOST = "lost"  # a remote host's agent went silent (partition, lost host) or its connection closed

    @property
    def restartable(self) -> bool:
        """Whether a new worker group may be started on the same host after this event.

        A stalled engine's processes are alive and killable (not in ``D``), so a bounded stop ends
        them and the host is reusable; one that turns out unkillable is reported on its own. A lost
        host is another host: nothing is known to be stuck on this one, and the job may be
        restarted (elsewhere, or there once the operator has looked at it)."""
        return self in (EventKind.DIED, EventKind.STALLED, EventKind.LOST)


EVENT_OF_STATE = {
    WorkerState.EXITED: EventKind.DIED,
    WorkerState.ZOMBIE: EventKind.DIED,
    WorkerState.WEDGED: EventKind.WEDGED,
    WorkerState.UNKILLABLE: EventKind.UNKILLABLE,
    WorkerState.LOST: EventKind.LOST,
}
"""The event each fatal state raises (:attr:`WorkerState.is_fatal`: the states it names)."""


@dataclass(frozen=True)
class WorkerEvent:
    """One fatal observation about a rank, delivered to monitor subscribers.

    ``detected_at`` is ``time.monotonic()`` at detection; ``wall_time`` is ``time.time()``.
    ``fault_at`` (monotonic) is when the fault began as far as the monitor saw it: for a wedged or
    unkillable rank the first sample that found the thread in ``D``; ``None`` for a death (the
    kernel keeps no exit time; a pidfd becomes readable at the exit, so detection is the fault); for a
    lost host the last moment its agent was known to be connected and answering.
    """

    kind: EventKind
    identity: ProcessIdentity
    cause: str
    detected_at: float = field(default_factory=time.monotonic)
    wall_time: float = field(default_factory=time.time)
    tid: int | None = None
    wchan: str = ""
    fault_at: float | None = None

    @property
    def restartable(self) -> bool:
        """False for wedged and unkillable workers: recycle the host before reusing it."""
        return self.kind.restartable

    @property
    def message(self) -> str:
        """One line naming rank, pid, host and cause."""
        return self.describe()

    def describe(self, who: str | None = None) -> str:
        """:attr:`message` with ``who`` instead of "MPI worker rank R (pid P) on host H" (for
        processes that are no MPI ranks, e.g. the CLI's ``watch`` of arbitrary pids)."""
        if who is None:
            who = f"MPI worker {self.identity.describe()}"
        if self.kind is EventKind.DIED:
            text = f"{who} exited unexpectedly: {self.cause}"
        elif self.kind is EventKind.WEDGED:
            text = f"{who} is wedged in uninterruptible sleep (D): {self.cause}"
        elif self.kind is EventKind.STALLED:
            text = f"engine stalled (named: {who}): {self.cause}"
        elif self.kind is EventKind.LOST:
            text = f"{who} is lost: {self.cause}"
        else:
            text = f"{who} is unkillable (SIGKILL pending in D state): {self.cause}"
        if not self.restartable:
            text += "; the host may need recycling before its GPUs/NICs are reused"
        return text

    @classmethod
    def from_dict(cls, data: object) -> WorkerEvent:
        """The event :meth:`to_dict` wrote (e.g. read back from another process's JSON).

        That form carries no monotonic times and no start time or PID namespace: ``detected_at`` is
        NaN (unknown), ``fault_at`` None, and the identity's ``start_time`` and ``pid_namespace`` are
        None, so the rebuilt identity is never signalled. ``restartable`` and ``message``, where
        present, must be what the other fields give. ``ValueError`` naming the field for anything
        else: a missing or unknown field, a wrong type, an unknown kind, an invalid rank or pid.
        """
        from ._errors import InvalidIdentityError
        from ._record_fields import JsonFields
        from .process._identity import coerce_identity

        fields = JsonFields("WorkerEvent", data, required=("kind", "rank", "pid", "hostname", "cause", "tid", "wchan",
                                                           "wall_time"), optional=("restartable", "message"))
        try:
            identity = coerce_identity((fields.integer("rank"), fields.integer("pid"), None, fields.text("hostname"),
                                        None))
        except InvalidIdentityError as exc:
            raise ValueError(f"WorkerEvent: {exc}") from None
        event = cls(fields.choice("kind", EventKind), identity, fields.text("cause"), detected_at=math.nan,
                    wall_time=fields.number("wall_time"), tid=fields.integer_or_none("tid"), wchan=fields.text("wchan"))
        fields.agrees("restartable", event.restartable)
        fields.agrees("message", event.message)
        return event

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (:meth:`from_dict` reads it back)."""
        return {
            "kind": self.kind.value,
            "rank": self.identity.rank,
            "pid": self.identity.pid,
            "hostname": self.identity.hostname,
            "cause": self.cause,
            "restartable": self.restartable,
            "tid": self.tid,
            "wchan": self.wchan,
            "wall_time": self.wall_time,
            "message": self.message,
        }


@dataclass(frozen=True)
class RankStatus:
    """A snapshot of one rank: its state, since when (monotonic and wall), and how it is watched.

    ``method`` (:class:`MonitorMethod`) is ``pidfd``, ``procfs`` (pidfd unavailable: polled
    instead), ``none`` (remote or other namespace) or ``agent`` (another host's agent watches it); a
    plain string naming one is taken as that method.
    """

    identity: ProcessIdentity
    state: WorkerState
    since: float
    since_wall: float
    method: MonitorMethod
    detail: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.method, MonitorMethod):
            object.__setattr__(self, "method", MonitorMethod(self.method))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "rank": self.identity.rank,
            "pid": self.identity.pid,
            "hostname": self.identity.hostname,
            "state": self.state.value,
            "since": self.since_wall,
            "method": self.method.value,
            "detail": self.detail,
        }


class WorkerFailedError(RuntimeError):
    """The engine's fatal error after a worker died, wedged or became unkillable.

    Carries the :class:`WorkerEvent` as ``event``; ``restartable`` is False when the host must be
    recycled. Pickles by message and event.
    """

    def __init__(self, event: WorkerEvent) -> None:
        super().__init__(event.message)
        self.event = event

    @property
    def restartable(self) -> bool:
        """Whether a restart on the same host is safe."""
        return self.event.restartable

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.event,))
