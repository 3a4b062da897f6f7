"""The engine's side of multi-host liveness: when to run an agent hub, and its part in shutdown.

A session whose ranks ``mpirun``/``srun`` launched (``MpiCommSession``, ``RemoteMpiCommSessionClient``)
may span hosts; upstream's monitor skips every rank of another host. With ``hosts=auto`` (the
default) such an engine runs an :class:`~trtllm_liveness.multihost.AgentHub`; its settings travel
to every rank with the task (``hub`` of the :class:`~._worker_spec.WorkerSpec`), as upstream's HMAC
key does, and the lowest rank of each other host runs that host's agent. With ``hosts=on`` every session gets one
(a spawned pool placed on other hosts), with ``off`` none. pyzmq is imported only then.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import TYPE_CHECKING, Any

from ..._config import HostsMode, LivenessConfig
from ...exit._process_ending import OwnedThreads
from ...monitor._monitor import WorkerProcessMonitor
from ._features import upstream_skips_registration

if TYPE_CHECKING:  # pyzmq and the hub are imported only where an engine runs one
    from ...monitor._progress_clock import ProgressClock
    from ...multihost._hub import AgentHub
    from ...multihost._hub_records import HostStop
    from ._state import EngineLiveness


logger = logging.getLogger(__name__.rpartition(".")[0])


def wants_hub(config: LivenessConfig, session: Any) -> bool:
    if config.hosts is HostsMode.OFF:
        return False
    return config.hosts is HostsMode.ON or (upstream_skips_registration(session) and not single_host_launch())


ITERATIONS_INTERVAL_MAX_S = 15.0


def iterations_interval_s(config: LivenessConfig) -> float:
    """How often each remote host's agent forwards its ranks' iterations while progress flows: an
    eighth of the stall timeout (the stall timer then hears of remote progress within an eighth of
    its bound), between once a second and once per :data:`ITERATIONS_INTERVAL_MAX_S`; the latter
    without a stall timer (the snapshot of a fatal verdict asks every host for fresh counts)."""
    if config.stall_timeout_s <= 0:
        return ITERATIONS_INTERVAL_MAX_S
    return min(ITERATIONS_INTERVAL_MAX_S, max(1.0, config.stall_timeout_s / 8))


_hub_class: type[AgentHub] | None = None  # set by use_hub_class


def use_hub_class(kind: type[AgentHub]) -> None:
    """Every agent hub this process starts from now on is a ``kind``: a drill's engine process sets its
    own (in-process: no setting or variable turns a server's agents into fault injectors)."""
    global _hub_class
    _hub_class = kind


def start_hub(config: LivenessConfig, monitor: WorkerProcessMonitor,
              progress: ProgressClock | None = None) -> AgentHub | None:
    """A started hub, or None (logged) when it cannot bind: the engine then runs without it.
    ``progress``: the engine's, the second signal that makes a silent host lost."""
    from ...multihost import AgentHub
    from ...quarantine._quarantine_settings import QuarantineSettings

    bind, advertise = config.hosts_bind, config.hosts_advertise
    if not bind:
        bind, advertise = default_bind(advertise)
    kind = _hub_class or AgentHub  # a drill's engine's own hub (use_hub_class)
    hub = kind(monitor, bind=bind, port=config.hosts_port, advertise=advertise or None,
               heartbeat_timeout_s=config.heartbeat_timeout_s, d_state_timeout_s=config.d_state_timeout_s or None,
               scan_interval_s=config.scan_interval_s, grace_s=config.shutdown_term_s, kill_s=config.shutdown_kill_s,
               iterations_interval_s=iterations_interval_s(config), heartbeat_ceiling_s=config.heartbeat_ceiling_s,
               progress=progress, observe=config.observe, quarantine=QuarantineSettings.from_config(config))
    try:
        return hub.start()
    except Exception:
        hub.close()
        logger.error("liveness: could not start the agent hub (hosts_bind=%r, hosts_port=%d): ranks on other hosts "
                     "are not watched", bind, config.hosts_port, exc_info=True)
        return None


def connect_hub(state: EngineLiveness, hub: AgentHub) -> None:
    """Feed the engine's stall timer the remote ranks' iterations, its stall naming their thread
    states, and its diagnoses every host's snapshot (:meth:`~trtllm_liveness.multihost.AgentHub.snapshot`)."""
    if state.stall is not None:
        # At a stall the naming waits for the remote hosts' thread states (a scan each: no stacks,
        # no CPU window) as long as a fatal snapshot may, so a stopped or D rank on another host is
        # named as one on this host is.
        stall, bound = state.stall, state.config.diagnosis_before_stop_hosts_s
        hub.feed_iterations(stall.note_remote_iteration)
        stall.remote_states = lambda: {rank.rank: rank for host in hub.snapshot(bound, cpu_window_s=0.0, stacks=False)
                                       for rank in host.ranks}
    if state.diagnoser is not None:
        state.diagnoser.remote = hub.snapshot
        state.diagnoser.remote_bound_s = state.config.diagnosis_before_stop_hosts_s


def default_bind(advertise: str) -> tuple[str, str]:
    """(bind, advertise) without ``hosts_bind``: the address this host's name resolves to, where the
    ranks will look for it. Where it resolves to loopback (Debian's ``127.0.1.1 <hostname>``, a
    container's ``/etc/hosts``), no remote rank could connect there: then every interface, with a
    WARNING, and the name advertised."""
    import ipaddress
    import socket

    from ...process._identity import local_hostname

    name = local_hostname()
    try:
        address = socket.gethostbyname(name)
    except OSError:
        address = ""
    if address and not ipaddress.ip_address(address).is_loopback:
        return address, advertise or name
    logger.warning("liveness: this host's name %r resolves to %s: the agent hub binds every interface ('*'); set "
                   "hosts_bind to the cluster network's address to bind only there", name, address or "nothing")
    return "*", advertise or name


_SIGNALS_OF = {"exited-after-term": "SIGTERM", "exited-after-kill": "SIGTERM+SIGKILL"}


def stop_remote_hosts(hub: AgentHub, config: LivenessConfig, threads: OwnedThreads
                      ) -> tuple[threading.Thread | None, list[HostStop]]:
    """Ask every remote agent to stop its host's ranks, in a thread of ``threads`` (the engine's;
    the local stop runs meanwhile); the list fills with the
    :class:`~trtllm_liveness.multihost.HostStop` reports when it ends."""
    from ...multihost._hub_records import HostOutcome

    reports: list[HostStop] = []
    bound = config.shutdown_term_s + config.shutdown_kill_s + 1.0

    def run() -> None:
        try:
            reports.extend(hub.stop_hosts(bound))
        except Exception:
            logger.warning("liveness: stopping the remote hosts' ranks failed", exc_info=True)
        for report in reports:
            log = logger.error if report.outcome is not HostOutcome.STOPPED or report.unkillable else logger.info
            log("liveness: host %s (agent rank %d): %s%s%s", report.host, report.agent_rank, report.outcome,
                f"; unkillable: {[item[2] for item in report.unkillable]}" if report.unkillable else "",
                f"; {report.detail}" if report.detail else "")
            for rank, pid, outcome in report.stopped:  # what the extension ended itself: INFO, once
                signals = _SIGNALS_OF.get(outcome)
                if signals is not None:  # as the local stop's lines (log_stopped)
                    logger.info("liveness: stopped rank %d (pid %d) on host %s: %s, exited", rank, pid, report.host,
                                signals)

    return threads.start(run, name="trtllm-liveness-remote-stop", bound_s=bound + 1.0), reports


def single_host_launch() -> bool:
    """Whether the launcher says every rank runs on this host (mpirun's or Slurm's environment in
    the proxy's process): then no agent is needed, and ``hosts=auto`` starts no hub."""
    env = os.environ
    local, world = env.get("OMPI_COMM_WORLD_LOCAL_SIZE"), env.get("OMPI_COMM_WORLD_SIZE")
    if local is not None and local == world:
        return True
    return env.get("SLURM_STEP_NUM_NODES", env.get("SLURM_NNODES")) == "1"
