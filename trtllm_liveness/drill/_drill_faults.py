"""A drill's fault in a rank of another host: asked by the proxy's hub, made by that host's agent.

docs/drill.md ("Across hosts") tells the round trip, each fault and the clean-up; these are its
parts. The engine asks its :class:`DrillHub` (:meth:`DrillHub.inject_fault`), the hub sends one
``fault`` request to the agent of the rank's host, and that agent (:class:`AgentFaults`) makes the
fault and answers ``faulted`` (how long ago: the hub turns that into its own monotonic time, as it
does for events).

Only a drill's engine process makes its engine's hub a :class:`DrillHub` (``use_hub_class``), which
alone gives its agents :class:`AgentFaults`; other agents refuse every fault (multihost/_agent_faults.py),
a drill's agent a rank it does not watch (its own included: it could not report, nor thaw itself).

Clean-up is the agent's, after its stop of its host's ranks: :meth:`AgentFaults.after_stop`; its
thread's end releases the group too. Every wait here is bounded.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import logging
import os
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from .._record_fields import JsonRecord
from ..multihost import _wire
from ..multihost._agent_faults import FAULT_SIGNALS, FAULTS, FaultHandler
from ..multihost._hub import AgentHub
from ..multihost._hub_records import Connection
from ..process import _pidfd
from ..process._identity import ProcessIdentity

if TYPE_CHECKING:
    from ..multihost._hub_records import Session
    from ..stop._stop_report import StopReport

logger = logging.getLogger(__name__)

__all__ = ["FAULTS", "AgentFaults", "DrillHub", "FaultReply", "FaultRequest"]

_FREEZE_S = 2.0  # the agent's thread waits at most this long for FROZEN
_FREEZER_PREFIX = "trtllm-liveness-drill-agent"  # the local drill's groups are trtllm-liveness-drill-*
_AFTER_THAW_KILL_S = 3.0
_GUARD_WAIT_S = 2.0


@dataclass(frozen=True)
class FaultRequest:
    """Hub -> agent: make ``fault`` in ``rank`` (one of the agent's host's ranks); ``req`` numbers it."""

    req: int
    rank: int
    fault: str

    @classmethod
    def parse(cls, message: _wire.Message) -> FaultRequest:
        """The request in an authenticated message. Raises ``WireError`` (multihost/_wire.py)."""
        fault = _wire.field(message, "fault", str, max_len=16)
        if fault not in FAULTS:
            raise _wire.WireError(f"fault: unknown fault {fault!r}")
        return cls(_wire.field(message, "req", int, low=1, high=1 << 62),
                   _wire.field(message, "rank", int, low=0, high=1 << 24), fault)


@dataclass(frozen=True)
class FaultReply(JsonRecord):
    """What became of one fault request. ``outcome``: ``injected`` (made, ``at`` is when, on the
    proxy's monotonic clock), ``refused`` (not a drill, not a rank the agent watches, or the fault
    is not available on that host: ``detail`` says which), ``failed`` (the rank is gone or its pid
    was reused, or the freezer failed), ``no-answer`` (nothing from the agent within the bound).
    ``to_dict()`` is what the drill's engine prints."""

    req: int
    rank: int
    fault: str
    outcome: str
    host: str
    pid: int = 0
    detail: str = ""
    at: float | None = None

    @property
    def injected(self) -> bool:
        return self.outcome == "injected"

    @classmethod
    def parse(cls, host: str, message: _wire.Message) -> FaultReply:
        """The reply in an authenticated message from ``host``'s agent. Raises ``WireError`` (multihost/_wire.py)."""
        outcome = _wire.field(message, "outcome", str, max_len=16)
        if outcome not in ("injected", "refused", "failed"):
            raise _wire.WireError(f"faulted: unknown outcome {outcome!r}")
        age = _wire.field(message, "age", float, low=0, high=1e7) if outcome == "injected" else message.body.get("age")
        return cls(_wire.field(message, "req", int, low=1, high=1 << 62),
                   _wire.field(message, "rank", int, low=0, high=1 << 24),
                   _wire.field(message, "fault", str, max_len=16), outcome, host,
                   _wire.field(message, "pid", int, low=0, high=1 << 30),
                   _wire.field(message, "detail", str, max_len=2000),
                   None if age is None else time.monotonic() - float(age))


