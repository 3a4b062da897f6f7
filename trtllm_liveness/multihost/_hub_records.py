"""What the agent hub keeps and accepts: its result types, each agent's session and the checks of
every message an agent sends (:mod:`._hub` owns the thread, the socket and the view; the commands it
sends every agent are :mod:`._wire`'s).

Every parser takes an authenticated :class:`~._wire.Message` and returns a typed record or raises
:class:`~._wire.WireError` naming what is wrong: the hub logs it (rate-limited) and goes on.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .._config import TextEnum
from .._events import WorkerState
from ..process._identity import ProcessIdentity, is_local, parse_identities
from ..stop._stop_report import StopReport
from . import _wire
from ._tcp import Key

MAX_RANKS_PER_HOST = 4096
_EVENT_STATES = {"died": WorkerState.EXITED, "wedged": WorkerState.WEDGED, "unkillable": WorkerState.UNKILLABLE}
# A "state" message carries only non-fatal states: fatal ones come as events (with their thread and
# wait channel, exactly once), and a state message must not claim an event without them.
_REPORTED_STATES = {state.value: state for state in (WorkerState.ALIVE, WorkerState.EXITED_EXPECTED)}
Update = tuple[ProcessIdentity, WorkerState, str]  # one rank's new state, and its detail


class HostOutcome(TextEnum):
    """What became of one remote host at a stop (:attr:`HostStop.outcome`)."""

    STOPPED = "stopped"
    LOST = "lost"
    NO_ANSWER = "no-answer"


class Connection(TextEnum):
    """A remote host's connection as the hub sees it (:attr:`HostView.connection`)."""

    CONNECTED = "connected"
    SUSPECT = "suspect"  # connected, but its agent is silent
    CLOSED = "closed"
    LOST = "lost"
    STOPPED = "stopped"


@dataclass(frozen=True)
class HostStop:
    """What became of one remote host at :meth:`~._hub.AgentHub.stop_hosts`.

    ``outcome``: ``stopped`` (its agent stopped the host's other ranks and reported; it then ended
    its own rank), ``lost`` (already lost or silent: nothing could be asked), ``no-answer`` (no
    report within the bound). ``unkillable`` lists ``(rank, pid, description)`` of ranks that
    survived SIGKILL on that host; ``stopped`` the ``(rank, pid, outcome)`` of the others.
    """

    host: str
    agent_rank: int
    ranks: tuple[int, ...]
    outcome: HostOutcome
    stopped: tuple[tuple[int, int, str], ...] = ()
    unkillable: tuple[tuple[int, int, str], ...] = ()
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"host": self.host, "agent_rank": self.agent_rank, "ranks": list(self.ranks),
                "outcome": self.outcome.value, "stopped": [list(item) for item in self.stopped],
                "unkillable": [list(item) for item in self.unkillable], "detail": self.detail}


@dataclass(frozen=True)
class HostView:
    """One remote host as the hub sees it: its agent's rank, its ranks, its connection's state
    (:class:`Connection`) and since when (monotonic)."""

    host: str
    agent_rank: int
    ranks: tuple[ProcessIdentity, ...]
    connection: Connection
    since: float


@dataclass
class Session:
    """One agent's session, from its hello on; guarded by the hub's lock."""

    sid: str
    host: str
    agent: ProcessIdentity
    ranks: tuple[ProcessIdentity, ...]
    key: Key | None
    seq_in: int  # the last sequence number taken from the agent
    seq_out: int = 0
    connection: Connection = Connection.CONNECTED
    since: float = field(default_factory=time.monotonic)
    stop: HostStop | None = None
    suspect_since: float | None = None  # monotonic: since when its agent is silent (connected, suspect)
    suspect_warned: bool = False  # this silence's WARNING was logged

    def shown_connection(self) -> tuple[Connection, float]:
        """The connection's state as :class:`HostView` shows it (``suspect`` while connected but
        silent), and since when (monotonic)."""
        if self.connection is Connection.CONNECTED and self.suspect_since is not None:
            return Connection.SUSPECT, self.suspect_since
        return self.connection, self.since

    def updates(self, state: WorkerState, detail: str = "") -> list[Update]:
        """``state`` for every rank of this host, with ``detail`` (default: watched by its agent)."""
        detail = detail or f"watched by the agent on host {self.host} (rank {self.agent.rank})"
        return [(identity, state, detail) for identity in self.ranks]

    def host_stop(self, outcome: HostOutcome, detail: str) -> HostStop:
        """What became of this host at a stop, where its agent did not report it."""
        return HostStop(self.host, self.agent.rank, tuple(r.rank for r in self.ranks), outcome, detail=detail)


