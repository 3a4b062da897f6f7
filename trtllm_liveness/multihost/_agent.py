"""The per-host agent: one thread in one rank of each remote host, watching that host's ranks.

Why a thread in a rank and not a daemon of its own: the ranks are all a launcher (``mpirun``,
``srun``) starts on a host, so the agent needs no installation, no port and no privileges beyond
the rank's; and its connection then doubles as the liveness of the rank that hosts it. One agent
per host (the host's lowest rank, :mod:`._placement`), not one per rank: one connection and one
set of pidfds per host, 18 connections for an 18-host rack instead of 72.

The thread owns everything it uses: a ZMQ DEALER connected to the proxy's hub, that socket's
monitor, a duplicate of its TCP connection's descriptor (to read when the hub was last heard,
:mod:`._tcp`), a wakeup pipe, and a :class:`~trtllm_liveness.monitor.WorkerProcessMonitor` over the host's
other ranks (pidfds, per-thread ``D`` state, OOM cause). The agent PINGs the hub (ZMQ sends them
and reads the hub's answers); a silent hub is only logged (suspect) until
:attr:`AgentSettings.fence_silence_s` (the hub's ceiling plus a timeout, so the hub decides first),
and then ends the host's ranks only while they make no progress, as docs/multihost.md (its table's
last row, and "Limits") tells. It sends:

- ``hello`` once connected: the host, the agent's rank and the identities of the host's ranks;
- ``event`` for each fatal event of the monitor (death, wedge, unkillable) as it happens;
- ``state`` for each other change of a rank's state (e.g. an expected exit);
- ``report`` after a ``stop`` request: the bounded stop of the host's other ranks (verified by its
  own pidfds: the proxy never signals a remote pid), then the agent ends its own rank;
- ``snap``: the snapshot of the host's ranks (its own too) taken with the proxy's own
  :func:`~trtllm_liveness.diagnose._diagnosis.diagnose`, on a ``snapreq`` and, unasked, right after
  the events of its own fatal verdicts (:mod:`._hub_snapshots`);
- ``iters``: the host's ranks' executor iterations (:meth:`HostAgent.note_iteration`, fed by the
  host's own progress channel), at most one message a second while they change, none while idle.

and takes ``welcome``, ``arm`` (wedge verdicts from now on), ``expect`` (exits are expected: a clean
stop), ``stop``, ``snapreq`` and ``fault`` (refused, :mod:`._agent_faults`, unless a drill's hub handed
the agent its own handler). When the connection to the hub drops before ``expect`` (the proxy died, or
the host is cut off and the proxy has declared it lost), the agent stops the host's other ranks and
ends its own (``on_proxy_lost``): no rank keeps serving a proxy that is gone or has given it up.

A non-restartable event of the host's ranks quarantines this host, here and only here
(:mod:`._agent_quarantine`; docs/multihost.md, "A wedged remote rank quarantines its own host").

Every wait is bounded; nothing here raises into the rank: a failure is logged and the agent ends.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._events import WorkerEvent, WorkerState
from ..monitor._monitor import WorkerProcessMonitor
from ..process._identity import ProcessIdentity
from . import _wire
from ._agent_faults import FaultHandler
from ._agent_quarantine import HostQuarantine
from ._channel import AGENT_SEND_TIMEOUT_MS, Channel, Tally, open_dealer
from ._hub_snapshots import ITERATIONS_INTERVAL_S, SnapshotRequest, encode_ranks, parse_snapshot_request
from ._tcp import cut, duplicate, last_heard

if TYPE_CHECKING:
    from ..quarantine._quarantine_settings import QuarantineSettings

logger = logging.getLogger(__name__)

PROXY_LOST_EXIT_STATUS = 75
"""Exit status of a rank ended because its proxy is gone (EX_TEMPFAIL, as the proxy-death watch)."""

_TICK_S = 0.5  # the loop wakes at least this often to send state changes; not a detection bound
_RECEIVE_BATCH = 64  # messages from the hub read ahead of handling them (each capped by the wire)
_MAX_ITERATIONS_PER_MESSAGE = 1000  # ~40 bytes each: well under the wire's cap
VERDICT_SNAPSHOT = SnapshotRequest(0, 0.1, True, 0.3)
"""The snapshot an agent sends unasked after its own fatal verdict: as the proxy's own (request 0)."""
_COMMANDS: dict[str, Callable[[_wire.Message], _wire.Command | SnapshotRequest]] = {
    **_wire.COMMANDS, "snapreq": parse_snapshot_request}


