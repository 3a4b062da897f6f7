#!/usr/bin/env python3
"""End-to-end benchmark: SIGKILL an MPI worker with requests in flight.

The executor (``--executor``): ``reference`` (default; the package's reference executor) or
``fake``, the upstream-shaped fakes of ``tensorrt_llm`` (``tests/fakes/trtllm_main`` for the main
samples, ``trtllm_v12`` for the 1.2 ones), built through the fake's own
``GenerationExecutor.create(FakeEngine(...), model_world_size=N)`` (with ``liveness_executor_class``
when liveness is on). The Dynamo figures run their own helpers either way.

Measures, side by side in one run (Open MPI with OMPI_MCA_mpi_ft_enable=1, the case where the
engine otherwise hangs):

- ``e2e_p50_ms`` / ``e2e_p99_ms``: liveness on, SIGKILL -> ``check_health()`` False AND every
  pending request failed (>= 20 kills, half in main mode on a subordinate, half in 1.2 mode on
  the leader);
- ``mpi_rank_floor_p50_ms`` / ``mpi_rank_floor_max_ms``: the kernel's floor on the same kills: a
  bare pidfd the benchmark opened on the victim rank (verified against its start time) just
  before the SIGKILL, polled by a separate process, SIGKILL -> readable. An MPI rank's exit (its
  mappings, threads and sockets torn down) takes longer than a small process's, so this, not
  ``bench_detection.py``'s floor, is what ``e2e`` is compared with;
- ``upstream_poll_p50_ms``: main mode without the extension, only upstream's 5 s
  ``proxy_error_monitor`` loop (time until ``_fatal_error`` is set; a few samples);
- ``disabled_detected``: 1.2 mode without the extension: does anything notice within the window
  (default 30 s)? Expected false: the field failure.

Dynamo (needs ``ai-dynamo-runtime``, and the ``ai-dynamo`` wheel for the stock monitor), each worker
a child process in its own session (helpers in ``tests/support/``):

- ``dynamo_503_p50_ms`` / ``dynamo_503_p99_ms``: SIGKILL of a rank -> the real system status
  server's ``/health`` answers 503, through ``attach_to_dynamo`` (>= 10 kills in one worker: all
  but the last are rehearsals whose runtime shutdown is withheld; the 503 path is the same);
  ``dynamo_exit_ms``: the last kill -> that worker process exits (status in ``dynamo_exit_status``);
- ``stock_dynamo_exit_p50_ms``: baseline, no Dynamo module of ours: the REAL ``TrtllmEngineMonitor``
  (0.5 s ``_fatal_error`` watchdog) over the extension, SIGKILL -> process exit (status 1); the
  kill comes at a random phase of Dynamo's poll cycle, as a real death would;
- ``stock_dynamo_upstream_main_exit_ms``: the same monitor over upstream main without the
  extension: only Dynamo's 2 s ``check_health`` poll notices (upstream's own loop is 5 s);
  ``stock_dynamo_12_no_extension_exits``: over 1.2.x without it, does the worker ever exit within
  the window? Expected false.

Stalls (``scripts/bench_stall.py``, run as a child; its docstring says how): ``stall_overshoot_p50_ms`` /
``stall_overshoot_p99_ms`` (a stall declared past ``stall_timeout_s``, >= 20 real stalls: a SIGSTOPped
rank; target p99 <= 50), beside ``stall_poll_baseline_p50_ms`` (a 0.1 s polling watchdog on the same
stalls), and ``false_stalls_loaded_60s`` (a 60 s control, 2 s timeout, both cores busy, near misses at
80% of the timeout; target 0). Diagnosis (``scripts/bench_diagnosis.py``): ``diagnosis_ms_8_ranks``
(target <= 300) and ``diagnosis_stacks_ms_8_ranks`` with py-spy (target <= 3000).

Usage: ``scripts/bench_e2e.py [--quick] [--kills N] [--dynamo-kills N] [--disabled-window S]
[--executor reference|fake] [--stall-cycles N] [--stall-control-s S] [--json]``.
Needs the mpi extra. ``--quick`` cuts the sample counts (still >= 10 Dynamo kills) for a ~1 min run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import _bench

from tests.support.leftovers import remove_orphaned_prte_tmpdirs
from tests.support.upstream_fakes import FAKE_ENGINE, tree
from trtllm_liveness.demo._scenario_launcher import run_scenario
from trtllm_liveness.demo._scenario_records import Detection, ScenarioResult

REPO = Path(__file__).resolve().parents[1]
FAKES = {"main": tree("main"), "1.2": tree("v12")}
EXECUTOR = "reference"  # --executor


def percentile(values: list[float], q: float) -> float:
    value = _bench.percentile(values, q)
    return float("nan") if value is None else value


def samples(options: dict[str, Any], timeout: float) -> list[ScenarioResult]:
    if EXECUTOR == "fake":
        # The fake tree of the mode first on the child's path; liveness through the executor class;
        # one iteration per child (upstream's API takes one per process: ScenarioOptions).
        env = {"PYTHONPATH": str(FAKES[options.get("mode", "main")])}
        one = {**options, "iterations": 1, "via": "executor_cls" if options.get("liveness", True) else "plain",
               "engine": FAKE_ENGINE}
        return [r for _ in range(int(options.get("iterations", 1))) for r in _samples(one, timeout, env)]
    return _samples(options, timeout, None)


def _samples(options: dict[str, Any], timeout: float, env: dict[str, str] | None) -> list[ScenarioResult]:
    run = run_scenario(options, timeout, env)
    if run.survivors:
        sys.stderr.write(f"warning: processes left behind and killed late: {list(run.survivors)}\n")
    if not run.done:
        sys.stderr.write(f"warning: scenario incomplete: {(run.error or run.stderr)[-1500:]}\n")
    return list(run.results)


def detections(results: list[ScenarioResult]) -> list[Detection]:
    return [r.detection for r in results if r.detection is not None]


def have(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def dynamo_503(kills: int) -> dict[str, Any]:
    """SIGKILL -> /health 503 through our bridge, ``kills`` times in one worker; then the exit."""
    from tests.support.children import HelperProcess, free_port, http_get, identities_of
    from tests.support.ref_engine import kill_rank

    port = free_port()
    env = {"DYN_SYSTEM_PORT": str(port), "DYN_SYSTEM_HOST": "127.0.0.1", "DYN_TCP_RPC_HOST": "127.0.0.1",
           "DYN_LOG": "error"}
    latencies: list[float] = []
    out: dict[str, Any] = {"dynamo_exit_ms": None, "dynamo_exit_status": None}
    with HelperProcess("dynamo_engine_worker", {"mode": "main", "iterations": kills, "shutdown_timeout_s": 10},
                       env) as worker:
        for iteration in range(kills):
            ready = worker.read_record(60, "ready")
            deadline = time.monotonic() + 20
            while http_get(port, "/health")[0] != 200 and time.monotonic() < deadline:
                time.sleep(0.01)
            victim = identities_of(ready)[iteration % 2]
            t0 = time.monotonic()
            kill_rank(victim)
            while time.monotonic() < t0 + 10:
                status, _ = http_get(port, "/health", timeout=1.0)
                if status == 503:
                    latencies.append((time.monotonic() - t0) * 1e3)
                    break
                # The last iteration shuts the runtime down at once: the server may be gone before a
                # probe sees the 503. Stop probing then, so the exit time below is the real one.
                if worker.wait_exit(0) is not None:
                    break
            if iteration < kills - 1:
                worker.send("next")
        out["dynamo_exit_status"] = worker.wait_exit(30)
        if worker.exit_time is not None:
            out["dynamo_exit_ms"] = round((worker.exit_time - t0) * 1e3, 1)
        survivors = worker.close()
    if survivors:
        sys.stderr.write(f"warning: Dynamo worker processes left behind: {survivors}\n")
    out.update({
        "dynamo_503_samples": len(latencies),
        "dynamo_503_p50_ms": round(percentile(latencies, 0.5), 3),
        "dynamo_503_p99_ms": round(percentile(latencies, 0.99), 3),
    })
    return out


def stock_exit(mode: str, liveness: bool, max_life_s: float = 30.0) -> tuple[float | None, int | None]:
    """Stock TrtllmEngineMonitor: SIGKILL a rank -> worker process exit (ms, status)."""
    from tests.support.children import HelperProcess, identities_of
    from tests.support.ref_engine import kill_rank

    with HelperProcess("dynamo_stock_worker", {"mode": mode, "liveness": liveness, "max_life_s": max_life_s}) as worker:
        ready = worker.read_record(60, "ready")
        # Dynamo's pollers start with the monitor: kill at a random phase of their 2 s cycle.
        time.sleep(random.uniform(0.0, 2.0))
        t0 = time.monotonic()
        kill_rank(identities_of(ready)[1])
        status = worker.wait_exit(max_life_s + 30)
        elapsed = None if worker.exit_time is None else (worker.exit_time - t0) * 1e3
        survivors = worker.close()
    if survivors:
        sys.stderr.write(f"warning: stock Dynamo worker processes left behind: {survivors}\n")
    return elapsed, status


def script_figures(script: str, *args: str, timeout: float = 900) -> dict[str, Any]:
    """Run one of the other benchmark scripts with ``--json``; its JSON object (``{}`` if none)."""
    try:
        run = subprocess.run([sys.executable, str(REPO / "scripts" / script), *args, "--json"], capture_output=True,
                             timeout=timeout, check=False, start_new_session=True)
    except subprocess.TimeoutExpired:
        return {}
    lines = [line for line in run.stdout.decode().splitlines() if line.startswith("{")]
    return dict(json.loads(lines[-1])) if lines else {}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer samples (about a minute)")
    parser.add_argument("--kills", type=int, default=None, help="reference executor kills (default 20, quick 8)")
    parser.add_argument("--upstream-samples", type=int, default=None)
    parser.add_argument("--disabled-window", type=float, default=None, help="seconds (default 30, quick 10)")
    parser.add_argument("--dynamo-kills", type=int, default=None, help="SIGKILL -> 503 samples (default 20, quick 10)")
    parser.add_argument("--stock-samples", type=int, default=None, help="stock Dynamo exits (default 6, quick 2)")
    parser.add_argument("--executor", choices=("reference", "fake"), default="reference",
                        help="what the kill samples run on (default: the reference executor)")
    parser.add_argument("--stall-cycles", type=int, default=20, help="real stalls timed (default 20)")
    parser.add_argument("--stall-control-s", type=float, default=None, help="loaded control (default 60, quick 20)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    global EXECUTOR
    EXECUTOR = args.executor
    quick = args.quick
    args.kills = args.kills if args.kills is not None else (8 if quick else 20)
    args.upstream_samples = args.upstream_samples if args.upstream_samples is not None else (1 if quick else 3)
    args.disabled_window = args.disabled_window if args.disabled_window is not None else (10.0 if quick else 30.0)
    args.dynamo_kills = max(10, args.dynamo_kills if args.dynamo_kills is not None else (10 if quick else 20))
    args.stock_samples = args.stock_samples if args.stock_samples is not None else (2 if quick else 6)
    t_start = time.monotonic()

    disabled: list[ScenarioResult] = []
    # The disabled baseline mostly waits: run it beside the others to keep the wall time down.
    baseline = threading.Thread(target=lambda: disabled.extend(samples(
        {"mode": "1.2", "liveness": False, "fault": "kill", "observe_s": args.disabled_window,
         "stall_timeout_s": 1.0}, args.disabled_window + 60)), daemon=True)
    baseline.start()
    with_runtime = have("dynamo.runtime")
    with_monitor = with_runtime and have("dynamo.trtllm.engine_monitor")
    stock_12_plain: list[tuple[float | None, int | None]] = []
    stock_baseline = threading.Thread(target=lambda: stock_12_plain.append(
        stock_exit("1.2", False, max_life_s=args.disabled_window)), daemon=True)
    if with_monitor:
        stock_baseline.start()

    half = args.kills // 2
    kills = samples({"mode": "main", "fault": "kill", "fault_rank": 1, "iterations": args.kills - half,
                     "tokens": 300, "observe_s": 10}, 300)
    kills += samples({"mode": "1.2", "fault": "kill", "fault_rank": 0, "iterations": half,
                      "tokens": 300, "observe_s": 10}, 300)
    upstream = samples({"mode": "main", "liveness": False, "fault": "kill", "health_probe": "fatal_error",
                        "iterations": args.upstream_samples, "tokens": 1500, "observe_s": 12}, 200)
    dynamo: dict[str, Any] = dynamo_503(args.dynamo_kills) if with_runtime else {}
    stock = [stock_exit(("1.2", "main")[i % 2], True) for i in range(args.stock_samples)] if with_monitor else []
    stock_ms = [ms for ms, status in stock if ms is not None and status == 1]
    stock_up = [stock_exit("main", False) for _ in range(1 if quick else 2)] if with_monitor else []
    stock_up_ms = [ms for ms, status in stock_up if ms is not None and status == 1]
    baseline.join(args.disabled_window + 90)
    if with_monitor:
        stock_baseline.join(args.disabled_window + 90)
    control_s = args.stall_control_s if args.stall_control_s is not None else (20.0 if quick else 60.0)
    stall = script_figures("bench_stall.py", "--cycles", str(args.stall_cycles), "--control-s", str(control_s))
    diagnosis = script_figures("bench_diagnosis.py")

    e2e = [d.e2e_ms for d in detections(kills) if d.e2e_ms is not None]
    detect = [d.detected_ms for d in detections(kills) if d.detected_ms is not None]
    floor = [d.floor_ms for d in detections(kills) if d.floor_ms is not None]
    up = [d.e2e_ms for d in detections(upstream) if d.e2e_ms is not None]
    dis = detections(disabled)[0] if detections(disabled) else None
    result = {
        "executor": EXECUTOR,
        "kills": len(kills),
        "kills_detected": len(e2e),
        "e2e_p50_ms": round(percentile(e2e, 0.5), 3),
        "e2e_p99_ms": round(percentile(e2e, 0.99), 3),
        "e2e_max_ms": round(max(e2e), 3) if e2e else None,
        "detect_p50_ms": round(percentile(detect, 0.5), 3),
        "mpi_rank_floor_p50_ms": round(percentile(floor, 0.5), 3),
        "mpi_rank_floor_max_ms": round(max(floor), 3) if floor else None,
        "mpi_rank_floor_samples": len(floor),
        "upstream_poll_p50_ms": round(statistics.median(up), 3) if up else None,
        "upstream_poll_samples": len(up),
        "disabled_detected": dis is not None and (dis.health_false_ms is not None
                                                  or dis.requests_failed_ms is not None),
        "disabled_window_s": args.disabled_window,
        "disabled_pending_after_window": disabled[0].pending_not_done if disabled else None,
        **{key: dynamo.get(key) for key in ("dynamo_503_p50_ms", "dynamo_503_p99_ms", "dynamo_503_samples",
                                            "dynamo_exit_ms", "dynamo_exit_status")},
        "stock_dynamo_exit_p50_ms": round(statistics.median(stock_ms), 1) if stock_ms else None,
        "stock_dynamo_exit_max_ms": round(max(stock_ms), 1) if stock_ms else None,
        "stock_dynamo_exit_samples": f"{len(stock_ms)}/{len(stock)} exited with status 1",
        "stock_dynamo_upstream_main_exit_ms": round(statistics.median(stock_up_ms), 1) if stock_up_ms else None,
        "stock_dynamo_12_no_extension_exits": (stock_12_plain[0][1] == 1) if stock_12_plain else None,
        "upstream_only_note": "stock Dynamo without the extension: 2 s check_health poll (main) + 5 s upstream "
                              "loop; 1.2.x never",
        **{key: stall.get(key) for key in ("stall_overshoot_p50_ms", "stall_overshoot_p99_ms", "stall_cycles",
                                           "stall_poll_baseline_p50_ms", "false_stalls_loaded_60s", "control_s",
                                           "near_misses")},
        **{key: diagnosis.get(key) for key in ("diagnosis_ms_8_ranks", "diagnosis_stacks_ms_8_ranks")},
        "wall_s": round(time.monotonic() - t_start, 1),
    }
    print(f"{'measurement':44} {'value':>12}")
    print(f"{'SIGKILL -> health False + all failed, p50':44} {result['e2e_p50_ms']:>9} ms")
    print(f"{'SIGKILL -> health False + all failed, p99':44} {result['e2e_p99_ms']:>9} ms")
    print(f"{'  kills measured / detected':44} {result['kills']:>6} / {result['kills_detected']}")
    print(f"{'MPI rank floor (bare pidfd) on them, p50':44} {result['mpi_rank_floor_p50_ms']:>9} ms")
    print(f"{'MPI rank floor (bare pidfd) on them, max':44} {result['mpi_rank_floor_max_ms']!s:>9} ms")
    print(f"{'upstream main, 5 s poll loop only, p50':44} {result['upstream_poll_p50_ms']!s:>9} ms")
    label = f"no extension: noticed within {args.disabled_window} s"
    print(f"{label:44} {result['disabled_detected']!s:>12}")
    print(f"{'Dynamo bridge: SIGKILL -> /health 503, p50':44} {result['dynamo_503_p50_ms']!s:>9} ms")
    print(f"{'Dynamo bridge: SIGKILL -> /health 503, p99':44} {result['dynamo_503_p99_ms']!s:>9} ms")
    print(f"{'  samples':44} {result['dynamo_503_samples']!s:>12}")
    print(f"{'Dynamo bridge: SIGKILL -> exit (status)':44} {result['dynamo_exit_ms']!s:>9} ms "
          f"({result['dynamo_exit_status']})")
    print(f"{'stock TrtllmEngineMonitor + extension, p50':44} {result['stock_dynamo_exit_p50_ms']!s:>9} ms")
    print(f"{'  ' + result['stock_dynamo_exit_samples']:44}")
    print(f"{'stock monitor, upstream main only':44} {result['stock_dynamo_upstream_main_exit_ms']!s:>9} ms")
    label = f"stock monitor, 1.2.x only: exits within {args.disabled_window} s"
    print(f"{label:44} {result['stock_dynamo_12_no_extension_exits']!s:>12}")
    print(f"{'stall declared past the timeout, p50':44} {result['stall_overshoot_p50_ms']!s:>9} ms")
    print(f"{'stall declared past the timeout, p99':44} {result['stall_overshoot_p99_ms']!s:>9} ms")
    print(f"{'  stalls timed':44} {result['stall_cycles']!s:>12}")
    print(f"{'  baseline: 0.1 s polling watchdog, p50':44} {result['stall_poll_baseline_p50_ms']!s:>9} ms")
    label = f"false stalls, {result['control_s']} s loaded control"
    print(f"{label:44} {result['false_stalls_loaded_60s']!s:>12}")
    print(f"{'diagnosis of 8 ranks, no stacks':44} {result['diagnosis_ms_8_ranks']!s:>9} ms")
    print(f"{'diagnosis of 8 ranks, py-spy stacks':44} {result['diagnosis_stacks_ms_8_ranks']!s:>9} ms")
    print(f"{'wall time':44} {result['wall_s']:>10} s")
    e2e_p50, floor_p50 = result["e2e_p50_ms"], result["mpi_rank_floor_p50_ms"]
    checks = [
        ("e2e_p99_ms <= 10", result["e2e_p99_ms"] is not None and result["e2e_p99_ms"] <= 10),
        ("e2e_p50_ms within 1 ms of mpi_rank_floor_p50_ms",
         bool(e2e and floor) and abs(e2e_p50 - floor_p50) <= 1.0),
        ("dynamo_503_p99_ms <= 100", result["dynamo_503_p99_ms"] is not None and result["dynamo_503_p99_ms"] <= 100),
        ("disabled_detected is false", result["disabled_detected"] is False),
        ("stall_overshoot_p99_ms <= 50 (>= 20 stalls)", result["stall_overshoot_p99_ms"] is not None
         and result["stall_overshoot_p99_ms"] <= 50 and (result["stall_cycles"] or 0) >= 20),
        ("false_stalls_loaded_60s == 0", result["false_stalls_loaded_60s"] == 0),
        ("diagnosis_ms_8_ranks <= 300", result["diagnosis_ms_8_ranks"] is not None
         and result["diagnosis_ms_8_ranks"] <= 300),
        ("diagnosis_stacks_ms_8_ranks <= 3000", result["diagnosis_stacks_ms_8_ranks"] is not None
         and result["diagnosis_stacks_ms_8_ranks"] <= 3000),
    ]
    return _bench.finish(checks, result, as_json=args.json)


if __name__ == "__main__":
    try:
        sys.exit(main())
    finally:
        remove_orphaned_prte_tmpdirs()  # PRRTE bases of MPI launchers this run killed
