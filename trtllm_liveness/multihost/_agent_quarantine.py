"""A remote host's quarantine, made by that host's agent for its own ranks.

A non-restartable event of a rank on another host than the proxy's (a wedge; a rank the agent's
stop leaves unkillable) quarantines that host, and only it (docs/multihost.md, "A wedged remote
rank quarantines its own host"). With the settings the proxy handed it
(:class:`~trtllm_liveness.quarantine._quarantine_settings.QuarantineSettings`, in
:attr:`~._agent.AgentSettings.quarantine`), :class:`HostQuarantine` calls the quarantine's own
:func:`~trtllm_liveness.quarantine._host_policy.quarantine_host` here: the marker in this host's
``quarantine_dir``, then the actions for this host's node, in a thread of the rank's process
ending (which :func:`~._agent.end_rank` awaits, each action bounded).

The marker comes first: the agent sends a wedge's event to the hub, and stops any rank, only once
the marker is written (:meth:`HostQuarantine.await_markers`, at most :data:`MARKER_WAIT_S`). In
observe mode, and in a drill's engine, it only says what it would do.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .._events import WorkerEvent

if TYPE_CHECKING:  # the quarantine itself is imported where a rank of this host fails for good
    from ..quarantine._quarantine_settings import QuarantineSettings

logger = logging.getLogger(__name__)

MARKER_WAIT_S = 2.0
"""How long the agent waits at most for this host's quarantine marker before it sends the wedge's
event or stops a rank (a few local file operations; a stuck file system must not hold the agent)."""


class HostQuarantine:
    """This host's quarantine for its agent (see the module docstring). Thread-safe: the monitor's
    delivery notes events, the agent's thread awaits the markers and notes its stop's report.

    ``policy``: the settings (None: the proxy quarantines no host for this agent); ``dry_run``:
    why the agent only says what it would do (``"observe=1"``, ``"a drill's engine"``), or ""."""

    def __init__(self, hostname: str, policy: QuarantineSettings | None, dry_run: str = "") -> None:
        self.hostname = hostname
        self.policy = policy
        self.dry_run = dry_run
        self._lock = threading.Lock()
        self._markers: list[threading.Event] = []  # the markers whose writes started, not yet awaited

    def note(self, events: Sequence[WorkerEvent]) -> None:
        """Quarantine this host for the non-restartable ``events`` of its ranks: the marker's write
        starts now, in a thread of the process's ending. Never blocks; never raises."""
        policy = self.policy
        failed = [event for event in events if not event.restartable]
        if policy is None or not failed:
            return
        if self.dry_run:
            self._say_what_it_would_do(policy, failed)
            return
        try:
            from ..quarantine._host_policy import quarantine_host

            written = threading.Event()
            if quarantine_host(policy, failed, marker_done=written) is not None:
                with self._lock:
                    self._markers.append(written)
        except Exception:
            logger.exception("liveness: could not quarantine host %s", self.hostname)

    def await_markers(self) -> None:
        """Wait until the markers whose writes started are written, at most :data:`MARKER_WAIT_S`
        in all (then one WARNING, and the agent goes on)."""
        with self._lock:
            markers, self._markers = self._markers, []
        deadline = time.monotonic() + MARKER_WAIT_S
        for written in markers:
            if not written.wait(max(0.0, deadline - time.monotonic())):
                logger.warning("liveness: host %s's quarantine marker is not written after %.1f s; the agent goes on "
                               "without it", self.hostname, MARKER_WAIT_S)
                return

    def _say_what_it_would_do(self, policy: QuarantineSettings, failed: list[WorkerEvent]) -> None:
        where = policy.quarantine_dir
        marker = f"its marker in {where}" if where else "no marker (quarantine_dir empty)"
        actions = [name for name, on in (("Slurm drain", policy.quarantine_slurm_drain),
                                         ("Kubernetes cordon", policy.quarantine_k8s_cordon),
                                         ("Kubernetes taint", policy.quarantine_k8s_taint),
                                         ("the hook", bool(policy.quarantine_hook))) if on]
        ranks = ", ".join(f"rank {event.identity.rank} (pid {event.identity.pid}) {event.kind.value}"
                          for event in failed)
        logger.info("liveness: would quarantine host %s for %s: %s%s (%s: nothing written, nothing run)",
                    self.hostname, ranks, marker, f", then {', '.join(actions)} of this node" if actions else "",
                    self.dry_run)
