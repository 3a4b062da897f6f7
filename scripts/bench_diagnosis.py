#!/usr/bin/env python3
"""Benchmark the diagnosis snapshot (``trtllm_liveness.diagnose._diagnosis.diagnose``) on 8 real ranks.

Starts ``--ranks`` (8) Python processes, each with ``--threads`` (4) threads sleeping in a
distinctively named function (a rank waiting in a collective), then times, interleaved over
``--reps`` rounds (median and max):

- ``baseline_ms_8_ranks``: one bare read of ``/proc/PID/task/TID/stat`` per thread of every rank;
- ``diagnosis_ms_8_ranks``: ``diagnose(pids, stacks=False)``: the scan, per-thread CPU over the
  default 0.2 s window (most of the figure, by design), classification, odd rank out;
- ``diagnosis_stacks_ms_8_ranks``: the same with Python stacks by ``py-spy dump --nonblocking``
  (all ranks in parallel, one deadline); skipped (null) when py-spy is not installed;
- ``snapshot_ms_8_ranks_faulthandler``: the stacks of every rank without ptrace, from the dump each
  rank registered at its start (``take_faulthandler_stacks``: every rank signalled through its
  pidfd, the dumps read in parallel under one deadline, parsed).
- ``snapshot_ms_8_ranks_4_hosts``: the whole engine's snapshot as a fatal verdict takes it
  (``Diagnoser.take(snapshot=True)``: the proxy host's ranks here, every other host's by its agent,
  on request, merged), stacks on, of the upstream-shaped engine with 8 ranks on 4 namespace test
  hosts (tests/support/multihost_engine.py; 2 ranks each, rank 0 is the proxy's own process);
  each run's ranks without stacks are counted (``snapshot_4_hosts_ranks_without_stacks``, target:
  none; a bound that ran out is printed on stderr). Null where the test hosts are unavailable
  (``--hosts-reps 0`` skips it).

Each stacks run is checked to have named the function every rank sleeps in.

- ``stop_delay_ms``: on the reference executor (``trtllm_liveness.demo``: real MPI ranks,
  ``--stop-workers`` of them) with a real fault (one rank SIGKILLed while requests stream), from
  the fatal verdict (the event's wall time) to the bounded stop's start, whose first signal follows
  at once (the stop report's ``started_wall``), with ``shutdown()`` called as soon as
  ``check_health()`` turned False and every request failed: the snapshot taken before the stop
  (``diagnosis_before_stop_s`` 0.3, the default) is most of it. Beside it
  ``stop_delay_baseline_ms``: the same with ``diagnosis_before_stop_s=0`` (no wait for the
  snapshot). ``--stop-reps`` runs of each, interleaved (0 skips both).

Targets: diagnosis_ms_8_ranks <= 300, diagnosis_stacks_ms_8_ranks <= 3000,
snapshot_ms_8_ranks_faulthandler <= 300, snapshot_ms_8_ranks_4_hosts <= 1000, stop_delay_ms <= 350.

Usage: scripts/bench_diagnosis.py [--json] [--reps N] [--ranks N] [--threads N] [--stop-reps N]
       [--hosts-reps N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.support.leftovers import remove_gone_dump_files
from trtllm_liveness.diagnose import _diagnosis, _faulthandler_stacks, _py_spy
from trtllm_liveness.process import _procfs

TARGETS = {"diagnosis_ms_8_ranks": 300.0, "diagnosis_stacks_ms_8_ranks": 3000.0,
           "snapshot_ms_8_ranks_faulthandler": 300.0, "snapshot_ms_8_ranks_4_hosts": 1000.0,
           "stop_delay_ms": 350.0}
STOP_RUN_TIMEOUT_S = 60.0
FOUR_HOSTS = (("hostA", 2), ("hostB", 2), ("hostC", 2), ("hostD", 2))

RANK = """\
import sys, threading
from trtllm_liveness.diagnose._faulthandler_stacks import register_stack_dump
if register_stack_dump() is None:
    raise SystemExit("no stack dump registered")
def wait_in_a_collective_that_never_completes(never):
    never.wait()
never = threading.Event()
for index in range({extra}):
    threading.Thread(target=wait_in_a_collective_that_never_completes, args=(never,), daemon=True).start()
