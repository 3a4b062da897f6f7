"""Which rank of each host runs its agent, decided by every rank alike from one ``allgather``.

Each rank contributes its identity and its kernel's boot id; ranks with the same (hostname, boot
id, PID namespace) share a host. The proxy's host needs no agent (the proxy's own monitor watches
its ranks through pidfds). On every other host the lowest rank runs the agent, over the host's
other ranks: the choice needs no further message and every rank makes the same one. With stall
detection, a second ``allgather`` tells every rank where its host's agent takes the host's executor
iterations (the agent's own local progress channel): the proxy's channel is local IPC, out of
reach of another host.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..process._identity import ProcessIdentity, capture_identity, coerce_identity
from ._agent import AgentSettings, HostAgent
from ._hub_snapshots import ITERATIONS_INTERVAL_S
from ._wire import parse_secret

logger = logging.getLogger(__name__)

HostKey = tuple[str, str, "int | None"]


def plan(everyone: Sequence[tuple[ProcessIdentity, str]], rank: int,
         proxy_host: HostKey | None) -> tuple[ProcessIdentity, list[ProcessIdentity]] | None:
    """(this rank's identity, the host's other ranks) when ``rank`` runs its host's agent, else None."""
    mine = next(((identity, boot) for identity, boot in everyone if identity.rank == rank), None)
    if mine is None:
        return None
    me, boot = mine
    key: HostKey = (me.hostname, boot, me.pid_namespace)
    if proxy_host is not None and _same_host(key, proxy_host):
        return None
    host = [identity for identity, other in everyone if _same_host((identity.hostname, other, identity.pid_namespace),
                                                                     key)]
    if min(identity.rank for identity in host) != rank:
        return None
    return me, sorted((identity for identity in host if identity.rank != rank), key=lambda identity: identity.rank)


def host_agent_rank(everyone: Sequence[tuple[ProcessIdentity, str]], rank: int,
                    proxy_host: HostKey | None) -> int | None:
    """The rank that runs the agent of ``rank``'s host (None on the proxy's host, or unknown)."""
    mine = next(((identity, boot) for identity, boot in everyone if identity.rank == rank), None)
    if mine is None:
        return None
    key: HostKey = (mine[0].hostname, mine[1], mine[0].pid_namespace)
    if proxy_host is not None and _same_host(key, proxy_host):
        return None
    return min(identity.rank for identity, boot in everyone
               if _same_host((identity.hostname, boot, identity.pid_namespace), key))


def _same_host(a: HostKey, b: HostKey) -> bool:
    # A boot id unknown on one side ("") is not held against it; hostname and namespace still decide.
    return a[0] == b[0] and a[2] == b[2] and (not a[1] or not b[1] or a[1] == b[1])


def settings_of(spec: Mapping[str, Any]) -> AgentSettings:
    """The proxy's ``worker_spec`` as agent settings. Raises ``ValueError`` for a malformed one."""
    from ..quarantine._quarantine_settings import QuarantineSettings

    endpoint, timeout = spec.get("endpoint"), spec.get("heartbeat_timeout_s")
    if not isinstance(endpoint, str) or not endpoint.startswith("tcp://") or len(endpoint) > 300:
        raise ValueError(f"bad hub endpoint {endpoint!r}")
    if not isinstance(timeout, (int, float)) or not 0.01 <= timeout <= 3600:
        raise ValueError(f"bad heartbeat timeout {timeout!r}")
    d = spec.get("d_state_timeout_s")
    grace, kill, scan = spec.get("grace_s", 2.0), spec.get("kill_s", 3.0), spec.get("scan_interval_s", 1.0)
    every = spec.get("iterations_interval_s", ITERATIONS_INTERVAL_S)
    ceiling = spec.get("heartbeat_ceiling_s", 60.0)
    return AgentSettings(endpoint, parse_secret(spec.get("secret")), float(timeout),
                         float(d) if isinstance(d, (int, float)) and d > 0 else None,
                         scan_interval_s=float(scan) if isinstance(scan, (int, float)) and 0.01 <= scan <= 60 else 1.0,
                         grace_s=float(grace) if isinstance(grace, (int, float)) else 2.0,
                         kill_s=float(kill) if isinstance(kill, (int, float)) else 3.0,
                         iterations_interval_s=float(every) if isinstance(every, (int, float))
                         and ITERATIONS_INTERVAL_S <= every <= 3600 else ITERATIONS_INTERVAL_S,
                         heartbeat_ceiling_s=float(ceiling) if isinstance(ceiling, (int, float))
                         and timeout <= ceiling <= 86400 else max(60.0, float(timeout)),
                         observe=spec.get("observe") is True,
                         quarantine=QuarantineSettings.from_spec(spec.get("quarantine")))


BeatsOpener = Callable[[HostAgent], "tuple[str, str] | None"]
"""Opens a host agent's local progress channel, feeding :meth:`HostAgent.note_iteration`; returns
its ``(address, token)`` (None: none)."""


def start_for_rank(settings: AgentSettings, comm: Any, proxy: Sequence[Any] | None, *,
                   open_beats: BeatsOpener | None = None) -> tuple[HostAgent | None, tuple[str, str] | None]:
    """Every rank of the session calls this (one ``allgather`` on ``comm``, two with
    ``open_beats``); the lowest rank of each host other than the proxy's starts that host's agent.
    Returns ``(the agent this rank runs or None, where this rank reports its iterations: its host
    agent's channel's (address, token), None on the proxy's host or without ``open_beats``)``.
    ``settings`` come from the hub's spec (:func:`settings_of`, in the proxy), checked on the rank
    before."""
    from ..process._procfs import boot_id

    rank = comm.Get_rank()
    try:
        mine: list[Any] | None = [list(capture_identity(rank)), boot_id()]
    except Exception:
        logger.warning("liveness: rank %d could not capture its identity; its host may go unwatched", rank,
                       exc_info=True)
        mine = None
    gathered = comm.allgather(mine)  # every rank takes part, also one whose capture failed
    everyone = [(coerce_identity(entry[0], index), str(entry[1])) for index, entry in enumerate(gathered)
                if entry is not None]
    proxy_host: HostKey | None = None
    if proxy is not None and len(proxy) >= 4:
        proxy_host = (str(proxy[2]), str(proxy[4]) if len(proxy) > 4 else "",
                      proxy[3] if isinstance(proxy[3], int) else None)
    chosen = plan(everyone, rank, proxy_host)
    agent: HostAgent | None = None
    if chosen is not None:
        me, others = chosen
        logger.info("liveness: rank %d runs host %s's agent over ranks %s, reporting to %s", rank, me.hostname,
                    [identity.rank for identity in others], settings.endpoint)
        try:
            agent = HostAgent(settings, me, others).start()
        except Exception:  # this rank still takes part in the collective below: the others wait in it
            logger.warning("liveness: host %s's agent could not start: its ranks go unwatched", me.hostname,
                           exc_info=True)
    if open_beats is None:
        return agent, None
    beats: tuple[str, str] | None = None
    if agent is not None:
        try:
            beats = open_beats(agent)
        except Exception:
            logger.warning("liveness: host %s's agent could not open its progress channel: its ranks' iterations "
                           "are not counted", agent.own.hostname, exc_info=True)
    channels = comm.allgather(beats)  # every rank takes part, also where the channel failed
    agent_rank = host_agent_rank(everyone, rank, proxy_host)
    found = channels[agent_rank] if agent_rank is not None and 0 <= agent_rank < len(channels) else None
    if isinstance(found, (list, tuple)) and len(found) == 2 and all(isinstance(part, str) for part in found):
        return agent, (found[0], found[1])
    return agent, None
