#!/usr/bin/env python3
"""Fault matrix: every way a worker can fail, on real MPI workers, with liveness on.

Runs the reference executor (Open MPI, ``OMPI_MCA_mpi_ft_enable=1``, the setting where the engine
otherwise hangs) through each fault ``--runs`` times and reports per fault: runs, detected,
missed, false alarms, detection p50/p99 ms (from the fault to the package's first report),
shutdown bounded, leftover processes and the cause the package reported. Each fault runs in one
scenario child (one Python and MPI start, one fresh executor per run) in its own session with an
outer timeout; every process of that session is checked by pid afterwards and killed if left
(counted as leftover). Cgroups get a prefix unique to this run and are thawed and removed at the
end, also on Ctrl-C; the two busy-loop processes of the CPU-pressure control are ended by pid.

Baseline, side by side: SIGSTOP, which must NOT be reported dead (surfaced as a stall), and two
no-fault controls under request load with wedge detection on (``d_state_timeout_s=1``), one with
both cores busy, which must raise zero alarms.

Usage: ``scripts/fault_matrix.py [--json] [--runs N] [--control-s S] [--quick]``
(``--quick``: 2 runs, 10 s controls). Needs the mpi extra; the OOM and wedge rows need root and
cgroup v1 (memory, freezer), the FUSE row root and /dev/fuse; they are reported as skipped otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

from trtllm_liveness.reference._env import remove_orphaned_prte_tmpdirs
from trtllm_liveness.reference._faults import freezer_available, memory_cgroup_available, remove_leftover_groups
from trtllm_liveness.reference._fuse_stall import fuse_available, remove_leftover_mounts
from trtllm_liveness.reference._scenario import run_in_child

COMMON: dict[str, Any] = {"mode": "main", "workers": 2, "tokens": 300, "observe_s": 10.0,
                          "d_state_timeout_s": 1.0, "scan_interval_s": 0.1, "shutdown_grace_s": 2.0,
                          "shutdown_term_s": 0.5, "shutdown_kill_s": 1.0}
# shutdown() bound: grace + term + kill + 5 s (LivenessProxyMixin.shutdown's docstring).
SHUTDOWN_BOUND_MS = (2.0 + 0.5 + 1.0 + 5.0) * 1e3
BUSY_LOOP = "while True:\n    pass"


def percentile(values: list[float], q: float) -> float | None:
    ordered = sorted(values)
    if not ordered:
        return None
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return round(ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo), 3)


def names_victim(text: str | None, record: dict[str, Any]) -> bool:
    victims = record.get("victims") or [record.get("victim") or {}]
    return bool(text) and any(f"rank {v.get('rank')} (pid {v.get('pid')})" in str(text) for v in victims)


# Each judge returns (detected, false_alarm, detection_ms, cause) for one run's record.
Verdict = tuple[bool, bool, float | None, str]


def judge_death(r: dict[str, Any]) -> Verdict:
    ok = r.get("health_false_ms") is not None and names_victim(r.get("fatal_error"), r)
    ms = r.get("detected_ms") if r.get("detected_ms") is not None else r.get("health_false_ms")
    cause = r["events"][0]["cause"] if r.get("events") else str(r.get("fatal_error"))
    return ok, False, ms, cause


def judge_init(r: dict[str, Any]) -> Verdict:
    ok = r.get("init_hung") is False and names_victim(r.get("init_error"), r)
    return ok, False, r.get("init_error_ms"), str(r.get("init_error_type")) + ": " + str(r.get("init_error"))


def judge_spawn(r: dict[str, Any]) -> Verdict:
    ok = (r.get("spawn_failed") is True and r.get("init_hung") is False
          and r.get("init_error_type") == "PoolManagerDiedError")
    return ok, False, r.get("init_error_ms"), str(r.get("init_error_type")) + ": " + str(r.get("init_error"))


def judge_shutdown(r: dict[str, Any]) -> Verdict:
    workers = (r.get("shutdown_report") or {}).get("workers", [])
    victim = (r.get("victim") or {}).get("pid")
    outcome = next((w["outcome"] for w in workers if w["pid"] == victim), None)
    ok = not r.get("shutdown_hung") and outcome is not None and not r.get("unkillable")
    return ok, False, None, f"shutdown report: rank {r['victim']['rank']} {outcome}; no fatal error (expected exit)"


def judge_stop(r: dict[str, Any]) -> Verdict:
    reported_dead = r.get("fatal_error") is not None or bool(r.get("events"))
    ok = r.get("stall_detected_ms") is not None
    return ok, reported_dead, r.get("stall_detected_ms"), "not dead: surfaced as a stall (no tokens for 1 s)"


def judge_wedge(r: dict[str, Any]) -> Verdict:
    events = r.get("events") or []
    ok = bool(events) and events[0]["kind"] == "wedged" and names_victim(r.get("fatal_error"), r)
    cause = events[0]["cause"] if events else str(r.get("fatal_error"))
    return ok, False, r.get("detected_ms"), cause + f"; shutdown: unkillable {r.get('unkillable')}"


def judge_control(r: dict[str, Any]) -> Verdict:
    alarms = int(r.get("alarms", 1)) + int(r.get("pending_not_done", 0))
    cause = (f"{r.get('requests_completed')} requests, {r.get('health_checks')} health checks, "
             f"{r.get('alarms')} alarms")
    return True, alarms > 0, None, cause


def shutdown_bounded(r: dict[str, Any]) -> bool:
    if r.get("phase") == "init":
        return r.get("init_hung") is False
    ms = r.get("shutdown_ms")
    return ms is not None and ms <= SHUTDOWN_BOUND_MS


def run_fault(name: str, options: dict[str, Any], runs: int, judge: Callable[[dict[str, Any]], Verdict],
              per_run_s: float) -> dict[str, Any]:
    opts = {**COMMON, **options, "iterations": runs}
    t = time.monotonic()
    records, session_left = run_in_child(opts, timeout=30 + per_run_s * runs)
    results = [r for r in records if "phase" in r]
    errors = [r.get("error") or r.get("stderr") for r in records if "error" in r or "stderr" in r]
    detected = missed = alarms = bounded = 0
    latencies: list[float] = []
    causes: list[str] = []
    leftovers = list(session_left)
    pidfds = 0
    for r in results:
        ok, alarm, ms, cause = judge(r)
        detected += ok
        missed += not ok
        alarms += alarm
        bounded += shutdown_bounded(r)
        leftovers += r.get("survivors") or []
        pidfds = max(pidfds, r.get("pidfds_open") or 0)
        if ms is not None:
            latencies.append(float(ms))
        causes.append(cause)
    missed += runs - len(results)  # runs that never reported (the child failed): missed
    return {
        "fault": name, "runs": runs, "completed": len(results), "detected": detected, "missed": missed,
        "false_alarms": alarms, "p50_ms": percentile(latencies, 0.5), "p99_ms": percentile(latencies, 0.99),
        "shutdown_bounded": bounded == runs, "shutdown_bounded_runs": bounded,
        "leftover_processes": len(leftovers), "pidfds_left": pidfds,
        "cause": causes[0] if causes else None, "errors": [str(e)[-800:] for e in errors],
        "wall_s": round(time.monotonic() - t, 1),
    }


def busy_loops(n: int) -> list[subprocess.Popen[bytes]]:
    return [subprocess.Popen([sys.executable, "-c", BUSY_LOOP], start_new_session=True) for _ in range(n)]


def end_by_pid(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for proc in procs:
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            sys.stderr.write(f"warning: busy loop {proc.pid} did not exit\n")


def plan(runs: int, control_s: float, quick: bool, prefix: str) -> list[tuple[str, dict[str, Any], Any, float]]:
    init_delay = 1.0 if quick else 2.0
    rows: list[tuple[str, dict[str, Any], Any, float]] = [
        ("SIGKILL subordinate (main)", {"fault": "kill", "fault_rank": 1}, judge_death, 15),
        ("SIGKILL leader (1.2)", {"mode": "1.2", "fault": "kill", "fault_rank": 0}, judge_death, 15),
        ("SIGSEGV", {"fault": "segv", "fault_rank": 1}, judge_death, 15),
        ("os._exit(0) mid-request", {"fault": "exit0", "fault_rank": 1}, judge_death, 15),
        ("kernel OOM killer (64 MiB cgroup)", {"fault": "oom", "fault_rank": 1, "oom_limit_mb": 64}, judge_death, 20),
        ("two ranks at once (of 3)", {"fault": "kill", "workers": 3, "fault_ranks": [1, 2]}, judge_death, 15),
        ("death during init", {"fault": "kill", "fault_phase": "init", "fault_rank": 1,
                               "init_delay_s": init_delay}, judge_init, 20),
        ("MPI_Comm_spawn fails at start-up", {"fault": "spawn"}, judge_spawn, 15),
        ("death during shutdown", {"fault": "kill", "fault_phase": "shutdown", "fault_rank": 1}, judge_shutdown, 20),
        ("SIGSTOP (must not be dead)", {"mode": "1.2", "fault": "stop", "fault_rank": 1,
                                        "shutdown_grace_s": 0.5}, judge_stop, 20),
        ("D-state wedge (freezer)", {"fault": "wedge", "fault_rank": 1, "d_state_timeout_s": 0.5,
                                     "scan_interval_s": 0.05}, judge_wedge, 20),
        ("D-state wedge (FUSE, one thread)", {"fault": "fuse", "fault_rank": 1, "d_state_timeout_s": 0.5,
                                              "scan_interval_s": 0.05}, judge_wedge, 20),
    ]
    control = {"fault": "none", "control_s": control_s, "tokens": 50}
    rows.append((f"control {control_s:g}s, wedge detection on", control, judge_control, control_s + 20))
    rows.append((f"control {control_s:g}s, both cores busy", {**control, "busy": 2}, judge_control, control_s + 20))
    return [(name, {**options, "cgroup_prefix": prefix}, judge, per_run) for name, options, judge, per_run in rows]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--runs", type=int, default=None, help="runs per fault (default 5, --quick 2)")
    parser.add_argument("--control-s", type=float, default=None, help="length of each control (default 60, --quick 10)")
    parser.add_argument("--quick", action="store_true", help="fewer runs and 10 s controls (about 90 s)")
    args = parser.parse_args()
    runs = args.runs or (2 if args.quick else 5)
    control_s = args.control_s or (10.0 if args.quick else 60.0)
    prefix = f"trtllm-liveness-matrix-{uuid.uuid4().hex[:8]}"
    skips = {"oom": memory_cgroup_available(), "wedge": freezer_available(), "fuse": fuse_available()}
    t_start = time.monotonic()
    rows: list[dict[str, Any]] = []
    busy: list[subprocess.Popen[bytes]] = []
    try:
        for name, options, judge, per_run in plan(runs, control_s, args.quick, prefix):
            reason = skips.get(options["fault"])
            if reason is not None:
                rows.append({"fault": name, "skipped": reason})
                continue
            n_busy = options.pop("busy", 0)
            busy = busy_loops(n_busy)
            try:
                rows.append(run_fault(name, options, 1 if options["fault"] == "none" else runs, judge, per_run))
            finally:
                end_by_pid(busy)
                busy = []
    finally:  # also on Ctrl-C: run_in_child has killed its session; end ours and the cgroups
        end_by_pid(busy)
        left_groups = remove_leftover_groups(prefix)
        left_groups += remove_leftover_mounts()  # a FUSE stall of a scenario child that was killed
    measured = [row for row in rows if "skipped" not in row]
    faults = [row for row in measured if not row["fault"].startswith(("control", "SIGSTOP"))]
    result = {
        "command": " ".join(["scripts/fault_matrix.py", *sys.argv[1:]]),
        "runs_per_fault": runs, "control_s": control_s, "rows": rows,
        "targets": {
            "every_fault_detected_every_run": all(r["missed"] == 0 for r in faults),
            "zero_false_alarms": all(r["false_alarms"] == 0 for r in measured),
            "shutdown_bounded_every_run": all(r["shutdown_bounded"] for r in measured),
            "zero_leftover_processes": all(r["leftover_processes"] == 0 for r in measured),
            "zero_pidfds_left": all(r["pidfds_left"] == 0 for r in measured),
            "cgroups_left_behind": left_groups,
        },
        "machine": {"cpus": os.cpu_count(), "kernel": os.uname().release},
        "wall_s": round(time.monotonic() - t_start, 1),
    }
    targets = result["targets"]
    met = all(v for k, v in targets.items() if k != "cgroups_left_behind") and not left_groups
    result["targets_met"] = met
    header = (f"{'fault':36} {'runs':>4} {'det':>4} {'miss':>4} {'false':>5} {'p50 ms':>9} {'p99 ms':>9} "
              f"{'bounded':>7} {'left':>4}  cause reported")
    print(header)
    print("-" * len(header))
    for row in rows:
        if "skipped" in row:
            print(f"{row['fault']:36} skipped: {row['skipped']}")
            continue
        print(f"{row['fault']:36} {row['runs']:>4} {row['detected']:>4} {row['missed']:>4} {row['false_alarms']:>5} "
              f"{_fmt(row['p50_ms']):>9} {_fmt(row['p99_ms']):>9} {('yes' if row['shutdown_bounded'] else 'NO'):>7} "
              f"{row['leftover_processes']:>4}  {str(row['cause'])[:110]}")
        for error in row["errors"]:
            print(f"    error: {error.strip().splitlines()[-1] if error.strip() else error}")
    print()
    for key, value in targets.items():
        print(f"{key:36} {value}")
    print(f"{'wall time':36} {result['wall_s']} s")
    if args.json:
        print(json.dumps(result))
    return 0 if met else 1


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


if __name__ == "__main__":
    try:
        sys.exit(main())
    finally:
        remove_orphaned_prte_tmpdirs()  # PRRTE bases of MPI launchers this run killed
