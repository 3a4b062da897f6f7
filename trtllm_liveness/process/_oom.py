"""Tell a kernel OOM kill apart from any other SIGKILL.

A worker killed by the OOM killer and one killed by an operator look the same from outside (the
exit is ``SIGKILL``, and a non-child's status is not even visible). The kernel does count OOM
kills per memory cgroup: ``oom_kill`` in ``memory.oom_control`` (cgroup v1) or ``memory.events``
(cgroup v2), and machine-wide in ``/proc/vmstat``. :class:`OomProbe` records those counters when a
worker is registered; if a counter has grown when the worker dies, the cause is the OOM killer.
The per-cgroup counter is exact when workers have their own memory cgroup (Kubernetes pods,
Slurm jobs); the machine-wide one is reported as "likely".
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from . import _procfs

CGROUP_ROOT = "/sys/fs/cgroup"


def _read_oom_kill(path: str) -> int | None:
    try:
        with open(path, "rb") as handle:
            for line in handle:
                name, _, value = line.partition(b" ")
                if name == b"oom_kill":
                    return int(value)
    except (OSError, ValueError):
        return None
    return None


def _read_cgroup_file(pid: int | str) -> bytes | None:
    try:
        return _procfs.read_whole(f"/proc/{pid}/cgroup")
    except OSError:
        return None


def _counter_file_of(cgroup_file: bytes) -> str | None:
    """Path of the file holding ``oom_kill`` for the memory cgroup a ``/proc/<pid>/cgroup``
    content names, or None."""
    unified = None
    for line in cgroup_file.decode("utf-8", "replace").splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if "memory" in controllers.split(","):
            candidate = os.path.join(CGROUP_ROOT, "memory", path.lstrip("/"), "memory.oom_control")
            if os.path.exists(candidate):
                return candidate
        elif hierarchy == "0" and controllers == "":
            unified = path
    if unified is not None:
        for base in (CGROUP_ROOT, os.path.join(CGROUP_ROOT, "unified")):
            candidate = os.path.join(base, unified.lstrip("/"), "memory.events")
            if os.path.exists(candidate):
                return candidate
    return None


_VMSTAT = "/proc/vmstat"  # the machine-wide OOM kill count, as ``oom_kill``


def _members(counter_file: str) -> dict[int, str]:
    """Each process (thread-group id) whose memory cgroup is the one holding ``counter_file``,
    mapped to that file: the cgroup's ``cgroup.procs``, read whole. Empty when unreadable."""
    try:
        data = _procfs.read_whole(os.path.join(os.path.dirname(counter_file), "cgroup.procs"))
        return {int(pid): counter_file for pid in data.split()}
    except (OSError, ValueError):
        return {}


class OomCounters:
    """What the workers registered together share, read once per :class:`OomCounters`: which memory
    cgroup each worker is in, and each counter's value.

    A worker's cgroup is known without reading its own ``/proc/<pid>/cgroup`` when it is listed in
    the ``cgroup.procs`` of a memory cgroup already met: this process's own (listed first), or one
    in which a second worker was found. Workers of one job share a cgroup, usually the proxy's, so
    a thousand of them cost one or two listings instead of a thousand reads; a worker in a cgroup of
    its own (Slurm's task/cgroup) is read on its own. The answers are those of reading each
    worker's file, as of the moment its cgroup was listed. Not thread-safe: one registration uses
    it, then drops it.
    """

    def __init__(self) -> None:
        self._files: dict[bytes, str | None] = {}  # /proc/<pid>/cgroup content -> counter file
        self._values: dict[str, int | None] = {}
        self._listed: dict[int, str] = {}  # pid -> counter file, from cgroup.procs listings
        self._found: dict[str, int] = {}  # counter file -> workers found in it by their own file
        self._own_listed = False

    def counter_file(self, pid: int) -> str | None:
        if not self._own_listed:
            self._own_listed = True
            own = self._resolve(_read_cgroup_file("self"))
            if own is not None:
                self._listed.update(_members(own))
        listed = self._listed.get(pid)
        if listed is not None:
            return listed
        path = self._resolve(_read_cgroup_file(pid))
        if path is not None:
            self._found[path] = self._found.get(path, 0) + 1
            if self._found[path] == 2:
                self._listed.update(_members(path))
        return path

    def _resolve(self, content: bytes | None) -> str | None:
        if content is None:
            return None
        if content not in self._files:
            self._files[content] = _counter_file_of(content)
        return self._files[content]

    def value(self, path: str) -> int | None:
        if path not in self._values:
            self._values[path] = _read_oom_kill(path)
        return self._values[path]


@dataclass
class OomProbe:
    """OOM-kill counters of one worker, captured at registration, compared at death."""

    counter_file: str | None
    cgroup_kills: int | None
    machine_kills: int | None

    @classmethod
    def capture(cls, pid: int, counters: OomCounters | None = None) -> OomProbe:
        """Record ``pid``'s memory-cgroup and machine-wide OOM kill counters. Never raises.

        ``counters`` shares the reads among the workers registered together (see
        :class:`OomCounters`); without it, everything is read for this worker alone.
        """
        shared = OomCounters() if counters is None else counters
        counter_file = shared.counter_file(pid)
        cgroup_kills = shared.value(counter_file) if counter_file else None
        return cls(counter_file, cgroup_kills, shared.value(_VMSTAT))

    def verdict(self) -> str | None:
        """A cause string if an OOM kill happened since capture, else None."""
        if self.counter_file is not None and self.cgroup_kills is not None:
            now = _read_oom_kill(self.counter_file)
            if now is not None:
                if now > self.cgroup_kills:
                    group = os.path.dirname(self.counter_file)
                    return (
                        f"killed by the kernel OOM killer (memory cgroup {group}: "
                        f"oom_kill {self.cgroup_kills} -> {now})"
                    )
                # The exact per-cgroup count says no; an OOM kill elsewhere on the machine is not ours.
                return None
        if self.machine_kills is not None:
            now = _read_oom_kill(_VMSTAT)
            if now is not None and now > self.machine_kills:
                return f"likely killed by the kernel OOM killer (machine oom_kill {self.machine_kills} -> {now})"
        return None