@dataclass(frozen=True)
class AgentSettings:
    """What the proxy hands every rank (:meth:`~._hub.AgentHub.agent_settings`) plus the rank's own part."""

    endpoint: str
    secret: bytes
    heartbeat_timeout_s: float
    d_state_timeout_s: float | None
    scan_interval_s: float = 1.0
    grace_s: float = 2.0
    kill_s: float = 3.0
    iterations_interval_s: float = ITERATIONS_INTERVAL_S
    heartbeat_ceiling_s: float = 60.0
    observe: bool = False  # the engine observes: the agent says what it would do and ends nothing
    faults: type[FaultHandler] = FaultHandler  # its hub's fault requests: refused, unless a drill's hub hands its own
    quarantine: QuarantineSettings | None = None  # how this host is quarantined for its ranks (None: not at all)

    @property
    def hub_silence_s(self) -> float:
        """Nothing from the hub (its answers to this agent's PINGs) this long and the hub is
        suspect: the timeout plus one PING interval."""
        return self.heartbeat_timeout_s * (1 + _wire.PING_INTERVAL_TIMEOUTS)

    @property
    def fence_silence_s(self) -> float:
        """Nothing from the hub this long, and the agent ends its host's ranks (where they make no
        progress either): the hub's ceiling plus a timeout, so that the hub decides first."""
        return self.heartbeat_ceiling_s + self.heartbeat_timeout_s


def end_rank(reason: str) -> None:
    """The default ``on_proxy_lost``: the threads this process must finish first (this host's
    quarantine), each until its own deadline; one CRITICAL line; then ``os._exit(75)`` (bounded flush)."""
    from ..exit._process_ending import process_ending

    left = process_ending().threads.join()
    if left:
        logger.warning("liveness: ending this rank with threads still running past their bound: %s", ", ".join(left))
    logger.critical("liveness: %s; ending this rank (pid %d) with status %d", reason, os.getpid(),
                    PROXY_LOST_EXIT_STATUS)
    for handler in logging.getLogger().handlers:
        with contextlib.suppress(Exception):
            handler.flush()
    os._exit(PROXY_LOST_EXIT_STATUS)


