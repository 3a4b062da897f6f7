"""The fault matrix's multi-host rows: the engine under mpirun across fresh namespace test hosts.

Each run is one trial of tests/support/multihost_engine.py (a request in flight; fresh hosts per
run): a rank of hostB SIGKILLed (its agent's own rank), hostB crashed, hostB partitioned, a
non-agent rank of hostB frozen in D (``d_state_timeout_s`` 2 s). Detected means the engine's fatal
error named hostB with the expected kind and the pending request failed; bounded, that the
proxy's ``llm.shutdown()`` returned (its last line came); left, what the hosts' removal found. A
run whose hosts or engine did not start injected no fault: it counts as a failed start
(``failed_starts``, with its error), never as a miss.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import _bench

from tests.support import multihost_engine as engine
from tests.support.testhosts import unavailable

ROWS: tuple[tuple[str, Callable[[], engine.Fatal], tuple[str, ...]], ...] = (
    ("hosts: SIGKILL of hostB's rank (agent's own)", engine.remote_kill, ("died",)),
    ("hosts: crash of hostB", lambda: engine.host_fault("crash"), ("died", "lost")),
    ("hosts: partition of hostB", lambda: engine.host_fault("partition"), ("lost",)),
    ("hosts: rank of hostB frozen in D (freezer)", engine.remote_wedge, ("wedged",)),
)


def run_host_rows(runs: int, only: str = "", wedge_skip: str | None = None) -> list[dict[str, Any]]:
    """One dict per row, shaped like the matrix's own rows (or ``skipped`` with the reason)."""
    reason = unavailable()
    rows: list[dict[str, Any]] = []
    for name, trial, kinds in ROWS:
        if only and only not in name:
            continue
        skip = reason or (wedge_skip if "frozen" in name else None)
        if skip is not None:
            rows.append({"fault": name, "skipped": skip})
            continue
        t = time.monotonic()
        results = []
        errors = []
        failed_starts = []
        for _ in range(runs):
            try:
                result = trial()
            except engine.EngineError as exc:
                errors.append(str(exc)[-800:])
                continue
            if result.failed_start:
                failed_starts.append(result.failed_start[-800:])
            else:
                results.append(result)
        ok = [r for r in results if r.ms is not None and r.host == "hostB" and r.kind in kinds and r.pending_failed]
        latencies = [r.ms for r in ok if r.ms is not None]
        rows.append({
            "fault": name, "runs": runs, "completed": len(results), "failed_starts": len(failed_starts),
            "detected": len(ok), "missed": runs - len(failed_starts) - len(ok),
            "false_alarms": 0, "p50_ms": _bench.percentile(latencies, 0.5),
            "p99_ms": _bench.percentile(latencies, 0.99),
            "shutdown_bounded": all(r.shutdown_s is not None for r in results) and not errors,
            "shutdown_bounded_runs": sum(r.shutdown_s is not None for r in results),
            "leftover_processes": sum(len(r.leftovers) for r in results), "pidfds_left": 0,
            "cause": ok[0].message if ok else None, "causes": sorted({r.message for r in ok})[:3],
            "errors": [*errors, *(f"failed start: {e}" for e in failed_starts)][:5],
            "wall_s": round(time.monotonic() - t, 1),
        })
    return rows
