"""What the benchmark scripts share: percentiles, and how a run ends (verdicts, JSON, status)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from trtllm_liveness.process import _procfs


def percentile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) of ``values`` by linear interpolation; None when empty."""
    ordered = sorted(values)
    if not ordered:
        return None
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def task_tids(pid: int | str = "self") -> set[int]:
    """Thread ids of ``pid`` (``/proc/<pid>/task``); empty when it is gone."""
    try:
        return {int(name) for name in os.listdir(f"/proc/{pid}/task") if name.isdigit()}
    except OSError:
        return set()


def thread_cpu_ns(pid: int | str, tid: int) -> int | None:
    """CPU time of one thread in ns: ``schedstat``'s first field (ns on CPU), else ``stat``'s utime +
    stime (clock ticks, 10 ms apart: too coarse for an idle thread); None when the thread is gone."""
    try:
        with open(f"/proc/{pid}/task/{tid}/schedstat") as handle:
            return int(handle.read().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    try:
        ticks = _procfs.parse_stat(_procfs.read_stat_bytes(os.getpid() if pid == "self" else int(pid), tid)).cpu_ticks
    except (OSError, ValueError):
        return None
    return ticks * 1_000_000_000 // os.sysconf("SC_CLK_TCK")


def thread_name(pid: int | str, tid: int) -> str:
    """The kernel's name of a thread (``comm``, at most 15 bytes); ``""`` when it is gone."""
    try:
        with open(f"/proc/{pid}/task/{tid}/comm") as handle:
            return handle.read().strip()
    except OSError:
        return ""


def rss_kib(pid: int | str = "self") -> int | None:
    """``VmRSS`` of ``pid`` in KiB; None when it is gone."""
    try:
        with open(f"/proc/{pid}/status") as handle:
            for line in handle:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def finish(checks: Sequence[tuple[str, bool]], result: dict[str, Any], *, as_json: bool,
           wall_s: float | None = None) -> int:
    """Print ``PASS``/``FAIL`` per check, the wall time (when given) and, with ``as_json``, the
    result as one JSON object (floats to 3 decimals); the script's exit status (0: every check
    passed)."""
    for label, ok in checks:
        print(f"{'PASS' if ok else 'FAIL'}  {label}")
    if wall_s is not None:
        print(f"wall time {wall_s:.1f} s")
    if as_json:
        print(json.dumps({key: round(value, 3) if isinstance(value, float) else value
                          for key, value in result.items()}))
    return 0 if all(ok for _, ok in checks) else 1