class HostAgent:
    """One host's agent; see the module docstring. ``start()`` once, ``close()`` any time.

    ``identities`` are the host's ranks other than the agent's own (``own``): the agent cannot
    watch the process it runs in, and its hub watches it through the connection.
    ``on_proxy_lost(reason)`` runs in the agent's thread once the host's other ranks are stopped
    (default :func:`end_rank`): the proxy is gone, or it asked for the stop (the reason "stopped by
    the proxy", once the stop's report is sent).
    """

    def __init__(self, settings: AgentSettings, own: ProcessIdentity, identities: Sequence[ProcessIdentity], *,
                 on_proxy_lost: Callable[[str], None] = end_rank) -> None:
        self.settings = settings
        self.own = own
        self.identities = tuple(identities)
        self.sid = secrets.token_hex(16)
        self._on_proxy_lost = on_proxy_lost
        self._seq = 0
        self._peer_seq = 0
        self._pending: collections.deque[WorkerEvent] = collections.deque()
        self._lock = threading.Lock()
        self._wake: Callable[[], None] = lambda: None  # ends the thread's wait: its channel's, once made
        self._closing = False
        self.welcomed = threading.Event()  # set once the hub accepted this agent's hello
        self._released = False
        self._ending: str | None = None  # why the rank must end (the proxy is gone), once decided
        self._ending_set = threading.Event()
        self._stopped = threading.Event()  # the host's other ranks were stopped
        self.rejected = Tally(logger, "liveness: the host agent rejected a message (%d so far): %s", 0)
        self._link: socket.socket | None = None  # a duplicate of the connection's descriptor (the thread's)
        self._silent_for: float | None = None  # the hub's silence the agent cut the connection at
        self._suspect_since: float | None = None  # the thread's: monotonic, since when the hub is silent
        self._suspect_warned = False  # the thread's: this silence's WARNING was logged
        self._observed_fence = False  # the thread's: observe mode said once what it would do
        self._iterations: dict[int, tuple[int, float]] = {}  # rank -> (count, monotonic at); under _lock
        self._iterations_sent: dict[int, int] = {}  # the thread's: rank -> count last sent
        self._iterations_due = 0.0  # the thread's: no iterations message before this (wall clock)
        self.iteration_messages = 0
        self._ranks = frozenset(identity.rank for identity in (own, *self.identities))  # this host's
        self._verdict_taken: object = None  # the thread's: the verdict (monitor.failure) its snapshot was taken at
        self._closers: list[Callable[[], None]] = []  # what the agent owns beside its thread's (its beats' channel)
        self._faults = settings.faults(own, self.identities)  # the thread's
        self._quarantine = HostQuarantine(own.hostname, settings.quarantine, "observe=1" if settings.observe
                                          else "a drill's engine" if settings.faults is not FaultHandler else "")
        self._thread = threading.Thread(target=self._run, name="trtllm-liveness-host-agent", daemon=True)

    # ----------------------------------------------------------------- public

    def start(self) -> HostAgent:
        self._thread.start()
        atexit.register(self._at_exit)
        return self

    def _at_exit(self) -> None:
        """The rank's interpreter is exiting (its main thread raised: e.g. ULFM's
        ``MPI_ERR_PROC_FAILED`` when the proxy died). mpi4py finalizes MPI after Python's atexit
        handlers, and ``MPI_Finalize`` may hang with a failed peer (Open MPI #11404), holding the
        process: the agent's own ending would then never come. So here, first, wait a bounded while
        for the agent's verdict and end the rank with status 75 if the proxy is gone. A released
        agent (clean stop) or a closed one lets the exit go on at once."""
        self._close_owned()
        if self._released or self._closing or not self.welcomed.is_set():
            return
        if not self._ending_set.wait(self.settings.hub_silence_s + _TICK_S + 0.5):
            return
        self._stopped.wait(self.settings.grace_s + self.settings.kill_s + 1.0)
        self._on_proxy_lost(self._ending or "the proxy is gone")

    def adopt(self, closer: Callable[[], None]) -> None:
        """Call ``closer`` when the agent ends (or its rank exits): e.g. its progress channel's close."""
        self._closers.append(closer)

    def _close_owned(self) -> None:
        while self._closers:
            with contextlib.suppress(Exception):
                self._closers.pop()()

    def note_iteration(self, rank: int, count: int, at: float) -> None:
        """Rank ``rank`` of this host did ``count`` executor iterations, the last at ``at``
        (monotonic, this host's clock). Any thread; the agent's thread forwards them batched. A
        rank not of this host is dropped (the hub rejects a whole message for one foreign rank)."""
        if rank not in self._ranks:
            return
        with self._lock:
            known = self._iterations.get(rank)
            if known is None or count > known[0]:
                self._iterations[rank] = (count, at)

    def close(self, timeout: float = 1.0) -> None:
        """Stop the agent (its ranks are left as they are) and join it for at most ``timeout``."""
        with self._lock:
            self._closing = True
        self._wake()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    # ----------------------------------------------------------------- the thread

    def _on_event(self, event: WorkerEvent) -> None:  # the monitor's thread
        self._quarantine.note([event])  # a wedge: this host's marker, awaited before the event leaves
        self._pending.append(event)
        self._wake()

    def _run(self) -> None:
        import zmq

        monitor = WorkerProcessMonitor(d_state_timeout_s=self.settings.d_state_timeout_s,
                                       scan_interval_s=self.settings.scan_interval_s, wedge_armed=False)
        channel: Channel | None = None
        ending: str | None = None  # why the rank must end, once its thread is done
        try:
            channel = open_dealer(self.sid, self.settings.heartbeat_timeout_s)
            self._wake = channel.wake
            monitor.register(self.identities)
            monitor.subscribe(self._on_event)
            monitor.start()
            channel.sock.connect(self.settings.endpoint)
            ending = self._loop(zmq, channel, monitor)
        except Exception:
            logger.exception("liveness: the host agent failed; this host's ranks are no longer watched")
        finally:
            if self._link is not None:
                self._link.close()
                self._link = None
            self._faults.release()
            monitor.close()
            self._close_owned()
            if channel is not None:
                channel.close()  # with its LINGER: a last report still leaves
        if ending is not None:
            self._on_proxy_lost(ending)

    def _loop(self, zmq: Any, channel: Channel, monitor: WorkerProcessMonitor) -> str | None:
        """Serve until closed (None) or until the rank must end (why)."""
        sock = channel.sock
        sent: dict[int, tuple[str, str]] = {}
        connected_once = False
        started = time.monotonic()
        warned = False
        while True:
            with self._lock:
                if self._closing:
                    return None
            readable, monitored = channel.poll(self._poll_ms())
            action = self._receive(zmq, sock, monitor) if readable else None
            for event, fd in channel.events() if monitored and action is None else ():
                if event == zmq.EVENT_CONNECTED:
                    connected_once = True
                    if self._link is not None:
                        self._link.close()
                    self._link = duplicate(fd)
                    self._send(sock, "hello", **self._hello())
                elif event == zmq.EVENT_DISCONNECTED and connected_once:
                    # What the hub sent before it closed (an "expect" of a clean stop, a
                    # stop) is already queued: read it first, or a clean stop would look
                    # like the proxy's death.
                    action = self._receive(zmq, sock, monitor)
                    if action == "stop":
                        break
                    if self._released or action == "refused":
                        logger.info("liveness: the proxy's hub closed after a clean stop; agent ends")
                        return None
                    if self._silent_for is not None:
                        reason = (f"nothing from the proxy's hub at {self.settings.endpoint} for "
                                  f"{self._silent_for:.2f} s (beyond heartbeat_ceiling_s) while this host's "
                                  "ranks made no progress (this host cut off, the proxy's host lost, or the "
                                  "proxy frozen)")
                    else:
                        reason = (f"the connection to the proxy's hub at {self.settings.endpoint} dropped "
                                  "(proxy gone, or this host cut off)")
                    if self.settings.observe:
                        logger.warning("liveness: would end this host's ranks: %s (observe=1: nothing ended)",
                                       reason)
                        return None
                    self._proxy_lost(monitor, reason)
                    self._on_proxy_lost(reason)  # at once: nothing here needs tidying first
                    return None
            if action == "stop":
                return "stopped by the proxy"
            if action == "refused":
                return None
            self._check_hub_silence()
            if not self.welcomed.is_set():
                # Events wait for the welcome: the hub takes nothing before it has the hello.
                if not warned and time.monotonic() - started > max(30.0, 10 * self.settings.heartbeat_timeout_s):
                    warned = True
                    logger.warning("liveness: this host's agent has not reached the proxy's hub at %s yet "
                                   "(check hosts_bind/hosts_advertise/hosts_port and firewalls); its ranks are not "
                                   "watched until it does", self.settings.endpoint)
                continue
            self._send_events(sock, monitor)
            self._send_iterations(sock)
            for status in monitor.statuses():
                # Fatal states travel as events only (with their thread and wait channel).
                if status.state.is_fatal or status.state is WorkerState.ALIVE:
                    continue
                now = (status.state.value, status.detail)
                if sent.get(status.identity.rank) != now:
                    sent[status.identity.rank] = now
                    self._send(sock, "state", rank=status.identity.rank, state=status.state.value,
                               detail=status.detail[:2000])

    def _send_events(self, sock: Any, monitor: WorkerProcessMonitor) -> None:
        """Send the pending fatal events (once this host's quarantine markers for them are
        written), then the snapshot of this host's ranks for the verdict."""
        if self._pending:
            self._quarantine.await_markers()
        verdict = bool(self._pending) and monitor.failure is not self._verdict_taken
        while self._pending:
            fatal = self._pending.popleft()
            self._send(sock, "event", what=fatal.kind.value, rank=fatal.identity.rank, pid=fatal.identity.pid,
                       cause=fatal.cause[:2000], tid=fatal.tid, wchan=fatal.wchan[:200],
                       age=max(0.0, time.monotonic() - (fatal.fault_at or fatal.detected_at)))
        if verdict:  # right after its events, so the hub has it before its stop; once per verdict
            self._verdict_taken = monitor.failure
            self._snapshot(sock, VERDICT_SNAPSHOT)

    def _check_hub_silence(self) -> None:
        """Read how long nothing came from the hub: silent for the timeout, the hub is suspect (one
        WARNING once it lasts twice that); heard again, it is not; silent past ``fence_silence_s``
        while this host's ranks make no progress, the connection is cut: ZMQ then reports it
        dropped, and the loop ends the host's ranks as for a hub that went away (observe mode:
        one WARNING saying so instead)."""
        if self._link is None or self._silent_for is not None or not self.welcomed.is_set():
            return
        heard = last_heard(self._link)
        if heard is None:
            return
        silence, timeout = heard[0], self.settings.heartbeat_timeout_s
        if silence < self.settings.hub_silence_s:
            if self._suspect_since is not None:
                logger.info("liveness: the proxy's hub heard again after %.2f s without contact",
                            time.monotonic() - self._suspect_since - silence)
                self._suspect_since = None
            return
        if self._suspect_since is None:
            self._suspect_since, self._suspect_warned = time.monotonic() - silence, False
        if not self._suspect_warned and silence >= 2 * timeout:
            self._suspect_warned = True
            logger.warning("liveness: nothing from the proxy's hub at %s for %.2f s; this host's ranks go on while "
                           "they make progress (ended after %.0f s without contact if they make none)",
                           self.settings.endpoint, silence, self.settings.fence_silence_s)
        quiet = self._ranks_quiet_s()
        if silence < self.settings.fence_silence_s or (quiet is not None and quiet < timeout):
            return
        if self.settings.observe:
            if not self._observed_fence:
                self._observed_fence = True
                logger.warning("liveness: would end this host's ranks: nothing from the proxy's hub for %.2f s and "
                               "%s (observe=1: nothing ended)", silence,
                               "no iteration reported" if quiet is None else f"no iteration for {quiet:.2f} s")
            return
        self._silent_for = silence
        cut(self._link)

    def _ranks_quiet_s(self) -> float | None:
        """Seconds since this host's ranks' last executor iteration; None when none ever reported one."""
        with self._lock:
            last = max((at for _count, at in self._iterations.values()), default=None)
        return None if last is None else max(0.0, time.monotonic() - last)

    def _hello(self) -> dict[str, Any]:
        port = 0
        if self._link is not None:
            with contextlib.suppress(OSError):
                port = int(self._link.getsockname()[1])  # lets the hub match its connection to this hello
        return {"host": self.own.hostname, "rank": self.own.rank, "port": port,
                "ranks": [list(identity) for identity in (self.own, *self.identities)]}

    def _send(self, sock: Any, kind: str, /, **fields: Any) -> None:
        import zmq

        self._seq += 1
        try:
            sock.send(_wire.encode(self.settings.secret, _wire.TO_HUB, kind, self.sid, self._seq, **fields))
        except zmq.Again:
            logger.warning("liveness: the hub did not take the agent's %s message within %d ms", kind,
                           AGENT_SEND_TIMEOUT_MS)

    def _receive(self, zmq: Any, sock: Any, monitor: WorkerProcessMonitor) -> str | None:
        """Handle what the hub sent: ``"stop"`` (the host's ranks were stopped: end this rank),
        ``"refused"`` (the hub does not count this host: the agent ends), else None."""
        # What is queued now is read and parsed at once: a snapshot request whose caller gave up
        # meanwhile (the snapshots before it took that long) is skipped, not run ahead of a stop
        # behind it.
        queued: collections.deque[tuple[_wire.Message, _wire.Command | SnapshotRequest | None]] = collections.deque()
        while True:
            while len(queued) < _RECEIVE_BATCH:
                try:
                    frame = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    message = _wire.decode(self.settings.secret, _wire.TO_AGENT, frame)
                    if message.sid != self.sid or message.seq <= self._peer_seq:
                        raise _wire.WireError("not for this session, or replayed")
                    parse = _COMMANDS.get(message.kind)  # welcome, fault, probe: no record
                    queued.append((message, parse(message) if parse is not None else None))
                except _wire.WireError as exc:
                    self.rejected.note(exc)
                    continue
                self._peer_seq = message.seq
            if not queued:
                return None
            message, command = queued.popleft()
            match command:
                case _wire.ArmCommand():
                    monitor.arm_wedge_detection(command.d_state_timeout_s)
                case _wire.ExpectCommand():
                    self._released = True
                    monitor.mark_expected_exits()
                case _wire.StopCommand():
                    self._stop_requested(sock, monitor, command)
                    return "stop"
                case SnapshotRequest():
                    if command.deadline is not None and time.monotonic() > command.deadline:
                        logger.info("liveness: the host agent skips snapshot request %d: its caller waits no longer",
                                    command.req)
                        continue
                    self._snapshot(sock, command)
                case _wire.Rejection():
                    logger.error("liveness: the proxy's hub refused this host agent: %s", command.why)
                    self._released = True  # never act on a proxy that does not count this host
                    return "refused"
                case None if message.kind == "welcome":
                    self.welcomed.set()
                case None if message.kind == "fault":  # refused, unless a drill's hub gave this agent its handler
                    self._send(sock, "faulted", **self._faults.handle(message))

    def _snapshot(self, sock: Any, request: SnapshotRequest) -> None:
        """Take the snapshot of this host's ranks (the agent's own first) and send it as one
        ``snap`` message (stacks cut to fit the wire, which the records say)."""
        from ..diagnose._diagnosis import diagnose

        started = time.monotonic()
        with self._lock:
            counts = {rank: count for rank, (count, _at) in self._iterations.items()}
        try:
            diagnosis = diagnose([self.own, *self.identities], stacks=request.stacks, window_s=0.0,
                                 cpu_window_s=request.cpu_window_s, stacks_timeout_s=request.stacks_timeout_s,
                                 iterations=counts)
            ranks = encode_ranks(diagnosis.ranks, counts)
        except Exception as exc:  # the failure it is about has its one ERROR already
            logger.warning("liveness: the host agent's snapshot failed: %s", exc, exc_info=True)
            ranks = []
        elapsed = round((time.monotonic() - started) * 1000, 1)
        try:
            self._send(sock, "snap", req=request.req, el=elapsed, ranks=ranks)
        except ValueError as exc:  # over the wire's cap even with every stack cut: the ranks' states only
            logger.warning("liveness: this host's snapshot does not fit one message (%s); sent without its ranks", exc)
            self._send(sock, "snap", req=request.req, el=elapsed, ranks=[])

    def _changed_iterations(self) -> list[tuple[int, int, float]]:
        with self._lock:
            return [(rank, count, at) for rank, (count, at) in self._iterations.items()
                    if self._iterations_sent.get(rank) != count]

    def _poll_ms(self) -> int:
        """The loop's wait: a tick, or less when changed iterations are due sooner."""
        if self.welcomed.is_set() and self._changed_iterations():
            return max(0, min(int(_TICK_S * 1000), int((self._iterations_due - time.time()) * 1000) + 1))
        return int(_TICK_S * 1000)

    def _send_iterations(self, sock: Any) -> None:
        """The ranks' iterations that changed since the last message, at most one message per
        :attr:`AgentSettings.iterations_interval_s`, sent at the first instant of an interval of the wall clock
        (every host's agent then sends at about the same instant, its clock synchronized: the hub
        reads them in one wakeup, not one each); nothing when none changed."""
        wall = time.time()
        every = self.settings.iterations_interval_s
        if self._iterations_due - wall > every:  # the wall clock was stepped back: the interval starts again
            self._iterations_due = 0.0
        if wall < self._iterations_due:
            return
        changed = self._changed_iterations()[:_MAX_ITERATIONS_PER_MESSAGE]  # the rest in the next one
        if not changed:
            return
        for rank, count, _at in changed:
            self._iterations_sent[rank] = count
        self._iterations_due = (wall // every + 1) * every
        self.iteration_messages += 1
        now = time.monotonic()
        self._send(sock, "iters", it=[[rank, count, round(max(0.0, now - at), 3)] for rank, count, at in changed])

    def _stop_ranks(self, monitor: WorkerProcessMonitor, grace_s: float, kill_s: float) -> Any:
        from ..stop._bounded_stop import stop_processes

        self._quarantine.await_markers()  # a wedged rank's marker is on disk before anything here is stopped
        monitor.mark_expected_exits()
        targets = [identity for identity in self.identities if identity.start_time is not None]
        report = self._faults.after_stop(stop_processes(targets, grace_s=grace_s, kill_s=kill_s))  # a drill's: thaw
        self._quarantine.note(report.events())  # the ranks the stop left unkillable
        return report

    def _stop_requested(self, sock: Any, monitor: WorkerProcessMonitor, command: _wire.StopCommand) -> None:
        report = self._stop_ranks(monitor, command.grace_s, command.kill_s)
        self._send(sock, "report", req=command.req, stop=report.to_dict())

    def _proxy_lost(self, monitor: WorkerProcessMonitor, reason: str) -> None:
        self._ending = reason
        self._ending_set.set()
        try:
            report = self._stop_ranks(monitor, self.settings.grace_s, self.settings.kill_s)
        finally:
            self._stopped.set()
        left = [worker.pid for worker in report.unkillable]
        logger.critical("liveness: %s; this host's other ranks were stopped (%s)", reason,
                        f"unkillable: {left}" if left else "all gone")
