"""Quarantine of a wedged host: what a non-restartable failure leaves, and what start-up checks.

:func:`quarantine_host` runs on the fatal path (from the event's thread; it never blocks there):
in one thread of the process's ending (:class:`~trtllm_liveness.exit.ProcessEnding`) it writes the
host's marker (:mod:`._marker`), then runs the configured orchestrator actions
(:mod:`._orchestrator_actions`), each bounded. The ending (an exit guard's, or the normal
interpreter exit) waits for that thread until one absolute deadline set when it started:
``quarantine_action_timeout_s`` per request the actions make (a drain, a Kubernetes read and
patch, a hook: they run one after another) plus a second. So the marker is on disk before the
process ends and nothing holds the exit past that deadline. What this process recorded (and
whether the actions ran) is the ending's :class:`~trtllm_liveness.exit._process_ending.QuarantineLedger`.

Only this host's processes are recorded, and the actions (Slurm drain, Kubernetes cordon and
taint, the hook) name this host's node. A rank of another host is quarantined on its own host:
the proxy never acts for it; that host's agent (:mod:`trtllm_liveness.multihost._agent_quarantine`)
calls :func:`quarantine_host` there with the settings the proxy handed it
(:class:`~._quarantine_settings.QuarantineSettings`).

:func:`check_host_at_start` runs when an engine starts (extension on): it clears a marker that no
longer applies (another boot, processes gone), and raises :class:`HostQuarantinedError` while one
does, or while a visible process holding an accelerator device sits in ``D`` (unless
``quarantine_override``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .._config import LivenessConfig
from .._events import WorkerEvent
from ..exit._process_ending import QuarantineLedger, process_ending
from ..process import _procfs
from ..process._identity import is_local
from ._device_holders import DeviceHolder, find_stuck_device_holders, parse_patterns
from ._marker import (
    DEFAULT_QUARANTINE_DIR,
    MarkerError,
    MarkerStatus,
    MarkerVerdict,
    QuarantinedProcess,
    clear_marker,
    inspect_marker,
    resolve_directory,
    user_marker_directories,
    write_marker,
)

if TYPE_CHECKING:
    from ._orchestrator_actions import ActionResult
    from ._quarantine_settings import QuarantineSettings

    Policy = LivenessConfig | QuarantineSettings
    """What a failure's quarantine reads: the engine's settings, or the ones an agent was handed."""

logger = logging.getLogger(__name__)

__all__ = ["HostQuarantinedError", "QuarantineCheck", "check_host", "check_host_at_start", "quarantine_host"]

RECYCLE_ADVICE = ("recycle the host (reboot it, or move the workload elsewhere) before starting an engine here; "
                  "'trtllm-liveness quarantine status' shows the state, 'quarantine clear' removes a marker once "
                  "the processes are gone, quarantine_override=1 starts anyway")


@dataclass(frozen=True)
class QuarantineCheck:
    """What start-up (or ``quarantine status``) found: the marker's status and the device holders."""

    marker: MarkerStatus | None
    device_holders: tuple[DeviceHolder, ...]

    @property
    def quarantined(self) -> bool:
        """Whether an engine must not start here."""
        return bool(self.device_holders) or (self.marker is not None and self.marker.quarantined)

    def describe(self) -> str:
        """The reasons in one line (empty when not quarantined)."""
        parts = []
        if self.marker is not None and self.marker.quarantined:
            parts.append(self.marker.describe())
        if self.device_holders:
            parts.append("processes holding accelerator devices are stuck in D: "
                         + "; ".join(holder.describe() for holder in self.device_holders))
        return "; ".join(parts)


class HostQuarantinedError(RuntimeError):
    """This host is quarantined: a worker of an earlier engine is still stuck here (or cannot be
    verified from this PID namespace), or a device holder is in ``D``. ``check`` holds the details."""

    def __init__(self, check: QuarantineCheck) -> None:
        super().__init__(f"trtllm-liveness: refusing to start: {check.describe()}; {RECYCLE_ADVICE}")
        self.check = check

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.check,))


