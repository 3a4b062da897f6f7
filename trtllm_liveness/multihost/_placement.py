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
from collections.abc import Callable, Sequence
from typing import Any

from ..process._identity import ProcessIdentity, capture_identity, coerce_identity
from ._agent import AgentSettings, HostAgent

logger = logging.getLogger(__name__)

HostKey = tuple[str, str, "int | None"]


def plan(everyone: Sequence[tuple[ProcessIdentity, str]], rank: int,
         proxy_host: HostKey | None) -> tuple[ProcessIdentity, list[ProcessIdentity]] | None:
    """(this rank's identity, the host's other ranks) when ``rank`` runs its host's agent, else None."""
    host = _host_ranks(everyone, rank, proxy_host)
    return (host[0], host[1:]) if host and host[0].rank == rank else None


def _host_ranks(everyone: Sequence[tuple[ProcessIdentity, str]], rank: int,
                proxy_host: HostKey | None) -> list[ProcessIdentity] | None:
    """The ranks of ``rank``'s host by rank, its own among them (None on the proxy's host, or unknown)."""
    mine = next(((identity, boot) for identity, boot in everyone if identity.rank == rank), None)
    if mine is None:
        return None
    key: HostKey = (mine[0].hostname, mine[1], mine[0].pid_namespace)
    if proxy_host is not None and _same_host(key, proxy_host):
        return None
    return sorted((identity for identity, boot in everyone
                   if _same_host((identity.hostname, boot, identity.pid_namespace), key)), key=lambda found: found.rank)


def _same_host(a: HostKey, b: HostKey) -> bool:
    # A boot id unknown on one side ("") is not held against it; hostname and namespace still decide.
    return a[0] == b[0] and a[2] == b[2] and (not a[1] or not b[1] or a[1] == b[1])


BeatsOpener = Callable[[HostAgent], "tuple[str, str] | None"]
"""Opens a host agent's local progress channel, feeding :meth:`HostAgent.note_iteration`; returns
its ``(address, token)`` (None: none)."""


def start_for_rank(settings: AgentSettings, comm: Any, proxy_host: HostKey | None, *,
                   open_beats: BeatsOpener | None = None) -> tuple[HostAgent | None, tuple[str, str] | None]:
    """Every rank of the session calls this (one ``allgather`` on ``comm``, two with
    ``open_beats``); the lowest rank of each host other than the proxy's (``proxy_host``: its
    hostname, boot id and PID namespace; None: unknown) starts that host's agent.
    Returns ``(the agent this rank runs or None, where this rank reports its iterations: its host
    agent's channel's (address, token), None on the proxy's host or without ``open_beats``)``.
    ``settings`` come from the hub (:meth:`~._hub.AgentHub.agent_settings`, in the proxy), checked
    on the rank before."""
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
    host = _host_ranks(everyone, rank, proxy_host)  # its first rank runs this host's agent
    found = channels[host[0].rank] if host and 0 <= host[0].rank < len(channels) else None
    if isinstance(found, (list, tuple)) and len(found) == 2 and all(isinstance(part, str) for part in found):
        return agent, (found[0], found[1])
    return agent, None
