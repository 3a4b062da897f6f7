"""What the end of a remote host's session means for its ranks, and for a stop under way.

The hub (:mod:`._hub`) calls :func:`end_session` under its lock when an agent's connection ends and
applies the rank updates to the monitor there (its subscribers are called by the hub's delivery).

What ends a remote host's session, and what the proxy then reports, is docs/multihost.md's first
table: an ``event`` from its agent (the agent's own monitor), its connection **closed** (the
agent's rank reported dead, the host's other ranks lost), or **silent** (:mod:`._host_silence`;
the agent's side of a silence: :mod:`._agent`).
"""

from __future__ import annotations

import time

from .._events import WorkerState
from ._hub_records import Connection, HostOutcome, Session, Update
from ._tcp import Ending


def end_session(session: Session, ending: Ending, *, expecting: bool, stopping: bool, heartbeat_timeout_s: float,
                silent_s: float | None, corroboration: str) -> tuple[list[Update], float | None]:
    """End ``session`` (``connection`` and ``since`` set; ``stop`` set where a stop runs and the
    host has not reported): the updates for its ranks, and when the fault began for a silent host
    (else None). ``expecting``: a clean stop is under way; ``stopping``: the extension's own stop;
    ``corroboration``: what besides the silence made a silent host lost (its cause says it)."""
    session.since = time.monotonic()
    ranks = ", ".join(f"{r.rank} (pid {r.pid})" for r in session.ranks)
    agent = session.agent
    others = [r for r in session.ranks if r.rank != agent.rank]
    fault_at = None
    if session.stop is not None and session.stop.outcome is HostOutcome.STOPPED:
        session.connection = Connection.STOPPED
        stuck = {rank: text for rank, _pid, text in session.stop.unkillable}
        return [(agent, WorkerState.EXITED_EXPECTED, f"ended after its host's stop, as asked (agent on host "
                 f"{session.host})")] + [
            (r, WorkerState.UNKILLABLE, f"{stuck[r.rank]} (reported by the agent on host {session.host})")
            if r.rank in stuck else
            (r, WorkerState.EXITED_EXPECTED, f"stopped by its host's agent (host {session.host})")
            for r in others], None
    if ending.is_silence:
        session.connection = Connection.LOST
        silent = silent_s if silent_s is not None else heartbeat_timeout_s
        why = ("its host still acknowledges, its process sends nothing: the agent's rank is stuck"
               if ending is Ending.MUTE else "the host lost or cut off, or the agent's rank stuck")
        cause = (f"no heartbeat from host {session.host}'s agent (rank {agent.rank}, pid {agent.pid}) for "
                 f"{silent:.2f} s ({why}){' ' + corroboration if corroboration else ''}; unreachable ranks: {ranks}")
        updates = [(identity, WorkerState.LOST, cause) for identity in (agent, *others)]
        fault_at = time.monotonic() - silent
    elif stopping or expecting:
        # A stop: the agent's rank ended with it (its connection closed); with the extension's own
        # stop, before its report said what became of the host's other ranks.
        session.connection = Connection.CLOSED
        closed = f"ended with the stop (host {session.host}; its agent's connection closed)"
        unverified = (f"not verified stopped: host {session.host}'s agent (rank {agent.rank}, pid {agent.pid}) ended "
                      "before its stop report")
        updates = [(agent, WorkerState.EXITED_EXPECTED, closed)] + [
            (r, WorkerState.LOST, unverified) if stopping else (r, WorkerState.EXITED_EXPECTED, closed) for r in others]
    else:
        session.connection = Connection.CLOSED
        how = "closed (FIN/RST)" if ending is Ending.CLOSED else "ended"
        gone = (f"host {session.host}'s agent (rank {agent.rank}, pid {agent.pid}) is gone: this rank is no "
                f"longer watched (ranks of the host: {ranks})")
        updates = [(agent, WorkerState.EXITED, f"its connection to the proxy {how}: the process exited or its host "
                    f"went down (it hosted host {session.host}'s agent)"),
                   *[(identity, WorkerState.LOST, gone) for identity in others]]
    if session.stop is None and stopping:
        session.stop = session.host_stop(HostOutcome.LOST, f"connection {session.connection} before its report")
    return updates, fault_at
