"""Multi-host liveness: a per-host agent in the ranks and one hub in the proxy.

- :class:`AgentHub` (proxy side, :mod:`._hub`): binds where the ranks can reach, merges every
  remote host's ranks into the engine's monitor and its fatal path, reports lost hosts, stops
  remote ranks through their own host's agent;
- :class:`HostAgent` (rank side, :mod:`._agent`): one per remote host, in its lowest rank
  (:mod:`._placement`), watching that host's ranks with the core monitor;
- :mod:`._host_silence`: what a host's silence means (suspect; lost only with the engine's progress
  stopped too, or past the ceiling);
- :mod:`._agent_quarantine`: a rank of that host that cannot be ended quarantines that host, by
  its own agent (its marker, the actions for its own node), never the proxy's;
- :mod:`._hub_records`: the hub's result types, sessions and checks of each agent message;
  :mod:`._hub_endings`: what a session's end means; :mod:`._hub_delivery`: remote events to the
  monitor's subscribers off the hub's thread;
- :mod:`._agent_faults`: an agent refuses its hub's fault requests (a drill's hub hands its own handler);
- :mod:`._wire`: the authenticated messages between them; :mod:`._channel`: each end's socket, its
  monitor and wake pipe, and its count of bad input; :mod:`._tcp`: why a connection ended.

Needs ``pyzmq`` (the ``mpi`` extra). Imported only when a session may have remote ranks.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ._agent import AgentSettings, HostAgent
    from ._hub import AgentHub
    from ._hub_records import HostStop, HostView

__all__ = ["AgentHub", "AgentSettings", "HostAgent", "HostStop", "HostView"]

_SOURCES = {
    "._agent": ("AgentSettings", "HostAgent"),
    "._hub": ("AgentHub",),
    "._hub_records": ("HostStop", "HostView"),
}

if not TYPE_CHECKING:
    from .._lazy import lazy_exports

    __getattr__, __dir__ = lazy_exports(__name__, _SOURCES, globals())