class Hello(NamedTuple):
    """A hello's content: the agent's host, its own identity, its host's ranks (its own among
    them), the local port of its connection (0: unknown) and why the hub must refuse it (empty: it
    may take it)."""

    host: str
    agent: ProcessIdentity | None
    ranks: tuple[ProcessIdentity, ...]
    port: int
    refusal: str


def parse_hello(message: _wire.Message, sessions: Iterable[Session]) -> Hello:
    """A ``hello``, checked against the hub's ``sessions``. Raises :class:`~._wire.WireError`."""
    host = _wire.field(message, "host", str, max_len=253)
    agent_rank = _wire.field(message, "rank", int, low=0, high=1 << 24)
    port = _wire.field(message, "port", int, low=0, high=65535)
    raw = _wire.field(message, "ranks", list)
    if len(raw) > MAX_RANKS_PER_HOST:
        raise _wire.WireError(f"hello: {len(raw)} ranks, more than {MAX_RANKS_PER_HOST}")
    try:
        ranks = tuple(parse_identities(raw, max_count=MAX_RANKS_PER_HOST, own_pid=0))
    except ValueError as exc:
        raise _wire.WireError(f"hello: {exc}") from None
    agent = next((identity for identity in ranks if identity.rank == agent_rank), None)
    taken = {r.rank for s in sessions if s.connection is Connection.CONNECTED for r in s.ranks}
    claimed = taken & {identity.rank for identity in ranks}
    if agent is None:
        why = f"the agent's rank {agent_rank} is not among its host's ranks"
    elif any(identity.hostname != host for identity in ranks):
        why = f"a rank of another host than {host!r}"
    elif any(is_local(identity) for identity in ranks):
        why = "ranks of the proxy's own host (watched here, not by an agent)"
    else:
        why = f"ranks {sorted(claimed)} are already another agent's" if claimed else ""
    return Hello(host, agent, ranks, port, why)


def parse_update(session: Session, message: _wire.Message) -> tuple[Update, dict[str, Any]]:
    """What an ``event`` (a rank died, wedged or is unkillable; with its thread, wait channel and age)
    or a ``state`` (any other change) says of one rank of ``session``'s host: its update, and the
    event's ``tid``, ``wchan`` and ``fault_at`` for the monitor (none for a state). Raises
    :class:`~._wire.WireError`."""
    rank = _wire.field(message, "rank", int, low=0, high=1 << 24)
    identity = next((identity for identity in session.ranks if identity.rank == rank), None)
    if identity is None:
        raise _wire.WireError(f"{message.kind}: rank {rank} is not one of host {session.host}'s")
    if message.kind == "state":
        state = _REPORTED_STATES.get(_wire.field(message, "state", str, max_len=32))
        if state is None:
            raise _wire.WireError(f"state: unknown state {message.body.get('state')!r}")
        detail = _wire.field(message, "detail", str, max_len=4000)
        return (identity, state, f"{detail} (reported by the agent on host {session.host})"), {}
    kind = _wire.field(message, "what", str, max_len=16)
    event_state = _EVENT_STATES.get(kind)
    if event_state is None:
        raise _wire.WireError(f"event: unknown kind {kind!r}")
    cause = _wire.field(message, "cause", str, max_len=4000)
    age = _wire.field(message, "age", float, low=0, high=1e7)
    tid = message.body.get("tid")
    wchan = message.body.get("wchan")
    return (identity, event_state, f"{cause} (reported by the agent on host {session.host})"), {
        "tid": tid if isinstance(tid, int) and not isinstance(tid, bool) and 0 < tid < 1 << 22 else None,
        "wchan": wchan[:200] if isinstance(wchan, str) else "", "fault_at": time.monotonic() - age}


def parse_report(session: Session, message: _wire.Message) -> HostStop:
    """A ``report``: the agent's :class:`~trtllm_liveness.stop._stop_report.StopReport` of its host's
    other ranks, read back strictly. Raises :class:`~._wire.WireError`."""
    try:
        report = StopReport.from_dict(message.body.get("stop"))
    except ValueError as exc:
        raise _wire.WireError(f"report: {exc}") from None
    return HostStop(session.host, session.agent.rank, tuple(r.rank for r in session.ranks), HostOutcome.STOPPED,
                    stopped=tuple((w.rank, w.pid or 0, w.outcome.value) for w in report.workers),
                    unkillable=tuple((u.rank, u.pid, u.message[:2000]) for u in report.unkillable))
