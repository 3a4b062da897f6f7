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
    from ._device_holders import DeviceHolder as DeviceHolder
    from ._device_holders import find_stuck_device_holders as find_stuck_device_holders
    from ._host_policy import HostQuarantinedError as HostQuarantinedError
    from ._host_policy import QuarantineCheck as QuarantineCheck
    from ._host_policy import check_host as check_host
    from ._host_policy import quarantine_host as quarantine_host
    from ._marker import MarkerStatus as MarkerStatus
    from ._marker import QuarantinedProcess as QuarantinedProcess
    from ._marker import QuarantineMarker as QuarantineMarker
    from ._marker import clear_marker as clear_marker
    from ._marker import inspect_marker as inspect_marker
    from ._marker import read_marker as read_marker
    from ._marker import write_marker as write_marker
    from ._orchestrator_actions import ActionResult as ActionResult
    from ._orchestrator_actions import k8s_mark_node as k8s_mark_node
    from ._orchestrator_actions import run_hook as run_hook
    from ._orchestrator_actions import slurm_drain as slurm_drain
    from ._quarantine_settings import QuarantineSettings as QuarantineSettings

__all__ = [
    "ActionResult",
    "DeviceHolder",
    "HostQuarantinedError",
    "MarkerStatus",
    "QuarantineCheck",
    "QuarantineMarker",
    "QuarantineSettings",
    "QuarantinedProcess",
    "check_host",
    "clear_marker",
    "find_stuck_device_holders",
    "inspect_marker",
    "k8s_mark_node",
    "quarantine_host",
    "read_marker",
    "run_hook",
    "slurm_drain",
    "write_marker",
]

_SOURCES = {
    "QuarantineMarker": "_marker",
    "QuarantinedProcess": "_marker",
    "MarkerStatus": "_marker",
    "read_marker": "_marker",
    "write_marker": "_marker",
    "inspect_marker": "_marker",
    "clear_marker": "_marker",
    "HostQuarantinedError": "_host_policy",
    "QuarantineCheck": "_host_policy",
    "check_host": "_host_policy",
    "quarantine_host": "_host_policy",
    "DeviceHolder": "_device_holders",
    "find_stuck_device_holders": "_device_holders",
    "ActionResult": "_orchestrator_actions",
    "slurm_drain": "_orchestrator_actions",
    "k8s_mark_node": "_orchestrator_actions",
    "run_hook": "_orchestrator_actions",
    "QuarantineSettings": "_quarantine_settings",
}

if not TYPE_CHECKING:
    from .._lazy import lazy_exports

    __getattr__, __dir__ = lazy_exports(__name__, _SOURCES, globals())