def _start_guard(group: str) -> subprocess.Popen[bytes]:
    """The freezer group's guard (``python -I demo/_cgroup_faults.py GROUP``: standard library only,
    nothing of the rank's), in a session of its own: a launcher that ends the rank's process group
    or session leaves it to thaw what the agent froze. Started before the group is made; at EOF on
    its stdin (the agent released the group, or its process ended, however) it thaws and removes
    the group, bounded."""
    from ..demo import _cgroup_faults

    return subprocess.Popen([sys.executable, "-I", _cgroup_faults.__file__, group], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            close_fds=True)


class AgentFaults(FaultHandler):
    """A drill's agent's fault handler: check a fault request, verify the rank on this host, make
    the fault, and undo what can be undone (:meth:`release`). Used by the agent's thread only."""

    _freezer: Any = None  # this agent's freezer group (demo/_cgroup_faults.py), made by its first wedge
    _guard: subprocess.Popen[bytes] | None = None  # the group's guard process (_start_guard)

    def handle(self, message: _wire.Message) -> dict[str, Any]:
        """The ``faulted`` answer's fields for one ``fault`` message (never raises)."""
        req, rank, fault = (message.body.get(key) for key in ("req", "rank", "fault"))
        host = self.own.hostname
        try:
            request = FaultRequest.parse(message)
        except _wire.WireError as exc:
            self.rejected.note(host, str(exc))
            return self._answer(req, rank, fault, "refused", f"malformed fault request: {exc}")
        answer = functools.partial(self._answer, request.req, request.rank, request.fault)
        victim = self.identities.get(request.rank)
        if victim is None or victim.start_time is None:
            why = ("the agent's own rank (it reports the fault; hit another rank of its host)"
                   if request.rank == self.own.rank else "not a rank this agent watches")
            return answer("refused", f"rank {request.rank} on host {host}: {why} (hittable: {sorted(self.identities)})")
        if request.fault == "wedge":
            from ..demo._cgroup_faults import freezer_available

            reason = freezer_available()
            if reason is not None:
                return answer("refused", f"wedge not available on host {host}: {reason}", pid=victim.pid)
        try:
            at = self._inject(request.fault, victim)
        except Exception as exc:  # the rank is gone, its pid was reused, or the freezer failed
            logger.warning("liveness: the drill's %s of rank %d (pid %d) on host %s failed: %s", request.fault,
                           victim.rank, victim.pid, host, exc)
            return answer("failed", f"{type(exc).__name__}: {exc}", pid=victim.pid)
        logger.info("liveness: drill: %s of rank %d (pid %d) on host %s, verified by its pidfd", request.fault,
                    victim.rank, victim.pid, host)
        what = {"kill": "SIGKILL sent", "stop": "SIGSTOP sent",
                "wedge": f"frozen in D by the cgroup v1 freezer ({self._freezer.path if self._freezer else '?'})"}
        return answer("injected", f"{what[request.fault]} through a pidfd verified against its start time",
                      pid=victim.pid, age=max(0.0, time.monotonic() - at))

    def _inject(self, fault: str, victim: ProcessIdentity) -> float:
        fd = _pidfd.open_verified_pidfd(victim.pid, victim.start_time)
        try:
            if fault != "wedge":
                at = time.monotonic()
                if not _pidfd.send_signal(fd, FAULT_SIGNALS[fault]):
                    raise ProcessLookupError(f"rank {victim.rank} (pid {victim.pid}) exited before the signal")
                return at
            from ..demo._cgroup_faults import FREEZER_ROOT, FreezerGroup

            if self._freezer is None:  # the guard first: from the group's making on, this process may end anywhere
                name = f"{_FREEZER_PREFIX}-{uuid.uuid4().hex[:12]}"
                self._guard = _start_guard(os.path.join(FREEZER_ROOT, name))
                try:
                    self._freezer = FreezerGroup(name=name)
                except OSError:
                    self.release()
                    raise
            at = time.monotonic()
            frozen = self._freezer.freeze([victim.pid], timeout=_FREEZE_S)
            if _pidfd.is_exited(fd):  # the pid may have named another process by the time it was added
                self.release()
                raise ProcessLookupError(f"rank {victim.rank} (pid {victim.pid}) exited before it was frozen")
            if not frozen:
                self.release()
                raise OSError(f"the freezer group did not reach FROZEN within {_FREEZE_S:g} s")
            return at
        finally:
            os.close(fd)

    def after_stop(self, report: StopReport) -> StopReport:
        """The agent's stop of its host's ranks is over: ``report`` is what a server's would be (a
        frozen rank unkillable), and goes to the hub as it is. Then the drill's own clean-up: thaw
        (a frozen rank's pending SIGKILL then ends it) and SIGKILL, bounded and by verified pidfd,
        whatever the stop left."""
        if self._freezer is None:
            return report
        self.release()
        left = [self.identities[worker.rank] for worker in report.unkillable if worker.rank in self.identities]
        if left:
            from ..stop._bounded_stop import stop_processes

            again = stop_processes(left, grace_s=0.0, kill_s=_AFTER_THAW_KILL_S)
            logger.info("liveness: drill: thawed ranks %s on host %s after the stop (%s)", [i.rank for i in left],
                        self.own.hostname, f"still there: {[w.pid for w in again.unkillable]}" if again.unkillable
                        else "all gone")
        return report

    def release(self) -> None:
        """Thaw and remove the freezer group, if any (bounded; never raises)."""
        freezer, self._freezer = self._freezer, None
        if freezer is not None:
            with contextlib.suppress(Exception):
                freezer.remove(timeout=5.0)
        guard, self._guard = self._guard, None
        if guard is not None:  # its group is gone: it finds nothing to do and ends
            with contextlib.suppress(Exception):
                assert guard.stdin is not None
                guard.stdin.close()
                guard.wait(_GUARD_WAIT_S)


