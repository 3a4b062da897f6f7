"""A host whose worker could not be ended (wedged in the kernel) is quarantined.

- :mod:`._marker`: the marker file a non-restartable failure leaves, and how it is read and checked;
- :mod:`._host_policy`: what a failure writes and what start-up checks (:func:`check_host`);
- :mod:`._device_holders`: processes stuck in ``D`` holding the host's accelerator devices;
- :mod:`._orchestrator_actions`: Slurm drain, Kubernetes cordon/taint, a command hook;
- :mod:`._quarantine_settings`: those settings as one record, handed to another host's agent,
  which quarantines its own host for its ranks.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ._device_holders import DeviceHolder, find_stuck_device_holders
    from ._host_policy import HostQuarantinedError, QuarantineCheck, check_host, quarantine_host
    from ._marker import (
        MarkerStatus,
        QuarantinedProcess,
        QuarantineMarker,
        clear_marker,
        inspect_marker,
        read_marker,
        write_marker,
    )
    from ._orchestrator_actions import ActionResult, k8s_mark_node, run_hook, slurm_drain
    from ._quarantine_settings import QuarantineSettings

__all__ = ["ActionResult", "DeviceHolder", "HostQuarantinedError", "MarkerStatus", "QuarantineCheck",
           "QuarantineMarker", "QuarantineSettings", "QuarantinedProcess", "check_host", "clear_marker",
           "find_stuck_device_holders", "inspect_marker", "k8s_mark_node", "quarantine_host", "read_marker", "run_hook",
           "slurm_drain", "write_marker"]

_SOURCES = {
    "._device_holders": ("DeviceHolder", "find_stuck_device_holders"),
    "._host_policy": ("HostQuarantinedError", "QuarantineCheck", "check_host", "quarantine_host"),
    "._marker": ("MarkerStatus", "QuarantineMarker", "QuarantinedProcess", "clear_marker", "inspect_marker",
        "read_marker", "write_marker"),
    "._orchestrator_actions": ("ActionResult", "k8s_mark_node", "run_hook", "slurm_drain"),
    "._quarantine_settings": ("QuarantineSettings",),
}

if not TYPE_CHECKING:
    from .._lazy import lazy_exports

    __getattr__, __dir__ = lazy_exports(__name__, _SOURCES, globals())
