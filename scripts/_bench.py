"""What the benchmark scripts share: percentiles, and how a run ends (verdicts, JSON, status)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any


def percentile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) of ``values`` by linear interpolation; None when empty."""
    ordered = sorted(values)
    if not ordered:
        return None
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


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
