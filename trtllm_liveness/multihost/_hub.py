"""The proxy's agent hub: remote hosts' agents feed one per-rank view and one fatal path.

One thread owns a ZMQ ROUTER bound where the ranks can reach it (TCP, the hub's ZMTP PINGs on), the
socket's monitor, a :class:`~._tcp.ConnectionTable`, a wakeup pipe and every agent session. It
merges what the agents report into the engine's own :class:`~trtllm_liveness.monitor.WorkerProcessMonitor`
(:meth:`~trtllm_liveness.monitor.WorkerProcessMonitor.apply_remote_many`), so remote ranks have real states in
``statuses()`` and their fatal events take the path a local death takes (subscribers, health,
pending requests failed, Dynamo, metrics, exit guard), exactly once per rank and kind; the states
at once, the subscribers' calls off its thread (:mod:`._hub_delivery`).

What ends a remote host's session, and what the proxy then reports: :mod:`._hub_endings`.

Nothing from the network is trusted: each message is authenticated (:mod:`._wire`), size-capped,
checked for replay and for fields of the right type and range; a bad one costs a rate-limited
WARNING, never an exception. The proxy never signals a remote pid: :meth:`AgentHub.stop_hosts`
asks each agent to stop its host's ranks (its own pidfds), :meth:`AgentHub.snapshot` to snapshot
them (:mod:`._hub_snapshots`, which also feeds their iterations); each waits, bounded, for replies.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import secrets
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

from .._events import MonitorMethod, WorkerState
from ..diagnose._diagnosis_record import HostSnapshot
from ..monitor._monitor import WorkerProcessMonitor
from ..monitor._progress_clock import ProgressClock
from ..process._identity import local_hostname
from . import _wire
from ._agent import AgentSettings
from ._agent_faults import FaultHandler
from ._channel import Channel, Tally, open_router
from ._host_silence import SilenceRule
from ._hub_delivery import RemoteDelivery
from ._hub_endings import end_session
from ._hub_records import (
    MAX_RANKS_PER_HOST,
    Connection,
    HostOutcome,
    HostStop,
    HostView,
    Session,
    Update,
    parse_hello,
    parse_report,
    parse_update,
)
from ._hub_snapshots import ITERATIONS_INTERVAL_S, IterationSink, SnapshotBook, SnapshotRequest
from ._tcp import Closure, ConnectionTable, Ending, Key, Silence
from ._wire import MAX_COMMAND_S, ArmCommand, Command, ExpectCommand, Rejection, StopCommand

if TYPE_CHECKING:
    from ..quarantine._quarantine_settings import QuarantineSettings

logger = logging.getLogger(__name__)

_POLL_MS = 1000  # the thread's wait is bounded; the wake pipe ends it at once for close() and commands
_PROBE_POLL_MS = 50  # while an unmatched connection's end is still being looked for
_DELIVERY_CLOSE_S = 0.5  # at close, how long a subscriber still busy with a remote event is waited for
_PROBE_S = 2.0  # how long it is looked for (the ROUTER may drop the routing id a little after the event)
_DRAIN_PER_ROUND = 256
_DRAIN_BEFORE_CLOSE = 4096


class AgentHub:
    """The proxy side; see the module docstring. ``start()`` once, ``close()`` once (idempotent).

    Args:
        monitor: the engine's monitor; remote ranks' states and events go there.
        bind: the address to bind (an interface's address or a hostname; ``*`` for every
            interface). Bind only where the ranks can reach: the channel is authenticated, not
            encrypted (it carries pids and states, never requests or weights).
        port: the TCP port; 0 picks a free one.
        advertise: the host name or address the ranks connect to (default: ``bind``, or this
            host's name when ``bind`` is ``*``).
        heartbeat_timeout_s: no data from a host's agent (its PINGs come every 0.75 timeouts) this
            long and the host is suspect; lost when the engine's ``progress`` also stopped for as
            long with requests pending (:class:`~._host_silence.SilenceRule` gives the whole rule).
        heartbeat_ceiling_s: a suspect host is lost after this long without contact while the
            engine shows no progress.
        progress: the engine's :class:`~trtllm_liveness.monitor._progress_clock.ProgressClock`
            (None: nothing corroborates a silence, so only the ceiling loses a silent host).
        observe: the engine's ``observe`` setting, passed on to the agents (they then only say
            what they would do).
        d_state_timeout_s: the agents' wedge bound (None: off), armed by :meth:`arm`;
            ``scan_interval_s`` how often they sample thread states.
        iterations_interval_s: agents forward iterations once per this (>= 1 s) while progress flows.
        quarantine: how each agent quarantines its own host for its ranks (None: it does not).
    """

    agent_faults: ClassVar[type[FaultHandler]] = FaultHandler  # the agents' (agent_settings): they refuse faults

    def __init__(self, monitor: WorkerProcessMonitor, *, bind: str, port: int = 0, advertise: str | None = None,
                 heartbeat_timeout_s: float = 1.8, d_state_timeout_s: float | None = None,
                 scan_interval_s: float = 1.0, grace_s: float = 2.0, kill_s: float = 3.0,
                 iterations_interval_s: float = ITERATIONS_INTERVAL_S, heartbeat_ceiling_s: float = 60.0,
                 progress: ProgressClock | None = None, observe: bool = False,
                 quarantine: QuarantineSettings | None = None) -> None:
        if not 0.01 <= heartbeat_timeout_s <= 3600:
            raise ValueError(f"heartbeat_timeout_s must be in [0.01, 3600], got {heartbeat_timeout_s}")
        if not 0 <= port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {port}")
        self.monitor = monitor
        self.bind = bind
        self.port = port
        self.advertise = advertise
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.silence = SilenceRule(heartbeat_timeout_s, heartbeat_ceiling_s, progress)
        self.secret = secrets.token_bytes(_wire.SECRET_BYTES)
        self.endpoint = ""
        self._agents = AgentSettings(  # what every rank's agent gets (agent_settings: the endpoint once bound)
            "", self.secret, heartbeat_timeout_s, d_state_timeout_s or None, grace_s=grace_s, kill_s=kill_s,
            scan_interval_s=scan_interval_s if 0.01 <= scan_interval_s <= 60 else 1.0,  # the agents' range
            iterations_interval_s=min(3600.0, max(ITERATIONS_INTERVAL_S, iterations_interval_s)), observe=observe,
            heartbeat_ceiling_s=self.silence.ceiling_s, faults=self.agent_faults, quarantine=quarantine)
        self.rejected = Tally(logger, "liveness: agent hub rejected a message from %s (%d so far): %s", 1)
        self.send_failures = Tally(logger, "liveness: could not send %s to the agent on host %s (%d failed sends so "
                                   "far): %s", 2)
        self.closed_without_hello = Tally(  # connections that ended before a valid hello (MAXMSGSIZE: oversized)
            logger, "liveness: agent hub: a connection from %s ended without a valid hello (%d so far; an oversized "
            "message ends it, limit %d bytes)", 1)
        self._cond = threading.Condition()
        self._commands: collections.deque[Command | SnapshotRequest] = collections.deque()
        self._book = SnapshotBook(self._cond)  # snapshot requests and replies, remote iterations
        self._handlers: dict[str, Callable[[Session, _wire.Message], None]] = {  # by kind, after the hello
            "event": self._update_locked, "state": self._update_locked, "report": self._report_locked,
            "snap": self._book.reply_locked, "iters": self._book.iterations_locked}
        self._delivery = RemoteDelivery(monitor)  # remote ranks' events to the subscribers, off the hub's thread
        self._sessions: dict[str, Session] = {}
        self._by_key: dict[Key, str] = {}
        self._closed_keys: dict[Key, Ending] = {}
        self._seen_sids: set[str] = set()
        # The lasting commands by kind, as sent (None: not yet): a later agent gets each after its welcome.
        self._lasting: dict[str, Command | None] = dict.fromkeys(("arm", "expect", "stop"))
        self._conns = ConnectionTable()
        self._probe_deadline: float | None = None  # an unmatched connection ended: probe until then
        self._silence_due: float | None = None  # when the connections' silences are next read
        self._stalled = False  # the engine's progress had stopped (requests pending) at the last look
        self._probe_closure = Closure(None, Ending.UNKNOWN)
        self._closing = False
        self._thread: threading.Thread | None = None
        self._channel: Channel | None = None  # the ROUTER, its monitor and the wake pipe, from start() on
        self._wake: Callable[[], None] = lambda: None  # ends the thread's wait: its channel's, from start() on

    # ----------------------------------------------------------------- public

    def start(self) -> AgentHub:
        """Bind (in this thread, so a bad address raises here) and start the hub's thread."""
        self._channel, self.port = open_router(self.bind, self.port)
        self._wake = self._channel.wake
        advertise = self.advertise or (self.bind if self.bind not in ("*", "0.0.0.0") else local_hostname())
        self.endpoint = f"tcp://{advertise}:{self.port}"
        self._delivery.start()
        thread = threading.Thread(target=self._run, name="trtllm-liveness-agent-hub", daemon=True)
        try:
            thread.start()
        except BaseException:
            self._delivery.close(_DELIVERY_CLOSE_S)
            self._release()
            raise
        self._thread = thread
        logger.info("liveness: agent hub listening on %s (heartbeat timeout %.2f s)", self.endpoint,
                    self.heartbeat_timeout_s)
        return self

    def agent_settings(self) -> AgentSettings:
        """What every rank's agent needs from this hub: it travels to every rank with its task."""
        return dataclasses.replace(self._agents, endpoint=self.endpoint)

    def arm(self, d_state_timeout_s: float | None = None) -> None:
        """Tell every agent (and every later one) to make wedge verdicts from now on."""
        bound = self._agents.d_state_timeout_s if d_state_timeout_s is None else d_state_timeout_s
        self._command(ArmCommand(None if bound is None else min(bound, MAX_COMMAND_S)))

    def expect_exits(self) -> None:
        """A stop began: agents treat exits as expected and no longer end their ranks without a hub."""
        self._command(ExpectCommand())

    def hosts(self) -> list[HostView]:
        """A snapshot of every remote host that said hello."""
        with self._cond:
            return [HostView(s.host, s.agent.rank, s.ranks, *s.shown_connection())
                    for s in sorted(self._sessions.values(), key=lambda s: s.agent.rank)]

    def stop_hosts(self, timeout_s: float, *, grace_s: float | None = None,
                   kill_s: float | None = None) -> list[HostStop]:
        """Ask every connected agent to stop its host's ranks (bounded, with its own pidfds) and
        wait at most ``timeout_s`` for the reports. Returns one :class:`HostStop` per host; a lost
        host is reported lost, one that did not answer in time ``no-answer``. Never raises for
        what the hosts do; at most one stop runs (a second call waits for the same reports)."""
        self._command(StopCommand(min(self._agents.grace_s if grace_s is None else grace_s, MAX_COMMAND_S),
                                  min(self._agents.kill_s if kill_s is None else kill_s, MAX_COMMAND_S)))
        with self._cond:
            self._cond.wait_for(lambda: self._closing or all(s.stop is not None for s in self._sessions.values()),
                                max(0.0, timeout_s))
            return [s.stop or s.host_stop(HostOutcome.NO_ANSWER, f"no report within {timeout_s:.1f} s")
                    for s in sorted(self._sessions.values(), key=lambda s: s.agent.rank)]

    def snapshot(self, timeout_s: float, *, cpu_window_s: float = 0.1, stacks: bool = True,
                 stacks_timeout_s: float = 0.3) -> list[HostSnapshot]:
        """Ask every connected agent for a snapshot of its host's ranks (``cpu_window_s`` of CPU
        time; ``stacks`` within ``stacks_timeout_s``) and wait at most ``timeout_s`` for the
        replies: one :class:`HostSnapshot` per host that said hello, by agent
        rank (lost hosts ``lost``, silent ones ``no-answer``, each with its verdict's snapshot
        where its agent sent one). Thread-safe, any number of callers at once; never raises for
        what the hosts do."""
        with self._cond:
            command = self._book.open_locked(cpu_window_s, stacks, stacks_timeout_s, timeout_s)
        self._command(command)
        return self._book.wait(command.req, self._sessions.values, timeout_s, lambda: self._closing)

    def feed_iterations(self, sink: IterationSink | None) -> None:
        """Call ``sink(rank, count, at)`` (in the hub's thread) for each remote rank's iterations."""
        self._book.iteration_sink = sink

    def close(self, timeout: float = 1.0) -> None:
        """Stop the thread and close the socket (its LINGER lets a last ``expect`` leave)."""
        with self._cond:
            if self._closing:
                return
            self._closing = True
            self._cond.notify_all()
        self._wake()
        deadline = time.monotonic() + timeout
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        if self._thread is None:
            self._release()
        self._delivery.close(max(_DELIVERY_CLOSE_S, deadline - time.monotonic()))

    # ----------------------------------------------------------------- the thread

    def _command(self, command: Command | SnapshotRequest) -> None:
        with self._cond:
            self._commands.append(command)
        self._wake()

    def _release(self) -> None:
        self._conns.close()
        if self._channel is not None:
            self._channel.close()
        with self._cond:
            self._cond.notify_all()

    def _run(self) -> None:
        import zmq

        assert self._channel is not None
        channel = self._channel
        try:
            while True:
                with self._cond:
                    if self._closing:
                        self._flush_commands_locked()
                        return
                wait_ms = _PROBE_POLL_MS if self._probe_deadline is not None else _POLL_MS
                # When the engine's progress will have stopped, until it has: from then on the
                # silences are read when due (_check_silence), not at every turn of the loop.
                stall_due = None if self._stalled else self.silence.stall_due()
                for due in (self._silence_due, stall_due):
                    if due is not None:
                        wait_ms = max(0, min(wait_ms, int((due - time.monotonic()) * 1000) + 1))
                readable, monitored = channel.poll(wait_ms)
                # The monitor first: a connection's EVENT_ACCEPTED is queued before its handshake, so
                # it is then seen before the hello it carries, and the hello finds its connection.
                for event, fd in channel.events() if monitored else ():
                    if event == zmq.EVENT_ACCEPTED:
                        self._conns.accepted(fd)
                        self._silence_due = time.monotonic()
                    elif event == zmq.EVENT_DISCONNECTED:
                        # What the peer sent before it closed (a stop's report, its last event)
                        # is already queued: read it first, or its session would end as lost.
                        self._drain(zmq, _DRAIN_BEFORE_CLOSE)
                        self._disconnected(self._conns.disconnected(fd))
                if readable:
                    self._drain(zmq, _DRAIN_PER_ROUND)
                self._check_silence()
                with self._cond:
                    self._flush_commands_locked()
                    self._probe_again_locked()
        except Exception as exc:
            logger.exception("liveness: the agent hub failed; remote hosts are no longer watched")
            # Its socket closes with it, and every agent then ends its host's ranks: say so, fatally.
            with self._cond:
                for session in list(self._sessions.values()):
                    if session.connection is Connection.CONNECTED:
                        session.connection = Connection.LOST
                        cause = f"the proxy's agent hub failed ({exc!r}); host {session.host}'s agent ends its ranks"
                        self._apply_many(session.updates(WorkerState.LOST, cause))
                self._cond.notify_all()
        finally:
            self._release()

    def _flush_commands_locked(self) -> None:
        while self._commands:
            command = self._commands.popleft()
            if not isinstance(command, SnapshotRequest):
                sent_before = self._lasting[command.kind]
                if sent_before is not None and (sent_before == command or not isinstance(command, ArmCommand)):
                    continue  # nothing new to tell the agents: one expect, at most one stop, an arm per bound
                if isinstance(command, StopCommand):
                    command = dataclasses.replace(command, req=1)  # the one stop a hub sends: its first request
                    for session in self._sessions.values():
                        if session.connection is not Connection.CONNECTED and session.stop is None:
                            session.stop = session.host_stop(HostOutcome.LOST, f"connection {session.connection}")
                    self._cond.notify_all()
                self._lasting[command.kind] = command
            sent = {session.sid for session in self._sessions.values() if session.connection is Connection.CONNECTED
                    and self._send(session, command.kind, **command.fields())}
            if isinstance(command, SnapshotRequest):
                self._book.asked_locked(command.req, sent)  # its callers wait for those only

    def _send(self, session: Session, kind: str, /, **fields: Any) -> bool:
        """Whether the message left (never blocks)."""
        session.seq_out += 1
        failed = self._deliver(session.sid, kind, session.seq_out, fields)
        if failed is not None:
            self.send_failures.note(kind, session.host, failed)
        return failed is None

    def _deliver(self, sid: str, kind: str, seq: int, fields: dict[str, Any]) -> Exception | None:
        """Send one message to session ``sid``'s agent without ever blocking: None once it left,
        else why not (its connection is gone, ``ROUTER_MANDATORY``, or its queue is full)."""
        import zmq

        assert self._channel is not None
        frame = _wire.encode(self.secret, _wire.TO_AGENT, kind, sid, seq, **fields)
        try:
            self._channel.sock.send_multipart([sid.encode(), frame], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            return exc
        return None

    def _drain(self, zmq: Any, limit: int) -> None:
        """Read at most ``limit`` messages (a flooding peer must not starve the monitor socket and
        the commands; the poller reports the rest next round)."""
        assert self._channel is not None
        for _ in range(limit):
            try:
                frames = self._channel.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if len(frames) != 2:
                self.rejected.note(_peer(frames[-1]), f"{len(frames) - 1} frames instead of 1")
                continue
            routing_id, frame = frames[0].bytes, frames[1].bytes
            try:
                message = _wire.decode(self.secret, _wire.TO_HUB, frame)
                if routing_id != message.sid.encode():
                    raise _wire.WireError("session id differs from the connection's identity")
                with self._cond:  # the peer's address only where used (a syscall per message)
                    self._handle_locked(message, _peer(frames[-1]) if message.kind == "hello" else "?")
            except _wire.WireError as exc:
                self.rejected.note(_peer(frames[-1]), str(exc))
            self._book.feed_iterations()

    def _handle_locked(self, message: _wire.Message, peer: str) -> None:
        session = self._sessions.get(message.sid)
        if message.kind == "hello":
            if message.sid in self._seen_sids:
                raise _wire.WireError("hello of a session already seen (replayed)")
            self._seen_sids.add(message.sid)
            self._hello_locked(message, peer)
            return
        if session is None:
            raise _wire.WireError(f"{message.kind} before hello")
        if message.seq <= session.seq_in:
            raise _wire.WireError(f"replayed or reordered message (n={message.seq})")
        session.seq_in = message.seq
        handler = self._handlers.get(message.kind)
        if handler is None:
            raise _wire.WireError(f"unknown kind {message.kind!r}")
        handler(session, message)

    def _hello_locked(self, message: _wire.Message, peer: str) -> None:
        host, agent, ranks, port, why = parse_hello(message, self._sessions.values())
        if why or agent is None:
            self.rejected.note(peer, f"hello from host {host!r} refused: {why}")
            self._deliver(message.sid, Rejection.kind, 1, Rejection(why[:500]).fields())
            return
        key = (peer, port) if peer != "?" and port else None
        session = Session(message.sid, host, agent, ranks, key, seq_in=message.seq)
        self._sessions[message.sid] = session
        self._apply_many(session.updates(WorkerState.ALIVE))
        logger.info("liveness: host %s's agent (rank %d) watches ranks %s", host, agent.rank,
                    [identity.rank for identity in ranks])
        self._send(session, "welcome")
        for command in self._lasting.values():
            if command is not None:
                self._send(session, command.kind, **command.fields())
        if key is not None and (key in self._conns or key in self._closed_keys):
            self._by_key[key] = message.sid
            ending = self._closed_keys.pop(key, None)
            if ending is not None:  # its connection ended before its hello was read
                self._lost_locked(session, ending)
        else:
            session.key = None  # found by a probe when an unmatched connection ends (_probe_unbound_locked)
            logger.warning("liveness: host %s's agent connection (%s, port %s) matches none the hub accepted "
                           "(address or port translation between them?); its end is found by probing", host, peer, port)

    def _update_locked(self, session: Session, message: _wire.Message) -> None:  # an event or a state
        update, event = parse_update(session, message)
        self._apply_many([update], **event)

    def _report_locked(self, session: Session, message: _wire.Message) -> None:
        session.stop = parse_report(session, message)
        self._cond.notify_all()

    def _apply_many(self, updates: list[Update], **extra: Any) -> None:
        # States now, in the hub's order; subscribers in the delivery's thread: they may ask the hub.
        if self.monitor.apply_remote_many(updates, via=MonitorMethod.AGENT, deliver=False, **extra):
            self._delivery.poke()

    def _check_silence(self) -> None:
        """Read every connection's silence when a decision may be due: once per timeout, and at once
        when the engine's progress stops with requests pending (then as soon as the next decision
        may be due); :class:`SilenceRule` says what each silence means (suspect, lost, heard again)."""
        now = time.monotonic()
        stalled = self.silence.engine_stalled(now)
        began, self._stalled = stalled and not self._stalled, stalled
        if self._silence_due is None or (now < self._silence_due and not began):
            return

        def session_of(silence: Silence) -> Session | None:
            sid = self._by_key.get(silence.key)
            session = self._sessions.get(sid) if sid is not None else None
            return session if session is not None and session.connection is Connection.CONNECTED else None

        with self._cond:
            next_s = self.silence.check_locked(self._conns.silences(), session_of, self._apply_many,
                                               self._lost_locked, self._conns.cut)
        every = next_s if stalled else max(next_s, self.heartbeat_timeout_s)
        self._silence_due = time.monotonic() + every if len(self._conns) else None

    def _disconnected(self, closure: Closure) -> None:
        key, ending = closure.key, closure.ending
        with self._cond:
            sid = self._by_key.pop(key, None) if key is not None else None
            session = self._sessions.get(sid) if sid is not None else None
            if session is None and any(s.key is None and s.connection is Connection.CONNECTED
                                       for s in self._sessions.values()):
                # Maybe an unmatched session's: probe now, and again each round for a while (the
                # ROUTER may still route to it for a moment after the event).
                self._probe_deadline = time.monotonic() + _PROBE_S
                self._probe_closure = closure
                if self._probe_unbound_locked(closure):
                    self._probe_deadline = None
                    return
            if session is None:
                self.closed_without_hello.note(f"{key[0]}:{key[1]}" if key else "?", _wire.MAX_MESSAGE_BYTES)
                if key is not None:
                    self._closed_keys[key] = ending
                    while len(self._closed_keys) > 4 * MAX_RANKS_PER_HOST:
                        self._closed_keys.pop(next(iter(self._closed_keys)))
                return
            self._lost_locked(session, ending, closure.silent_s)

    def _probe_again_locked(self) -> None:
        if self._probe_deadline is None:
            return
        if self._probe_unbound_locked(self._probe_closure) or time.monotonic() >= self._probe_deadline:
            self._probe_deadline = None

    def _probe_unbound_locked(self, closure: Closure) -> bool:
        """A connection the hub cannot match to a session ended: a session whose key is unknown
        may be its. A message to a routing id whose connection is gone fails at once (the ROUTER is
        ``ROUTER_MANDATORY``): each unbound session gets a probe, and those unreachable are lost."""
        import zmq

        found = False
        for session in list(self._sessions.values()):
            if session.key is not None or session.connection is not Connection.CONNECTED:
                continue
            session.seq_out += 1
            failed = self._deliver(session.sid, "probe", session.seq_out, {})
            if isinstance(failed, zmq.ZMQError) and failed.errno == zmq.EHOSTUNREACH:
                found = True
                self._lost_locked(session, closure.ending, closure.silent_s)
        return found

    def _lost_locked(self, session: Session, ending: Ending, silent_s: float | None = None,
                     corroboration: str = "") -> None:
        """End ``session``'s connection: its ranks' updates (``corroboration``: what besides a silence
        made it lost, said in their cause)."""
        if session.connection is not Connection.CONNECTED:
            return
        updates, fault_at = end_session(session, ending, expecting=self._lasting["expect"] is not None,
                                        stopping=self._lasting["stop"] is not None,
                                        heartbeat_timeout_s=self.heartbeat_timeout_s, silent_s=silent_s,
                                        corroboration=corroboration)
        self._apply_many(updates, **({} if fault_at is None else {"fault_at": fault_at}))
        self._cond.notify_all()  # its stop, where one runs, is there now


def _peer(frame: Any) -> str:
    with contextlib.suppress(Exception):
        return str(frame.get("Peer-Address"))
    return "?"
