"""Every host's snapshot and iterations on the wire, and the hub's book of them.

The hub asks every connected agent for a snapshot of its host's ranks (``snapreq``: a request id,
the CPU window, whether to take stacks and their bound); each agent answers with one ``snap``
message of its ranks' diagnosis records in their own JSON form
(:meth:`~trtllm_liveness.diagnose._diagnosis_record.RankDiagnosis.to_dict`, with the rank's
iterations and whether its stacks were cut; :func:`encode_ranks`, taken with the proxy's own
:func:`~trtllm_liveness.diagnose._diagnosis.diagnose`), and sends one unasked (request id 0)
right after the event of its own fatal verdict. Agents also send ``iters``: their ranks' executor
iterations, at most one message per :data:`ITERATIONS_INTERVAL_S` while progress flows, none while
idle. Every field is checked (:func:`parse_snapshot`: every string, list and number of a reply in
bounds, then each record read back strictly; :func:`parse_iterations`; a bad one raises
:class:`~._wire.WireError`); a reply is kept under the wire's cap by cutting stacks, which its
records say. :class:`SnapshotBook` (guarded by the hub's lock) matches replies to requests and
answers :meth:`~._hub.AgentHub.snapshot` with one
:class:`~trtllm_liveness.diagnose._diagnosis_record.HostSnapshot` per host.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from ..diagnose._diagnosis_record import Activity, HostSnapshot, RankDiagnosis
from . import _wire
from ._hub_records import Connection, Session

ITERATIONS_INTERVAL_S = 1.0
"""The shortest interval between two ``iters`` messages of one agent (the hub's
``iterations_interval_s`` may be longer: a stall timer of minutes needs no finer progress)."""
MAX_THREADS = 256  # per rank in a reply
MAX_FRAMES = 64  # per thread in a reply
_TEXT = 300  # the longest string in a reply
_ITEMS = MAX_THREADS  # the longest list in a reply
_ENVELOPE_BYTES = 1024  # the reply's own fields, beside its ranks

_MAX_EXPIRY_S = 3600.0  # a snapshot request's caller waits at most this long on the wire
IterationSink = Callable[[int, int, float], None]
"""``(rank, iteration count, monotonic time of its last iteration on the hub's clock)``."""


@dataclass(frozen=True)
class SnapshotRequest:
    """Snapshot your host's ranks now: ``cpu_window_s`` of CPU time, ``stacks`` within
    ``stacks_timeout_s``. ``req`` numbers the request (set by :meth:`SnapshotBook.open_locked`); its
    callers wait until ``deadline``, monotonic on the clock of the side that holds the request
    (None: no bound, an agent's own verdict snapshot), sent as the seconds left (``exp``)."""

    req: int
    cpu_window_s: float
    stacks: bool
    stacks_timeout_s: float
    deadline: float | None = None
    kind: ClassVar[str] = "snapreq"

    def fields(self) -> dict[str, Any]:
        """The message's fields on the wire."""
        left = math.inf if self.deadline is None else self.deadline - time.monotonic()
        return {"req": self.req, "cpu": self.cpu_window_s, "stacks": self.stacks, "st": self.stacks_timeout_s,
                "exp": round(min(_MAX_EXPIRY_S, max(0.0, left)), 3)}


# ----------------------------------------------------------------------------- agent side: encode


def _clipped(value: Any, key: str = "") -> Any:
    """``value`` (a record's JSON form) with every string cut to the wire's bound; a frame's file
    keeps its end (its base name is what a stack line shows)."""
    if isinstance(value, str):
        return value[-_TEXT:] if key == "file" else value[:_TEXT]
    if isinstance(value, dict):
        return {name: _clipped(item, name) for name, item in value.items()}
    if isinstance(value, list):
        return [_clipped(item) for item in value]
    return value


def _rank_record(rank: RankDiagnosis, iterations: int | None, frames: int, threads: int,
                 states: int) -> dict[str, Any]:
    stacks = rank.stacks
    cut = len(rank.threads) > states or (stacks is not None and (
        len(stacks.threads) > threads or any(len(t.frames) > frames for t in stacks.threads[:threads])))
    # The threads that tell most first (the main thread, then those in D, stopped, spinning).
    telling = sorted(rank.threads, key=lambda t: (t.tid != rank.pid, _TELLING.get(t.activity, 9), t.tid))
    if stacks is not None:
        stacks = dataclasses.replace(stacks, threads=tuple(dataclasses.replace(t, frames=t.frames[:frames])
                                                           for t in stacks.threads[:threads]))
    sent = dataclasses.replace(rank, threads=tuple(telling[:states]), stacks=stacks)
    return {**_clipped(sent.to_dict()), "it": iterations, "cut": cut}


_TELLING = {Activity.IN_D: 0, Activity.STOPPED: 1, Activity.SPINNING: 2, Activity.RUNNING: 3}
_KEPT_STATES = 16  # thread states per rank kept before its stacks are cut further


def encode_ranks(ranks: Sequence[RankDiagnosis], iterations: dict[int, int]) -> list[dict[str, Any]]:
    """The ranks' records for one ``snap`` message within the wire's cap: each rank is cut (fewer
    frames per thread, then fewer thread states down to the :data:`_KEPT_STATES` that tell most,
    then fewer stacks) until the whole fits; a rank that was cut says so (``cut``). Pure function."""
    budget = _wire.MAX_MESSAGE_BYTES - _ENVELOPE_BYTES
    frames, threads, states = MAX_FRAMES, MAX_THREADS, MAX_THREADS
    while True:
        records = [_rank_record(rank, iterations.get(rank.rank), frames, threads, states) for rank in ranks]
        if len(json.dumps(records, separators=(",", ":"))) <= budget or states == 0:
            return records
        if frames > 4:
            frames //= 2
        elif states > _KEPT_STATES:
            states //= 2  # the telling ones stay: the main thread, those in D, stopped, spinning
        elif threads > 1:
            threads //= 2
        elif frames or threads:
            frames = threads = 0
        else:
            states //= 2  # thread states too: the telling ones stay


# ----------------------------------------------------------------------------- hub side: parse


def _check_bounds(value: Any, where: str) -> None:
    """Every string of ``value`` at most ``_TEXT`` long, every list at most ``_ITEMS``, every number
    finite and not negative (no field of a reply is). Raises :class:`~._wire.WireError` naming where."""
    if isinstance(value, str) and len(value) > _TEXT:
        raise _wire.WireError(f"{where} is longer than {_TEXT}")
    if isinstance(value, (int, float)) and not isinstance(value, bool) and not 0 <= value < math.inf:
        raise _wire.WireError(f"{where} is {str(value)[:40]}, not a finite number >= 0")
    if isinstance(value, list):
        if len(value) > _ITEMS:
            raise _wire.WireError(f"{where} has more than {_ITEMS} items")
        for index, item in enumerate(value):
            _check_bounds(item, f"{where}[{index}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_bounds(item, f"{where}.{key}")


def _items(message: _wire.Message, name: str, most: int) -> list[Any]:
    """Field ``name`` of ``message``: a list of at most ``most`` items, all in the wire's bounds
    (:func:`_check_bounds`). Raises :class:`~._wire.WireError`."""
    items: list[Any] = _wire.field(message, name, list)
    if len(items) > most:
        raise _wire.WireError(f"{message.kind}: {len(items)} items in {name!r}, at most {most} wanted")
    _check_bounds(items, f"{message.kind}: {name}")
    return items


def parse_snapshot(session: Session, message: _wire.Message) -> tuple[int, HostSnapshot]:
    """``(request id, the host's snapshot)`` from a ``snap`` message. Raises :class:`~._wire.WireError`."""
    req = _wire.field(message, "req", int, low=0, high=1 << 62)
    elapsed = _wire.field(message, "el", float, low=0, high=1e7)
    own = {identity.rank: identity for identity in session.ranks}
    ranks, iterations, truncated = [], [], []
    for item in _items(message, "ranks", len(own)):
        if not isinstance(item, dict):
            raise _wire.WireError("snap: a rank record is not an object")
        fields = dict(item)
        it, cut = fields.pop("it", None), fields.pop("cut", None)  # beside the rank's record: see _rank_record
        try:
            rank = RankDiagnosis.from_dict(fields)
        except ValueError as exc:
            raise _wire.WireError(f"snap: {exc}") from None
        identity = own.get(rank.rank)
        if identity is None:
            raise _wire.WireError(f"snap: rank {rank.rank} is not one of host {session.host}'s")
        if rank.pid != identity.pid:
            raise _wire.WireError(f"snap: rank {rank.rank}'s pid differs from its hello's")
        if not isinstance(cut, bool):
            raise _wire.WireError("snap: bad cut flag")
        if it is not None and (not isinstance(it, int) or isinstance(it, bool)):
            raise _wire.WireError(f"snap: bad iterations {str(it)[:40]!r}")
        stacks = rank.stacks
        if cut and stacks is not None:
            detail = (stacks.detail + "; " if stacks.detail else "") + "stacks or thread list cut to fit the hub's " \
                "message size"
            stacks = dataclasses.replace(stacks, detail=detail)
        ranks.append(dataclasses.replace(rank, stacks=stacks, host=session.host))
        if it is not None:
            iterations.append((rank.rank, it))
        if cut:
            truncated.append(rank.rank)
    if len({rank.rank for rank in ranks}) != len(ranks):
        raise _wire.WireError("snap: a rank twice")
    return req, HostSnapshot(session.host, session.agent.rank, "answered" if req else "verdict",
                             tuple(sorted(ranks, key=lambda r: r.rank)), tuple(iterations), tuple(truncated), elapsed)


def parse_snapshot_request(message: _wire.Message) -> SnapshotRequest:
    """A ``snapreq`` as the agent takes it now (its deadline on the agent's clock). Raises
    :class:`~._wire.WireError`."""
    stacks = message.body.get("stacks")
    if not isinstance(stacks, bool):
        raise _wire.WireError("snapreq: bad stacks flag")
    return SnapshotRequest(_wire.field(message, "req", int, low=1, high=1 << 62),
                           _wire.field(message, "cpu", float, low=0, high=1.0), stacks,
                           _wire.field(message, "st", float, low=0, high=5.0),
                           time.monotonic() + _wire.field(message, "exp", float, low=0, high=_MAX_EXPIRY_S)
                           if "exp" in message.body else None)


def parse_iterations(session: Session, message: _wire.Message) -> list[tuple[int, int, float]]:
    """``(rank, count, seconds since its last iteration)`` of an ``iters`` message. Raises
    :class:`~._wire.WireError`."""
    own = {identity.rank for identity in session.ranks}
    found: dict[int, tuple[int, int, float]] = {}
    for item in _items(message, "it", len(own)):
        if not isinstance(item, list) or len(item) != 3 or any(isinstance(value, bool) for value in item) \
                or not isinstance(item[0], int) or not isinstance(item[1], int) or item[1] > 1 << 62 \
                or not isinstance(item[2], (int, float)) or item[2] > 1e6:
            raise _wire.WireError(f"iters: bad entry {str(item)[:40]!r} ([rank, count, seconds] wanted)")
        rank, count, age = item
        if rank not in own or rank in found:
            raise _wire.WireError(f"iters: rank {rank} is not one of host {session.host}'s, or twice")
        found[rank] = (rank, count, float(age))
    return list(found.values())


# ----------------------------------------------------------------------------- the hub's book


class SnapshotBook:
    """The hub's pending snapshot requests and the replies; every method runs under the hub's
    condition ``cond`` (``*_locked``) except :meth:`wait`, which takes it."""

    def __init__(self, cond: threading.Condition) -> None:
        self._cond = cond
        self._next = 0
        self._replies: dict[int, dict[str, HostSnapshot]] = {}  # request id -> sid -> reply
        self._asked: dict[int, frozenset[str]] = {}  # request id -> the sessions it was sent to
        self._verdicts: dict[str, HostSnapshot] = {}  # sid -> the snapshot at its agent's own verdict
        self.iteration_sink: IterationSink | None = None
        self.iteration_messages = 0
        # taken under the hub's lock, given to the sink outside it: (rank, count, monotonic time)
        self._iterations: collections.deque[tuple[int, int, float]] = collections.deque()

    def open_locked(self, cpu_window_s: float, stacks: bool, stacks_timeout_s: float,
                    timeout_s: float) -> SnapshotRequest:
        self._next += 1
        self._replies[self._next] = {}
        while len(self._replies) > 64:  # requests nobody waits for any more
            old = next(iter(self._replies))
            self._replies.pop(old)
            self._asked.pop(old, None)
        return SnapshotRequest(self._next, cpu_window_s, stacks, stacks_timeout_s,
                               time.monotonic() + max(0.0, timeout_s))

    def asked_locked(self, req: int, sids: set[str]) -> None:
        """Request ``req`` went out to the sessions ``sids`` (the hub's thread, at the flush)."""
        if req in self._replies:
            self._asked[req] = frozenset(sids)
            self._cond.notify_all()

    def reply_locked(self, session: Session, message: _wire.Message) -> None:
        req, snapshot = parse_snapshot(session, message)
        if req == 0:
            self._verdicts[session.sid] = snapshot
        elif req in self._replies:
            self._replies[req][session.sid] = snapshot
        self._cond.notify_all()

    def iterations_locked(self, session: Session, message: _wire.Message) -> None:
        """Take an ``iters`` message for the sink: :meth:`feed_iterations` gives it, outside the hub's lock."""
        entries = parse_iterations(session, message)
        self.iteration_messages += 1
        if self.iteration_sink is not None and entries:
            now = time.monotonic()
            self._iterations.extend((rank, count, now - age) for rank, count, age in entries)

    def feed_iterations(self) -> None:
        """Give the sink what :meth:`iterations_locked` took (the hub's thread, its lock not held)."""
        sink = self.iteration_sink
        while self._iterations:
            rank, count, at = self._iterations.popleft()
            if sink is not None:
                sink(rank, count, at)

    def wait(self, req: int, sessions: Callable[[], Iterable[Session]], timeout_s: float,
             closing: Callable[[], bool]) -> list[HostSnapshot]:
        """Wait at most ``timeout_s`` for the reply to ``req`` of every connected session it was
        sent to (until it went out: of every connected session); one :class:`HostSnapshot` per
        session that said hello, by agent rank."""
        def answered() -> bool:
            replies, asked = self._replies.get(req, {}), self._asked.get(req)
            return closing() or not any(s.connection is Connection.CONNECTED and s.sid not in replies
                                        and (asked is None or s.sid in asked) for s in sessions())

        with self._cond:
            self._cond.wait_for(answered, max(0.0, timeout_s))
            replies = self._replies.pop(req, {})
            asked = self._asked.pop(req, None)
            return [self._answer(session, replies.get(session.sid), timeout_s, asked)
                    for session in sorted(sessions(), key=lambda s: s.agent.rank)]

    def _answer(self, session: Session, reply: HostSnapshot | None, timeout_s: float,
                asked: frozenset[str] | None) -> HostSnapshot:
        if reply is not None:
            return reply
        verdict = self._verdicts.get(session.sid)
        unasked = asked is not None and session.sid not in asked and session.connection is Connection.CONNECTED
        why = (f"connection {session.connection}" if session.connection is not Connection.CONNECTED
               else "not asked: its hello came after the request went out, or the request could not be sent"
               if unasked else f"no reply within {timeout_s:.2f} s")
        if verdict is not None:
            return dataclasses.replace(verdict, detail=f"{why}; its agent's snapshot at its verdict")
        outcome = "lost" if session.connection is not Connection.CONNECTED else "not-asked" if unasked else "no-answer"
        return HostSnapshot(session.host, session.agent.rank, outcome, detail=why)
