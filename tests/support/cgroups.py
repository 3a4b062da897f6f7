"""The cgroup v1 pieces only tests and benchmarks use, next to the freezer and memory groups of
:mod:`trtllm_liveness.demo._cgroup_faults` (whose clean-up rules they share).

- :class:`CpuGroup`: a cgroup v1 cpu group with a CFS bandwidth limit (``cpu.cfs_quota_us`` per
  ``cpu.cfs_period_us``, what cgroup v2 writes as ``cpu.max "QUOTA PERIOD"``): its tasks together
  get at most that share of one CPU and are throttled for the rest of each period.
- :func:`limit_hits`: how often a :class:`~trtllm_liveness.demo._cgroup_faults.MemoryGroup` was
  found at its limit (a page cache reaching it is made to reclaim).
- :func:`memory_cgroup_available`, :func:`cpu_cgroup_available`: whether such groups can be made here.
- :func:`remove_leftover_groups`: the freezer, memory and cpu groups a crashed owner left behind.
"""

from __future__ import annotations

import contextlib
import os

from trtllm_liveness.demo._cgroup_faults import MEMORY_ROOT, FreezerGroup, MemoryGroup, _Group, _unavailable

__all__ = ["CPU_ROOT", "CpuGroup", "cpu_cgroup_available", "limit_hits", "memory_cgroup_available",
           "remove_leftover_groups"]

CPU_ROOT = "/sys/fs/cgroup/cpu"


def memory_cgroup_available() -> str | None:
    """None if cgroup v1 memory groups can be made here, else the reason they cannot."""
    return _unavailable(MEMORY_ROOT, "memory controller")


def cpu_cgroup_available() -> str | None:
    """None if cgroup v1 cpu groups with a CFS bandwidth limit can be made here, else the reason."""
    reason = _unavailable(CPU_ROOT, "cpu controller")
    if reason is None and not os.path.exists(os.path.join(CPU_ROOT, "cpu.cfs_quota_us")):
        reason = f"{CPU_ROOT} has no cpu.cfs_quota_us (a kernel without CFS bandwidth control)"
    return reason


def limit_hits(group: MemoryGroup) -> int | None:
    """``memory.failcnt`` of ``group``: how many times a charge found the group at its limit and had
    to reclaim first (None if unreadable)."""
    with contextlib.suppress(OSError, ValueError):
        return int(group._read("memory.failcnt"))
    return None


class CpuGroup(_Group):
    """A cgroup v1 cpu group under :data:`CPU_ROOT` whose tasks together get at most ``share`` of
    one CPU: ``cpu.cfs_quota_us`` = ``share`` x ``cpu.cfs_period_us`` (``period_us``, 1 ms to 1 s).
    Raises ``ValueError`` for a share outside (0, 1] or a period out of range, ``OSError`` if the
    group cannot be made."""

    root = CPU_ROOT

    def __init__(self, share: float, period_us: int = 100_000, prefix: str = "trtllm-liveness") -> None:
        if not 0 < share <= 1 or not 1_000 <= period_us <= 1_000_000:
            raise ValueError(f"share in (0, 1] and period_us in [1000, 1000000], not {share}, {period_us}")
        super().__init__(prefix, (("cpu.cfs_period_us", str(period_us)),
                                  ("cpu.cfs_quota_us", str(max(1_000, round(share * period_us))))))

    def throttled(self) -> tuple[int, float]:
        """``cpu.stat``: the periods in which the group ran out of quota and how long its tasks
        waited for the next one, in seconds ((0, 0.0) if unreadable)."""
        counters = self._counters("cpu.stat")
        return counters.get("nr_throttled", 0), counters.get("throttled_time", 0) / 1e9


def remove_leftover_groups(prefix: str) -> list[str]:
    """Remove the freezer, memory and cpu groups named ``prefix-*`` that a crashed owner left
    behind; returns their paths.

    Only for a prefix unique to the caller: another owner's live group would be thawed.
    """
    removed = []
    for cls in (FreezerGroup, MemoryGroup, CpuGroup):
        with contextlib.suppress(OSError):
            for name in os.listdir(cls.root):
                if name.startswith(prefix + "-"):
                    group = cls.__new__(cls)
                    group.path, group.removed = os.path.join(cls.root, name), False
                    if group.remove():
                        removed.append(group.path)
    return removed
