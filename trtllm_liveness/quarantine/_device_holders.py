"""Processes stuck in ``D``, or unkillable in any state, while holding the host's accelerator device files.

A worker wedged in the GPU driver keeps ``/dev/nvidia*`` open; a fresh server on that host would
collide with it even when no quarantine marker was left (the marker directory was not mounted, or
the wedge came from another program). Start-up looks for such processes among those its ``/proc``
shows (the whole host in the host's PID namespace or with ``hostPID``; only its own container
otherwise):

1. every visible process's threads are sampled once (``/proc/<pid>/task/*/stat``);
2. only a process with a thread in ``D`` has its open files read (``readlink`` of
   ``/proc/<pid>/fd/*``: the file table, never the memory map, whose lock a task in ``D`` may hold)
   and matched against the device patterns;
3. only if one is found, the suspects are sampled again after ``resample_s``: a thread counts
   only if it is in ``D`` both times with the same wait channel and never ran in between (its
   context-switch count unchanged). A driver call is in ``D`` for microseconds, a process that
   streams weights from NFS sleeps in ``D`` again and again (each wake-up is a switch), a wedge
   stays. So a healthy host pays one sampling pass and no wait. A single uninterrupted ``D``
   sleep longer than ``resample_s`` on a healthy neighbour (one slow read) still counts: the
   refusal names the process and its wait channel, and ``quarantine_override`` starts anyway.

**Unkillable in any state.** A holder with SIGKILL pending in both samples, ``resample_s`` apart,
counts too, in ``R`` as in ``D``: docs/diagnosis.md ("Unkillable in any state") gives the rule and
what its report holds.

Nothing here sends a signal.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..process import _procfs
from ..process._thread_sampler import DStateSample, sample_d_state

logger = logging.getLogger(__name__)

__all__ = ["DeviceHolder", "find_stuck_device_holders", "parse_patterns"]

RESAMPLE_S = 1.0
"""Interval between the two samples of a suspect (a healthy driver call leaves ``D`` long before)."""

_MAX_FDS = 65536


@dataclass(frozen=True)
class DeviceHolder:
    """A process found in ``D`` in both samples with a device file open."""

    pid: int
    start_time: int
    comm: str
    devices: tuple[str, ...]
    d_tids: tuple[int, ...]
    wchan: str
    kill_pending: bool
    d_sample: DStateSample | None = None  # the threads in D when sampled, with their switch counts
    state: str = "D"  # the main thread's state (a process SIGKILL does not end: any)
    kernel_stack: tuple[str, ...] = ()  # where readable (root), for a process SIGKILL does not end

    def describe(self) -> str:
        """One phrase for messages."""
        devices = ", ".join(self.devices[:4]) + (", ..." if len(self.devices) > 4 else "")
        what = f"unkillable (SIGKILL pending, state {self.state})" if self.kill_pending else "in D"
        stack = f", kernel stack {' < '.join(self.kernel_stack[:6])}" if self.kernel_stack else ""
        threads = f" (threads {', '.join(map(str, self.d_tids[:8]))})" if self.d_tids else ""
        return f"pid {self.pid} ({self.comm}) is {what} in {self.wchan or '?'} holding {devices}{threads}{stack}"


def parse_patterns(spec: str) -> tuple[str, ...]:
    """The absolute glob patterns of a ``:``-separated setting (empty: none)."""
    return tuple(part.strip() for part in spec.split(":") if part.strip().startswith("/"))


def find_stuck_device_holders(patterns: tuple[str, ...], *, resample_s: float = RESAMPLE_S,
                              between: Callable[[], None] | None = None) -> tuple[DeviceHolder, ...]:
    """The visible processes (not this one) that hold a file matching ``patterns`` and have a
    thread in ``D`` in two samples ``resample_s`` apart (the same thread, the same process by
    start time), or SIGKILL pending in both, whatever their state. Blocks for one pass over
    ``/proc``, plus ``resample_s`` only when a suspect was found. Unreadable processes are skipped
    (logged at debug level). Never raises ``OSError``. ``between`` (tests) is called after a first
    sample that found suspects, before the second."""
    if not patterns:
        return ()
    try:
        pids = _procfs.list_pids()
    except OSError as exc:
        logger.warning("cannot list processes for the device check: %s", exc.strerror or exc)
        return ()
    first = [holder for pid in pids if pid != os.getpid() for holder in _sample(pid, patterns)]
    if not first:
        return ()
    if between is not None:
        between()
    time.sleep(resample_s)
    confirmed = []
    for before in first:
        for after in _sample(before.pid, patterns):
            if after.start_time != before.start_time:
                continue
            if before.kill_pending and after.kill_pending:  # unkillable, whatever its state
                confirmed.append(_unkillable(after))
                continue
            # The same thread, asleep in D all along: it never ran between the samples.
            common = (after.d_sample.held_since(before.d_sample)
                      if after.d_sample is not None and before.d_sample is not None else ())
            if after.wchan == before.wchan and common:
                confirmed.append(DeviceHolder(after.pid, after.start_time, after.comm, after.devices, common,
                                              after.wchan, after.kill_pending, after.d_sample))
    return tuple(confirmed)


def _unkillable(holder: DeviceHolder) -> DeviceHolder:
    """``holder`` with its state, wait channel and kernel stack as a process SIGKILL does not end."""
    from ..stop._survivor import sample_survivor  # only for such a process

    sample = sample_survivor(holder.pid)
    return DeviceHolder(holder.pid, holder.start_time, holder.comm, holder.devices, sample.d_tids or holder.d_tids,
                        sample.d_wchan or sample.wchan or holder.wchan, True, holder.d_sample,
                        sample.state or holder.state, sample.kernel_stack)


def _sample(pid: int, patterns: tuple[str, ...]) -> list[DeviceHolder]:
    try:
        info = _procfs.read_stat(pid)
        d_sample = sample_d_state(pid)  # with each D thread's switch count and SIGKILL bits
        pending = (d_sample is not None and d_sample.kill_pending) or _procfs.sigkill_stuck(pid, info)
        if d_sample is None and not pending:
            return []
        devices = _open_devices(pid, patterns)
        if not devices:
            return []
        d_tids = () if d_sample is None else d_sample.d_tids
        wchan = d_sample.wchan if d_sample is not None else _procfs.read_wchan(pid)
    except (OSError, ValueError) as exc:  # gone meanwhile, EACCES, a malformed stat
        logger.debug("device check skips pid %d: %s", pid, exc)
        return []
    return [DeviceHolder(pid, info.start_time, info.comm, devices, d_tids, wchan, pending, d_sample, info.state)]


def _open_devices(pid: int, patterns: tuple[str, ...]) -> tuple[str, ...]:
    directory = f"{_procfs.PROCFS_PATH}/{pid}/fd"
    found: list[str] = []
    for name in os.listdir(directory)[:_MAX_FDS]:
        try:
            target = os.readlink(f"{directory}/{name}")
        except OSError:
            continue
        if target not in found and any(fnmatch.fnmatchcase(target, pattern) for pattern in patterns):
            found.append(target)
    return tuple(found)
