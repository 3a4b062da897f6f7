#!/usr/bin/env python3
"""End-to-end benchmark: SIGKILL an MPI worker with requests in flight, on the reference executor.

Measures, side by side in one run (Open MPI with OMPI_MCA_mpi_ft_enable=1, the case where the
engine otherwise hangs):

- ``e2e_p50_ms`` / ``e2e_p99_ms``: liveness on, SIGKILL -> ``check_health()`` False AND every
  pending request failed (>= 20 kills, half in main mode on a subordinate, half in 1.2 mode on
  the leader);
- ``upstream_poll_p50_ms``: main mode without the extension, only upstream's 5 s
  ``proxy_error_monitor`` loop (time until ``_fatal_error`` is set; a few samples);
- ``disabled_detected``: 1.2 mode without the extension: does anything notice within the window
  (default 30 s)? Expected false: the field failure.

Usage: ``scripts/bench_e2e.py [--kills N] [--disabled-window S] [--json]``. Needs the mpi extra.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from typing import Any

from trtllm_liveness.reference._scenario import run_in_child


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def samples(options: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
    records, survivors = run_in_child(options, timeout)
    if survivors:
        sys.stderr.write(f"warning: processes left behind and killed late: {survivors}\n")
    results = [r for r in records if "phase" in r]
    if not any(r.get("done") for r in records):
        sys.stderr.write(f"warning: scenario incomplete: {json.dumps(records)[-1500:]}\n")
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--upstream-samples", type=int, default=3)
    parser.add_argument("--disabled-window", type=float, default=30.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    t_start = time.monotonic()

    disabled: list[dict[str, Any]] = []
    # The disabled baseline mostly waits: run it beside the others to keep the wall time down.
    baseline = threading.Thread(target=lambda: disabled.extend(samples(
        {"mode": "1.2", "liveness": False, "fault": "kill", "observe_s": args.disabled_window,
         "stall_timeout_s": 1.0}, args.disabled_window + 60)), daemon=True)
    baseline.start()

    half = args.kills // 2
    kills = samples({"mode": "main", "fault": "kill", "fault_rank": 1, "iterations": args.kills - half,
                     "tokens": 300, "observe_s": 10}, 300)
    kills += samples({"mode": "1.2", "fault": "kill", "fault_rank": 0, "iterations": half,
                      "tokens": 300, "observe_s": 10}, 300)
    upstream = samples({"mode": "main", "liveness": False, "fault": "kill", "health_probe": "fatal_error",
                        "iterations": args.upstream_samples, "tokens": 1500, "observe_s": 12}, 200)
    baseline.join(args.disabled_window + 90)

    e2e = [r["e2e_ms"] for r in kills if r.get("e2e_ms") is not None]
    detect = [r["detected_ms"] for r in kills if r.get("detected_ms") is not None]
    up = [r["e2e_ms"] for r in upstream if r.get("e2e_ms") is not None]
    dis = disabled[0] if disabled else {}
    result = {
        "kills": len(kills),
        "kills_detected": len(e2e),
        "e2e_p50_ms": round(percentile(e2e, 0.5), 3),
        "e2e_p99_ms": round(percentile(e2e, 0.99), 3),
        "e2e_max_ms": round(max(e2e), 3) if e2e else None,
        "detect_p50_ms": round(percentile(detect, 0.5), 3),
        "upstream_poll_p50_ms": round(statistics.median(up), 3) if up else None,
        "upstream_poll_samples": len(up),
        "disabled_detected": bool(dis.get("health_false_ms") is not None or dis.get("requests_failed_ms") is not None),
        "disabled_window_s": args.disabled_window,
        "disabled_pending_after_window": dis.get("pending_not_done"),
        "wall_s": round(time.monotonic() - t_start, 1),
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{'measurement':44} {'value':>12}")
    print(f"{'SIGKILL -> health False + all failed, p50':44} {result['e2e_p50_ms']:>9} ms")
    print(f"{'SIGKILL -> health False + all failed, p99':44} {result['e2e_p99_ms']:>9} ms")
    print(f"{'  kills measured / detected':44} {result['kills']:>6} / {result['kills_detected']}")
    print(f"{'upstream main, 5 s poll loop only, p50':44} {result['upstream_poll_p50_ms']!s:>9} ms")
    label = f"no extension: noticed within {args.disabled_window} s"
    print(f"{label:44} {result['disabled_detected']!s:>12}")
    print(f"{'wall time':44} {result['wall_s']:>10} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