def check_host(config: LivenessConfig, *, clear: bool) -> QuarantineCheck:
    """Judge the marker of ``config.quarantine_dir`` and look for stuck device holders.

    ``clear``: remove a marker that no longer applies (start-up does; ``quarantine status`` does
    not). Blocks for a few procfs reads, plus 1 s only when a device holder in ``D`` was seen.
    Never signals anything. An untrusted marker directory is logged and ignored.
    """
    status = None
    cleared = False
    directory = resolve_directory(config.quarantine_dir)  # "" where the marker is off
    if directory:
        status = inspect_marker(directory)
        if status.verdict is MarkerVerdict.UNTRUSTED:
            logger.warning("liveness: %s; ignored", status.describe())
        elif clear and status.clearable:
            try:
                cleared = clear_marker(directory, expected=status.marker)
            except (MarkerError, OSError) as exc:
                logger.warning("liveness: could not clear %s: %s", status.path, exc)
            if cleared:
                logger.warning("liveness: %s: cleared", status.describe())
    if directory == DEFAULT_QUARANTINE_DIR and os.geteuid() == 0 and not (status and status.quarantined):
        # Root (the node's health check, a root server) also sees what servers of other users
        # recorded in their fallback directories: a Slurm job runs as its user.
        for user_directory, uid in user_marker_directories():
            found = _user_marker(user_directory, uid)
            if found is not None:
                status = found
                break
    holders = find_stuck_device_holders(parse_patterns(config.quarantine_devices))
    return QuarantineCheck(status, holders)


def _user_marker(directory: str, uid: int) -> MarkerStatus | None:
    """Another user's marker, if it quarantines this host, else None. Any user can write their own
    directory, so only what they could not fake counts: a well-formed marker naming a process of
    that very uid, still there (verified by start time) and blocking. A malformed one is ignored
    with a WARNING (in one's own directory it blocks: a server we trust wrote it)."""
    found = inspect_marker(directory, owner=uid)
    if found.verdict is MarkerVerdict.MALFORMED:
        logger.warning("liveness: %s (uid %d's directory); ignored", found.describe(), uid)
        return None
    if not found.quarantined:
        return None
    owned = tuple(check for check in found.blocking if _owner_of(check.process.pid) == uid)
    if not owned:
        logger.warning("liveness: %s names no process of uid %d; ignored", found.path, uid)
        return None
    return dataclasses.replace(found, checks=owned)