sys.stdout.write("ready\\n"); sys.stdout.flush()
wait_in_a_collective_that_never_completes(never)
"""
FUNCTION = "wait_in_a_collective_that_never_completes"


def _start(count: int, threads: int) -> list[subprocess.Popen[bytes]]:
    procs: list[subprocess.Popen[bytes]] = []
    for _ in range(count):
        proc = subprocess.Popen([sys.executable, "-c", RANK.format(extra=threads - 1)], stdout=subprocess.PIPE,
                                start_new_session=True)
        procs.append(proc)
    for proc in procs:
        assert proc.stdout is not None
        if proc.stdout.readline() != b"ready\n":
            raise RuntimeError(f"rank pid {proc.pid} did not start")
    return procs


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()  # our own unreaped children
    for proc in procs:
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            print(f"rank pid {proc.pid} did not exit", file=sys.stderr)
        if proc.stdout is not None:
            proc.stdout.close()
    remove_gone_dump_files()  # the killed ranks' dump files


def _baseline(pids: list[int]) -> float:
    start = time.perf_counter()
    for pid in pids:
        for tid in _procfs.list_tids(pid):
            _procfs.read_stat_bytes(pid, tid)
    return (time.perf_counter() - start) * 1000.0


def _timed_diagnosis(pids: list[int], stacks: bool) -> float:
    start = time.perf_counter()
    diagnosis = _diagnosis.diagnose(pids, stacks=stacks)
    elapsed = (time.perf_counter() - start) * 1000.0
    if stacks:
        missed = [rank.pid for rank in diagnosis.ranks if rank.stuck_in is None or rank.stuck_in.function != FUNCTION]
        if missed:
            raise RuntimeError(f"stacks did not name {FUNCTION} for pids {missed}: {diagnosis.summary()}")
    return elapsed


def _timed_faulthandler(pids: list[int]) -> float:
    targets = [(pid, _procfs.read_start_time(pid)) for pid in pids]
    start = time.perf_counter()
    results = _faulthandler_stacks.take_faulthandler_stacks(targets)
    elapsed = (time.perf_counter() - start) * 1000.0
    missed = [pid for pid, stacks in results.items()
              if (main := stacks.main_thread(pid)) is None or main.stuck_in is None
              or main.stuck_in.function != FUNCTION]
    if missed:
        raise RuntimeError(f"faulthandler stacks did not name {FUNCTION} for pids {missed}: {results}")
    return elapsed


def _stop_delay(workers: int, before_stop_s: float) -> float:
    """One run of the reference executor with rank 1 SIGKILLed: fatal verdict -> the bounded stop's
    start (ms). ``RuntimeError`` when the run did not get that far."""
    from trtllm_liveness.demo._scenario_launcher import run_scenario
    from trtllm_liveness.demo._scenario_records import ScenarioOptions

    opts = ScenarioOptions(workers=workers, fault="kill", fault_rank=1, tokens=200,
                           diagnosis_before_stop_s=before_stop_s)
    run = run_scenario(opts, STOP_RUN_TIMEOUT_S)
    out = run.results[0] if run.results else None
    report = None if out is None or out.shutdown is None else out.shutdown.report
    if out is None or report is None or not out.events:
        raise RuntimeError(f"stop delay run failed: {run.problems()}")
    return (report.started_wall - out.events[0].wall_time) * 1000.0


def _hosts_snapshots(reps: int) -> tuple[list[float], list[int], str]:
    """``reps`` whole-engine snapshots of 8 ranks on 4 test hosts: each one's ms and how many of
    ranks 1-7 it has no stacks of; ([], [], why) where the test hosts are unavailable."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.support.multihost_engine import Engine, StartFailed
    from tests.support.testhosts import TestHosts, unavailable, wait_for

    why = unavailable()
    if why:
        return [], [], why
    with TestHosts(names=[name for name, _count in FOUR_HOSTS]) as hosts:
        try:
            engine = Engine(hosts, FOUR_HOSTS, program={"snapshots": reps + 1})  # the first one warms up
        except StartFailed as exc:
            return [], [], str(exc)[:300]
        def taken() -> list[dict[str, Any]]:
            return [record["snapshot"] for record in engine.records() if "ms" in (record.get("snapshot") or {})]

        if not wait_for(lambda: len(taken()) > reps, 30.0 + 10.0 * reps, 0.05):
            raise RuntimeError(f"{reps + 1} snapshots did not come:\n{engine.diagnostics()}")
        found: list[float] = []
        missed: list[int] = []
        for index, snapshot in enumerate(taken()):
            ranks = {row[0]: row for row in snapshot["ranks"]}
            missing = [rank for rank in range(1, 8) if rank not in ranks or ranks[rank][3] != "taken"]
            if missing:
                print(f"snapshot {index} without the stacks of ranks {missing}: {snapshot}", file=sys.stderr)
            if index:
                found.append(float(snapshot["ms"]))
                missed.append(len(missing))
        engine.job.kill()
    return found, missed, ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--threads", type=int, default=4, help="threads per rank (default 4)")
    parser.add_argument("--stop-reps", type=int, default=3, help="stop-delay runs of each kind (0 skips them)")
    parser.add_argument("--stop-workers", type=int, default=4, help="MPI ranks of the stop-delay runs (default 4)")
    parser.add_argument("--hosts-reps", type=int, default=5, help="whole-engine snapshots on 4 test hosts (0: skip)")
    args = parser.parse_args()
    py_spy = _py_spy.find_py_spy()
    procs = _start(args.ranks, args.threads)
    samples: dict[str, list[float]] = {"baseline": [], "diagnosis": [], "stacks": [], "faulthandler": [],
                                       "stop_delay": [], "stop_delay_baseline": []}
    try:
        pids = [proc.pid for proc in procs]
        time.sleep(0.2)  # let the ranks settle into their wait
        if py_spy is not None:
            _py_spy._supports_json(py_spy)  # the one-time --help probe, not part of a snapshot
        for _ in range(args.reps):
            samples["baseline"].append(_baseline(pids))
            samples["diagnosis"].append(_timed_diagnosis(pids, stacks=False))
            if py_spy is not None:
                samples["stacks"].append(_timed_diagnosis(pids, stacks=True))
            samples["faulthandler"].append(_timed_faulthandler(pids))
    finally:
        _stop(procs)
    for _ in range(args.stop_reps):  # after the ranks above are gone: they would load the machine
        samples["stop_delay_baseline"].append(_stop_delay(args.stop_workers, 0.0))
        samples["stop_delay"].append(_stop_delay(args.stop_workers, 0.3))
    hosts_skipped = "--hosts-reps 0"
    hosts_missed: list[int] = []
    if args.hosts_reps > 0:
        samples["hosts"], hosts_missed, hosts_skipped = _hosts_snapshots(args.hosts_reps)
    else:
        samples["hosts"] = []

    def med(name: str) -> float | None:
        return round(statistics.median(samples[name]), 1) if samples[name] else None

    def top(name: str) -> float | None:
        return round(max(samples[name]), 1) if samples[name] else None

    figures = {
        "ranks": args.ranks, "threads_per_rank": args.threads, "reps": args.reps,
        "cpu_window_s": _diagnosis.DEFAULT_WINDOW_S, "py_spy": py_spy or "",
        "baseline_ms_8_ranks": med("baseline"), "baseline_max_ms": top("baseline"),
        "diagnosis_ms_8_ranks": med("diagnosis"), "diagnosis_max_ms": top("diagnosis"),
        "diagnosis_stacks_ms_8_ranks": med("stacks"), "diagnosis_stacks_max_ms": top("stacks"),
        "snapshot_ms_8_ranks_faulthandler": med("faulthandler"), "snapshot_faulthandler_max_ms": top("faulthandler"),
        "stop_reps": args.stop_reps, "stop_workers": args.stop_workers,
        "stop_delay_ms": med("stop_delay"), "stop_delay_max_ms": top("stop_delay"),
        "stop_delay_baseline_ms": med("stop_delay_baseline"), "stop_delay_baseline_max_ms": top("stop_delay_baseline"),
        "snapshot_ms_8_ranks_4_hosts": med("hosts"), "snapshot_4_hosts_max_ms": top("hosts"),
        "snapshot_4_hosts_skipped": hosts_skipped if not samples["hosts"] else "",
        "snapshot_4_hosts_ranks_without_stacks": hosts_missed,
    }
    skipped = {"stop_delay_ms"} if not args.stop_reps else set()
    if not samples["hosts"]:
        skipped.add("snapshot_ms_8_ranks_4_hosts")  # --hosts-reps 0, or no test hosts here (the reason is printed)
    verdicts = {name: (figures[name] is not None and float(figures[name] or 0) <= target)
                for name, target in TARGETS.items() if name not in skipped}
    if samples["hosts"]:
        verdicts["snapshot_4_hosts_every_rank_has_stacks"] = not any(hosts_missed)
    figures["targets_met"] = all(verdicts.values())
    if not args.json:
        print(f"{'figure':<34} {'median ms':>10} {'max ms':>10} {'target':>8}")
        for name, maximum in (("baseline_ms_8_ranks", "baseline_max_ms"), ("diagnosis_ms_8_ranks", "diagnosis_max_ms"),
                              ("diagnosis_stacks_ms_8_ranks", "diagnosis_stacks_max_ms"),
                              ("snapshot_ms_8_ranks_faulthandler", "snapshot_faulthandler_max_ms"),
                              ("stop_delay_baseline_ms", "stop_delay_baseline_max_ms"),
                              ("stop_delay_ms", "stop_delay_max_ms"),
                              ("snapshot_ms_8_ranks_4_hosts", "snapshot_4_hosts_max_ms")):
            target = TARGETS.get(name) if name in verdicts else None
            shown = "-" if target is None else f"<= {target:g}" + ("" if verdicts[name] else " MISSED")
            print(f"{name:<34} {figures[name]!s:>10} {figures[maximum]!s:>10} {shown:>8}")
        if samples["hosts"]:
            print(f"4 hosts: ranks without stacks, per snapshot: {hosts_missed} (target: none)")
    print(json.dumps(figures))
    return 0 if figures["targets_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