class DrillHub(AgentHub):
    """The agent hub of a drill's engine: an :class:`~trtllm_liveness.multihost.AgentHub` whose
    agents make the faults it asks for (:class:`AgentFaults`), and which can ask one of them for a
    fault (:meth:`inject_fault`)."""

    agent_faults = AgentFaults

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._fault_ids = itertools.count(1)
        self._fault_out: collections.deque[tuple[str, FaultRequest]] = collections.deque()
        self._fault_waiting: set[int] = set()
        self._fault_replies: dict[int, FaultReply] = {}
        self._handlers["faulted"] = self._reply_locked

    def inject_fault(self, rank: int, fault: str, timeout_s: float) -> FaultReply:
        """Ask the agent of ``rank``'s host to make ``fault`` in it; wait at most ``timeout_s`` for
        its answer. Never raises for what the agent does."""
        if fault not in FAULTS:
            raise ValueError(f"fault must be one of {FAULTS}, got {fault!r}")
        with self._cond:
            session = next((s for s in self._sessions.values() if s.connection is Connection.CONNECTED
                            and any(identity.rank == rank for identity in s.ranks)), None)
            if session is None:
                hosts = {s.host: sorted(r.rank for r in s.ranks) for s in self._sessions.values()
                         if s.connection is Connection.CONNECTED}
                return FaultReply(0, rank, fault, "refused", "?", detail=f"rank {rank} is not a rank of a connected "
                                  f"remote host (connected: {hosts or 'none'})")
            request = FaultRequest(next(self._fault_ids), rank, fault)
            self._fault_waiting.add(request.req)
            self._fault_out.append((session.sid, request))
        self._wake()
        with self._cond:
            try:
                self._cond.wait_for(lambda: request.req in self._fault_replies or self._closing, max(0.0, timeout_s))
                reply = self._fault_replies.pop(request.req, None)
            finally:
                self._fault_waiting.discard(request.req)
        if reply is None:
            return FaultReply(request.req, rank, fault, "no-answer", session.host,
                              detail=f"no answer from host {session.host}'s agent within {timeout_s:g} s")
        return reply

    def _flush_commands_locked(self) -> None:
        while self._fault_out:
            sid, request = self._fault_out.popleft()
            session = self._sessions.get(sid)
            if session is not None and session.connection is Connection.CONNECTED:
                self._send(session, "fault", **asdict(request))
        super()._flush_commands_locked()

    def _reply_locked(self, session: Session, message: _wire.Message) -> None:
        reply = FaultReply.parse(session.host, message)
        if reply.req not in self._fault_waiting:
            raise _wire.WireError(f"faulted: no request {reply.req} is waiting")
        log = logger.info if reply.injected else logger.warning
        log("liveness: drill: host %s's agent: %s of rank %d (pid %d): %s: %s", session.host, reply.fault, reply.rank,
            reply.pid, reply.outcome, reply.detail)
        self._fault_replies[reply.req] = reply
        self._cond.notify_all()