def _owner_of(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def check_host_at_start(config: LivenessConfig) -> None:
    """Raise :class:`HostQuarantinedError` when this host is quarantined (see :func:`check_host`),
    unless ``config.quarantine_override`` (then one ERROR line)."""
    check = check_host(config, clear=True)
    if not check.quarantined:
        return
    if config.quarantine_override:
        logger.error("liveness: starting on a quarantined host (quarantine_override=1): %s", check.describe())
        return
    raise HostQuarantinedError(check)


# ----------------------------------------------------------------------------- on failure

def quarantine_host(config: Policy, events: Iterable[WorkerEvent], *,
                    marker_done: threading.Event | None = None) -> threading.Thread | None:
    """Record the non-restartable ``events`` of this host's processes in its marker and, the first
    time in this process, run the configured actions for this host's node; all in one thread of
    the process's ending (returned; None when there is nothing to do), which the ending awaits
    until the deadline of the module docstring. ``marker_done`` is set once the marker is written
    (or could not be). Never blocks, never raises. Events already recorded by this process are
    skipped (the monitor, ``shutdown()`` and the exit path may report the same rank).

    An event of a rank on another host is never recorded here, nor acted on: that host is
    quarantined by its own agent (:mod:`trtllm_liveness.multihost._agent_quarantine`), with its own marker
    and the actions for its own node; this host's node is not the failed one."""
    unrestartable = [event for event in events if not event.restartable]
    remote = [event for event in unrestartable if not is_local(event.identity)]
    if remote:
        logger.info("liveness: not quarantining this host for %s: its host's agent quarantines that host",
                    ", ".join(event.identity.describe() for event in remote))
    ending = process_ending()
    ledger = ending.quarantine
    with ledger.lock:
        fresh = [event for event in unrestartable if is_local(event.identity)
                 and (event.identity.pid, event.identity.start_time) not in ledger.recorded]
        if not fresh:
            return None
        ledger.recorded.update((event.identity.pid, event.identity.start_time) for event in fresh)
        run_actions = not ledger.actions_started and _action_requests(config) > 0
        ledger.actions_started = ledger.actions_started or run_actions
    worker = ending.threads.start(_quarantine, name="trtllm-liveness-quarantine", bound_s=_bound_s(config),
                                  args=(config, ledger, fresh, run_actions, marker_done))
    if worker is None:  # interpreter shutting down: no thread; do the marker here (fast)
        logger.warning("liveness: quarantine without a thread")
        _quarantine(config, ledger, fresh, False, marker_done)
    return worker


def _action_requests(config: Policy) -> int:
    """How many requests the configured actions make, one after another (0: no action)."""
    k8s = 2 if config.quarantine_k8s_cordon or config.quarantine_k8s_taint else 0  # read, then patch
    return int(config.quarantine_slurm_drain) + k8s + int(bool(config.quarantine_hook))


def _bound_s(config: Policy) -> float:
    """How long a quarantine's thread may take: ``quarantine_action_timeout_s`` per request its
    actions make, plus a second for the marker."""
    return _action_requests(config) * config.quarantine_action_timeout_s + 1.0


def _quarantine(config: Policy, ledger: QuarantineLedger, events: list[WorkerEvent], run_actions: bool,
                marker_done: threading.Event | None = None) -> list[ActionResult]:
    reason = events[0].message
    marker_path = ""
    try:
        recordable = [event for event in events if event.identity.start_time is not None]
        if config.quarantine_dir and recordable:
            try:
                marker_path = write_marker(resolve_directory(config.quarantine_dir),
                                           [_recorded_process(event) for event in recordable], reason)
                logger.critical("liveness: host quarantined: marker %s written (%s); %s", marker_path, reason,
                                RECYCLE_ADVICE)
            except (MarkerError, OSError) as exc:
                logger.error("liveness: could not write the quarantine marker in %s: %s", config.quarantine_dir, exc)
                with ledger.lock:  # not recorded after all: a later event for these processes tries again
                    ledger.recorded.difference_update((event.identity.pid, event.identity.start_time)
                                                      for event in events)
        elif config.quarantine_dir:
            logger.warning("liveness: non-restartable failure of a process whose start time is unknown (%s): no "
                           "marker written", reason)
    finally:
        if marker_done is not None:
            marker_done.set()
    if not run_actions:
        return []
    # Imported here: subprocess and the actions are for a failure, not for every engine start.
    from ._orchestrator_actions import k8s_mark_node, run_hook, slurm_drain

    timeout = config.quarantine_action_timeout_s
    results = []
    if config.quarantine_slurm_drain:
        results.append(slurm_drain(f"trtllm-liveness: {reason}", timeout_s=timeout))
    if config.quarantine_k8s_cordon or config.quarantine_k8s_taint:
        results.append(k8s_mark_node(reason, cordon=config.quarantine_k8s_cordon, taint=config.quarantine_k8s_taint,
                                     timeout_s=timeout))
    if config.quarantine_hook:
        results.append(run_hook(config.quarantine_hook, marker_path=marker_path, reason=reason, timeout_s=timeout))
    return results


def _recorded_process(event: WorkerEvent) -> QuarantinedProcess:
    identity = event.identity
    pid = identity.pid
    state = "?"
    with contextlib.suppress(OSError, ValueError):
        states = _procfs.read_thread_states(pid)
        state = "D" if _procfs.uninterruptible_tids(states) else _procfs.read_stat(pid).state
    namespace = identity.pid_namespace or _procfs.pid_namespace_inode("self")
    assert identity.start_time is not None
    return QuarantinedProcess(pid=pid, start_time=identity.start_time, pid_namespace=namespace, rank=identity.rank,
                              state=state, wchan=event.wchan, kind=event.kind.value, cause=event.cause[:4000])
