#!/usr/bin/env python3
"""Fault matrix: every way a worker can fail, on real MPI workers, with liveness on.

Runs an executor (Open MPI, ``OMPI_MCA_mpi_ft_enable=1``, the setting where the engine otherwise
hangs) through each fault ``--runs`` times. ``--executor fake`` (default): the upstream-shaped fakes
of ``tensorrt_llm`` (``tests/fakes/trtllm_main``, and ``trtllm_v12`` for the rows marked 1.2), built
through upstream's ``GenerationExecutor.create(FakeEngine(...), model_world_size=N)`` of the fake
with ``liveness_executor_class``; ``--executor reference``: the package's reference executor
(``trtllm_liveness.demo``). It reports per fault: runs, detected,
missed, false alarms, detection p50/p99 ms (from the fault to the package's first report),
shutdown bounded, leftover processes and the cause the package reported. Each fault runs in one
scenario child (one Python and MPI start, one fresh executor per run) in its own session with an
outer timeout; every process of that session is checked by pid afterwards and killed if left
(counted as leftover). Cgroups get a prefix unique to this run and are thawed and removed at the
end, also on Ctrl-C; the two busy-loop processes of the CPU-pressure control are ended by pid.

Two rows check how the process ends rather than how a rank's death is seen, one scenario child
per run, on the upstream-shaped ``main`` fake of ``tensorrt_llm`` (under ``tests/fakes/``; the
exit-on-fatal row also on the reference executor):
a leader death with requests pending under ``exit_on_fatal`` (a server: the process must exit
non-zero, with the guard's status, within the guard's bound) and an interpreter exit without
``shutdown()`` (a script: no fatal error, exit status 0).

Baseline, side by side: SIGSTOP, which must NOT be reported dead (surfaced as a stall), and two
no-fault controls under request load with wedge detection on (``d_state_timeout_s=1``), one with
both cores busy, which must raise zero alarms.

``--soak MINUTES`` instead draws rows at random, one run each, back to back, until MINUTES have
passed (bounded: the last draw ends within its own timeout after that; no draw starts later), and
reports missed detections, false alarms and leaks after every draw: processes (the draw's session,
and children of this process), pidfds in the scenario process, fds of this process (growth over the
soak), cgroups of this run's prefix under every ``/sys/fs/cgroup/*/``, FUSE mounts and temp dirs
(the children get a private ``TMPDIR``, so whatever they leave there is theirs). Leaks are removed
after being counted, so one does not hide the next. Open MPI's own per-user session dir
(``ompi.<host>.<uid>``, which a plain ``mpi4py`` start and clean exit also leave in TMPDIR) is
listed apart and not counted.

Usage: ``scripts/fault_matrix.py [--json] [--runs N] [--control-s S] [--quick] [--soak MINUTES]
[--executor fake|reference] [--no-hosts]``
(``--quick``: 2 runs, 10 s controls). Needs the mpi extra; the OOM and wedge rows need root and
cgroup v1 (memory, freezer), the FUSE row root and /dev/fuse; they are reported as skipped otherwise.
The multi-host rows (scripts/_matrix_hosts.py: a remote kill, a host crash, a partition, a remote
wedge, on namespace test hosts) need root, ``ip`` and ``nsenter``; ``--no-hosts`` leaves them out.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import _bench

from tests.support.cgroups import memory_cgroup_available, remove_leftover_groups
from tests.support.leftovers import remove_orphaned_prte_tmpdirs
from tests.support.upstream_fakes import FAKE_ENGINE, tree
from tests.support.victims import names_a_victim
from trtllm_liveness.demo._cgroup_faults import freezer_available
from trtllm_liveness.demo._fuse_stall import fuse_available, fuse_mounts, remove_leftover_mounts
from trtllm_liveness.demo._scenario_launcher import run_scenario
from trtllm_liveness.demo._scenario_records import ScenarioOptions, ScenarioResult, ScenarioRun

REPO = Path(__file__).resolve().parents[1]
# The upstream-shaped fakes of tensorrt_llm main and 1.2 (tests/fakes/README.md).
FAKES = {"main": tree("main"), "1.2": tree("v12")}
EXECUTORS = ("fake", "reference")
# Options of a scenario on upstream's API of the fake tensorrt_llm, given the fakes' engine.
ON_FAKE: dict[str, Any] = {"via": "executor_cls", "engine": FAKE_ENGINE}
FAKE_ENDINGS = Path(__file__).resolve().parent / "fake_endings.py"
FAKE_STALLS = Path(__file__).resolve().parent / "fake_stalls.py"
STALL_ENV = "TRTLLM_LIVENESS_STALL_SCENARIO"  # fake_stalls.SCENARIO_ENV
COMMON: dict[str, Any] = {"mode": "main", "workers": 2, "tokens": 300, "observe_s": 10.0,
                          "d_state_timeout_s": 1.0, "scan_interval_s": 0.1, "shutdown_grace_s": 2.0,
                          "shutdown_term_s": 0.5, "shutdown_kill_s": 1.0}
# shutdown() bound: grace + term + kill + 5 s (LivenessProxyMixin.shutdown's docstring).
SHUTDOWN_BOUND_MS = (2.0 + 0.5 + 1.0 + 5.0) * 1e3
# The exit-on-fatal row: the guard ends the process exit_timeout_s after the fatal event at the
# latest; detection and the interpreter's own exit get 2 s on top.
EXIT_TIMEOUT_S = 5.0
EXIT_CODE = 3
EXIT_BOUND_MS = (EXIT_TIMEOUT_S + 2.0) * 1e3
BUSY_LOOP = "while True:\n    pass"
OMPI_USER_DIR = re.compile(r"ompi\.[^/]+\.\d+$")


def percentile(values: list[float], q: float) -> float | None:
    value = _bench.percentile(values, q)
    return None if value is None else round(value, 3)


class Verdict(NamedTuple):
    """One run's judgement: was the fault detected (or the ending right), was anything a false
    alarm, how long did detection take, and what the package reported."""

    detected: bool
    false_alarm: bool
    ms: float | None
    cause: str


# A judge sees one run's record (None when the child reported none) and the child as a whole.
Judge = Callable[[ScenarioResult | None, ScenarioRun], Verdict]


def _cause(r: ScenarioResult) -> str:
    return r.events[0].cause if r.events else str(r.fatal_error)


def judge_death(r: ScenarioResult | None, run: ScenarioRun) -> Verdict:
    if r is None or r.detection is None:
        return Verdict(False, False, None, "no record")
    d = r.detection
    ok = d.health_false_ms is not None and names_a_victim(r, r.fatal_error)
    return Verdict(ok, False, d.detected_ms if d.detected_ms is not None else d.health_false_ms, _cause(r))


def _init_cause(r: ScenarioResult) -> str:
    return "no init record" if r.init is None else f"{r.init.error_type}: {r.init.error}"


def judge_init(r: ScenarioResult | None, run: ScenarioRun) -> Verdict:
    if r is None or r.init is None:
        return Verdict(False, False, None, "no record")
    ok = r.init.hung is False and names_a_victim(r, r.init.error)
    return Verdict(ok, False, r.init.error_ms, _init_cause(r))


def judge_spawn(r: ScenarioResult | None, run: ScenarioRun) -> Verdict:
    if r is None or r.init is None:
        return Verdict(False, False, None, "no record")
    ok = r.init.spawn_failed is True and r.init.hung is False and r.init.error_type == "PoolManagerDiedError"
    return Verdict(ok, False, r.init.error_ms, _init_cause(r))


def judge_shutdown(r: ScenarioResult | None, run: ScenarioRun) -> Verdict:
    if r is None or r.shutdown is None or r.victim is None:
        return Verdict(False, False, None, "no record")
    outcome = None if r.shutdown.report is None else r.shutdown.report.outcome_of(r.victim.pid)
    ok = not r.shutdown.hung and outcome is not None and not r.shutdown.unkillable
    said = None if outcome is None else outcome.value
    return Verdict(ok, False, None, f"shutdown report: rank {r.victim.rank} {said}; no fatal error (expected exit)")


def judge_stop(r: ScenarioResult | None, run: ScenarioRun) -> Verdict:
    if r is None or r.detection is None:
        return Verdict(False, False, None, "no record")
    reported_dead = r.fatal_error is not None or bool(r.events)
    stall = r.detection.stall_detected_ms
    return Verdict(stall is not None, reported_dead, stall, "not dead: surfaced as a stall (no tokens for 1 s)")


def judge_wedge(r: ScenarioResult | None, run: ScenarioRun) -> Verdict:
    if r is None or r.detection is None:
        return Verdict(False, False, None, "no record")
    ok = bool(r.events) and r.events[0].kind == "wedged" and names_a_victim(r, r.fatal_error)
    unkillable = [] if r.shutdown is None else list(r.shutdown.unkillable)
    return Verdict(ok, False, r.detection.detected_ms, _cause(r) + f"; shutdown: unkillable {unkillable}")


def judge_stall(r: ScenarioResult | None, run: ScenarioRun) -> Verdict:
    """stall_action=fatal: one ``stalled`` event, health False, every pending request failed."""
    if r is None or r.detection is None:
        return Verdict(False, False, None, "no record")
    d = r.detection
    ok = (len(r.events) == 1 and r.events[0].kind == "stalled" and d.health_false_ms is not None
          and d.requests_failed_ms is not None)
    dead = any(event.kind == "died" for event in r.events)  # a stalled rank is alive: never "dead"
    return Verdict(ok and not dead, dead, d.detected_ms, _cause(r) if r.events else "no stall reported")


def judge_near_miss(r: ScenarioResult | None, run: ScenarioRun) -> Verdict:
    """First steps at 80% of stall_timeout_s, then streaming: any stall (or fatal error) is false."""
    if r is None:
        return Verdict(False, False, None, "no record")
    alarm = bool(r.events) or r.fatal_error is not None
    return Verdict(not alarm, alarm, None, f"{r.in_flight} batches with a first step at 80% of the timeout; "
                                           f"{len(r.events)} events")


def judge_control(r: ScenarioResult | None, run: ScenarioRun) -> Verdict:
    if r is None or r.control is None:
        return Verdict(False, False, None, "no record")
    c = r.control
    alarms = c.alarms + (r.pending_not_done or 0)
    return Verdict(True, alarms > 0, None,
                   f"{c.requests_completed} requests, {c.health_checks} health checks, {c.alarms} alarms")


def _exit_status(run: ScenarioRun) -> str:
    if run.timed_out:
        return "killed by the outer timeout (the process did not exit)"
    return f"exit status {run.returncode}"


def judge_exit_on_fatal(r: ScenarioResult | None, run: ScenarioRun) -> Verdict:
    """A server after a leader death with requests pending: exits with the guard's status in time."""
    ms = run.exit_ms
    ok = not run.timed_out and run.returncode == EXIT_CODE and ms is not None and ms <= EXIT_BOUND_MS
    sigint = None if r is None or r.ending is None else r.ending.sigint_ms
    fatal = "no record" if r is None else ("no fatal error" if r.fatal_error is None else "fatal error named")
    # "done" is printed after the graceful shutdown; without it the guard's watchdog ended the process.
    how = "graceful exit" if run.done else "ended by the guard's watchdog"
    return Verdict(ok, False, ms, f"{_exit_status(run)} (want {EXIT_CODE}) {ms} ms after the kill (bound "
                                  f"{EXIT_BOUND_MS:.0f}, {how}); guard SIGINT at {sigint} ms; {fatal}")


def judge_interpreter_exit(r: ScenarioResult | None, run: ScenarioRun) -> Verdict:
    """A script that ends without shutdown(): no fatal error, exit status 0. A fatal error or a
    non-zero status is a false alarm (the ranks' exits were expected)."""
    fatal = None if r is None else r.fatal_error
    events = () if r is None else r.events
    clean = not run.timed_out and run.returncode == 0
    ok = clean and r is not None and fatal is None and not events
    alarm = fatal is not None or bool(events) or (run.returncode not in (0, None) and not run.timed_out)
    seen = "no record (ended before the atexit report)" if r is None else (
        f"fatal error: {fatal}" if fatal else f"no fatal error, {len(events)} events")
    return Verdict(ok, alarm, None, f"{_exit_status(run)} (want 0); {seen}")


def shutdown_bounded(r: ScenarioResult | None, run: ScenarioRun, ending_row: bool) -> bool:
    if ending_row:  # the bound of these rows is the process's exit, judged by their judge
        return not run.timed_out
    if r is None:
        return False
    if r.phase == "init":
        return r.init is not None and r.init.hung is False
    ms = None if r.shutdown is None else r.shutdown.shutdown_ms
    return ms is not None and ms <= SHUTDOWN_BOUND_MS


class Row(NamedTuple):
    name: str
    options: dict[str, Any]
    judge: Judge
    per_run_s: float
    env: dict[str, str] | None = None
    busy: int = 0  # busy-loop processes beside it (CPU pressure)
    program: tuple[str, ...] | None = None  # another scenario program (default: the reference's)

    @property
    def ends_process(self) -> bool:
        """The run's outcome is how its scenario process ended."""
        return bool(self.options.get("ending", "shutdown") != "shutdown")

    @property
    def child_per_run(self) -> bool:
        """One scenario child per run: the rows that end the process, and every row on upstream's
        API (the fakes), which takes one iteration per process (``ScenarioOptions``)."""
        return self.ends_process or self.options.get("via", "class") != "class"

    @property
    def fault(self) -> str:
        return str(self.options.get("fault", "kill"))


def fake_env(mode: str) -> dict[str, str]:
    """The environment that puts the fake ``tensorrt_llm`` of ``mode`` first on the child's path."""
    return {"PYTHONPATH": os.pathsep.join([str(FAKES[mode]), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}


def on_executor(row: Row, executor: str) -> Row:
    """``row`` on the fake ``tensorrt_llm`` of its mode (``executor="fake"``) or the reference."""
    if executor == "reference":
        return row
    mode = str(row.options.get("mode", COMMON["mode"]))
    return row._replace(options={**row.options, **ON_FAKE}, env={**fake_env(mode), **(row.env or {})})


def plan(runs: int, control_s: float, quick: bool, prefix: str, executor: str = "fake") -> list[Row]:
    if executor not in EXECUTORS:
        raise ValueError(f"executor {executor!r}: expected one of {', '.join(EXECUTORS)}")
    init_delay = 1.0 if quick else 2.0
    main_env = fake_env("main")
    exit_opts = {"exit_on_fatal": True, "exit_code": EXIT_CODE, "exit_timeout_s": EXIT_TIMEOUT_S}
    faults = [
        Row("SIGKILL subordinate (main)", {"fault": "kill", "fault_rank": 1}, judge_death, 15),
        Row("SIGKILL leader (1.2)", {"mode": "1.2", "fault": "kill", "fault_rank": 0}, judge_death, 15),
        Row("SIGSEGV", {"fault": "segv", "fault_rank": 1}, judge_death, 15),
        Row("os._exit(0) mid-request", {"fault": "exit0", "fault_rank": 1}, judge_death, 15),
        Row("kernel OOM killer (64 MiB cgroup)", {"fault": "oom", "fault_rank": 1, "oom_limit_mb": 64},
            judge_death, 20),
        Row("two ranks at once (of 3)", {"fault": "kill", "workers": 3, "fault_ranks": [1, 2]}, judge_death, 15),
        Row("death during init", {"fault": "kill", "fault_phase": "init", "fault_rank": 1,
                                  "init_delay_s": init_delay}, judge_init, 20),
        Row("MPI_Comm_spawn fails at start-up", {"fault": "spawn"}, judge_spawn, 15),
        Row("death during shutdown", {"fault": "kill", "fault_phase": "shutdown", "fault_rank": 1}, judge_shutdown, 20),
        Row("SIGSTOP (must not be dead)", {"mode": "1.2", "fault": "stop", "fault_rank": 1,
                                           "shutdown_grace_s": 0.5}, judge_stop, 20),
        Row("D-state wedge (freezer)", {"fault": "wedge", "fault_rank": 1, "d_state_timeout_s": 0.5,
                                        "scan_interval_s": 0.05}, judge_wedge, 20),
        Row("D-state wedge (FUSE, one thread)", {"fault": "fuse", "fault_rank": 1, "d_state_timeout_s": 0.5,
                                                 "scan_interval_s": 0.05}, judge_wedge, 20),
    ]
    rows = [on_executor(row, executor) for row in faults]
    # The two ending rows, whatever --executor says: on the reference executor and on the
    # upstream-shaped main fake (driven through its own LLM API by scripts/fake_endings.py).
    server = {**exit_opts, "fault": "kill", "fault_rank": 0, "ending": "serve_until_sigint",
              "observe_s": EXIT_TIMEOUT_S + 5.0}
    script = {**exit_opts, "fault": "none", "tokens": 20, "ending": "interpreter_exit"}
    for where, options, env, program in (
            ("reference", {"via": "class"}, None, None),
            ("main fake", ON_FAKE, main_env, (sys.executable, str(FAKE_ENDINGS)))):
        rows.append(Row(f"leader death, pending, exit_on_fatal ({where})", {**server, **options},
                        judge_exit_on_fatal, EXIT_TIMEOUT_S + 25, env, program=program))
    # The script row on the fake only: the reference proxy registers no atexit shutdown() (upstream's
    # GenerationExecutor.__init__ does), so without shutdown() its MPI pool hangs the interpreter exit.
    rows.append(Row("interpreter exit, no shutdown() (main fake)", {**script, **ON_FAKE},
                    judge_interpreter_exit, 15, main_env, program=(sys.executable, str(FAKE_ENDINGS))))

    # Stalls (stall_action=fatal, stall_timeout_s=1) on the upstream-shaped fakes, through their LLM API
    # (scripts/fake_stalls.py). "stop" is only the scenario's label: each run is one child.
    stall_program = (sys.executable, str(FAKE_STALLS))
    for name, kind, mode in (("stall: rank blocks in user space (main)", "block", "main"),
                             ("stall: subordinate stops answering (1.2)", "silent", "1.2"),
                             ("stall: busy-spinning rank (main)", "spin", "main"),
                             ("stall: SIGSTOPped rank, stall_action=fatal (main)", "stop", "main")):
        rows.append(Row(name, {"mode": mode, "fault": "stop", "fault_rank": 1, **ON_FAKE}, judge_stall,
                        20, {**fake_env(mode), STALL_ENV: kind}, program=stall_program))
    rows.append(Row("near miss: first step at 80% of stall_timeout_s (main)",
                    {"fault": "stop", **ON_FAKE, "observe_s": 5.0 if quick else 10.0}, judge_near_miss,
                    25, {**main_env, STALL_ENV: "near-miss"}, program=stall_program))

    control = {"fault": "none", "control_s": control_s, "tokens": 50}
    for row in (Row(f"control {control_s:g}s, wedge detection on", control, judge_control, control_s + 20),
                Row(f"control {control_s:g}s, both cores busy", control, judge_control, control_s + 20, busy=2)):
        rows.append(on_executor(row, executor))
    return [row._replace(options={**COMMON, **row.options, "cgroup_prefix": prefix}) for row in rows]


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


class Tally:
    """Per-row counts over runs (the matrix's row, or the soak's draws of one row)."""

    def __init__(self, row: Row) -> None:
        self.row = row
        self.runs = self.completed = self.detected = self.missed = self.alarms = self.bounded = 0
        self.latencies: list[float] = []
        self.causes: list[str] = []
        self.leftovers: list[int] = []
        self.pidfds = 0
        self.errors: list[str] = []
        self.wall_s = 0.0
        self.last_run: ScenarioRun | None = None

    def add(self, run: ScenarioRun, runs: int) -> None:
        """Count one scenario child that was asked for ``runs`` runs."""
        self.runs += runs
        self.last_run = run
        self.leftovers += run.survivors
        if not (self.row.ends_process and run.results):  # an ending row with a record is judged on it
            self.errors += [p[-800:] for p in run.problems() if not p.startswith("processes left")]
        records: list[ScenarioResult | None] = list(run.results)
        if self.row.ends_process:
            records = records[:1] or [None]  # judged on the process, record or not
        for r in records:
            verdict = self.row.judge(r, run)
            self.completed += r is not None
            self.detected += verdict.detected
            self.missed += not verdict.detected
            self.alarms += verdict.false_alarm
            self.bounded += shutdown_bounded(r, run, self.row.ends_process)
            if r is not None:
                self.leftovers += r.survivors
                self.pidfds = max(self.pidfds, r.pidfds_open or 0)
            if verdict.ms is not None:
                self.latencies.append(verdict.ms)
            self.causes.append(verdict.cause)
        self.missed += max(0, runs - len(records))  # runs that never reported (the child failed): missed

    def to_dict(self) -> dict[str, Any]:
        return {
            "fault": self.row.name, "runs": self.runs, "completed": self.completed, "detected": self.detected,
            "missed": self.missed, "false_alarms": self.alarms, "p50_ms": percentile(self.latencies, 0.5),
            "p99_ms": percentile(self.latencies, 0.99), "shutdown_bounded": self.bounded == self.runs,
            "shutdown_bounded_runs": self.bounded, "leftover_processes": len(self.leftovers),
            "pidfds_left": self.pidfds, "cause": self.causes[0] if self.causes else None,
            "causes": sorted(set(self.causes))[:5], "errors": self.errors[:5], "wall_s": round(self.wall_s, 1),
        }


def run_row(row: Row, runs: int, env_extra: dict[str, str] | None = None) -> Tally:
    """All ``runs`` of a row: one child for all, or one per run (``Row.child_per_run``)."""
    tally = Tally(row)
    env = {**(row.env or {}), **(env_extra or {})} or None
    t = time.monotonic()
    busy = busy_loops(row.busy)
    try:
        if row.child_per_run:
            for _ in range(runs):
                tally.add(run_scenario({**row.options, "iterations": 1}, 30 + row.per_run_s, env, row.program), 1)
        else:
            opts = ScenarioOptions.from_dict({**row.options, "iterations": runs})
            tally.add(run_scenario(opts, 30 + row.per_run_s * runs, env, row.program), runs)
    finally:
        end_by_pid(busy)
    tally.wall_s = time.monotonic() - t
    return tally


def skip_reasons() -> dict[str, str | None]:
    return {"oom": memory_cgroup_available(), "wedge": freezer_available(), "fuse": fuse_available()}


def print_table(rows: list[dict[str, Any]]) -> None:
    header = (f"{'fault':48} {'runs':>4} {'det':>4} {'miss':>4} {'false':>5} {'p50 ms':>9} {'p99 ms':>9} "
              f"{'bounded':>7} {'left':>4}  cause reported")
    print(header)
    print("-" * len(header))
    for row in rows:
        if "skipped" in row:
            print(f"{row['fault']:48} skipped: {row['skipped']}")
            continue
        print(f"{row['fault']:48} {row['runs']:>4} {row['detected']:>4} {row['missed']:>4} {row['false_alarms']:>5} "
              f"{_fmt(row['p50_ms']):>9} {_fmt(row['p99_ms']):>9} {('yes' if row['shutdown_bounded'] else 'NO'):>7} "
              f"{row['leftover_processes']:>4}  {str(row['cause'])[:110]}")
        for error in row["errors"]:
            print(f"    error: {error.strip().splitlines()[-1] if error.strip() else error}")


def run_matrix(args: argparse.Namespace, prefix: str) -> int:
    runs = args.runs or (2 if args.quick else 5)
    control_s = args.control_s or (10.0 if args.quick else 60.0)
    skips = skip_reasons()
    t_start = time.monotonic()
    rows: list[dict[str, Any]] = []
    try:
        for row in plan(runs, control_s, args.quick, prefix, args.executor):
            if args.only and args.only not in row.name:
                continue
            reason = skips.get(row.fault)
            if reason is not None:
                rows.append({"fault": row.name, "skipped": reason})
                continue
            rows.append(run_row(row, 1 if row.fault == "none" and not row.ends_process else runs).to_dict())
        if args.hosts:
            from _matrix_hosts import run_host_rows

            rows += run_host_rows(runs, args.only, skips.get("wedge"))
    finally:  # also on Ctrl-C: run_scenario has killed its session; remove the cgroups and mounts
        left_groups = remove_leftover_groups(prefix)
        left_groups += remove_leftover_mounts()  # a FUSE stall of a scenario child that was killed
    measured = [row for row in rows if "skipped" not in row]
    faults = [row for row in measured
              if not row["fault"].startswith(("control", "SIGSTOP", "interpreter exit", "near miss"))]
    result = {
        "command": " ".join(["scripts/fault_matrix.py", *sys.argv[1:]]),
        "executor": args.executor, "runs_per_fault": runs, "control_s": control_s, "rows": rows,
        "targets": {
            "every_fault_detected_every_run": all(r["missed"] == 0 for r in faults),
            "every_run_started": all(r.get("failed_starts", 0) == 0 for r in measured),  # the host rows count them
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
    print_table(rows)
    print()
    for key, value in targets.items():
        print(f"{key:36} {value}")
    print(f"{'wall time':36} {result['wall_s']} s")
    if args.json:
        print(json.dumps(result))
    return 0 if met else 1


# --------------------------------------------------------------------------------------- soak


def _cgroups(prefix: str) -> list[str]:
    return sorted(glob.glob(f"/sys/fs/cgroup/*/{prefix}*"))


def _our_children() -> list[int]:
    """Live processes whose parent is this process (the busy loops are ended before this is read)."""
    me, found = os.getpid(), []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            data = Path(f"/proc/{name}/stat").read_bytes()
        except OSError:
            continue
        fields = data[data.rfind(b")") + 2:].split()
        if len(fields) > 1 and int(fields[1]) == me and fields[0] not in (b"Z", b"X"):
            found.append(int(name))
    return found


def _fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


class SoakLeaks:
    """Leaks seen after each draw, then removed (so one does not hide the next)."""

    def __init__(self, prefix: str, tmpdir: str) -> None:
        self.prefix, self.tmpdir = prefix, tmpdir
        self.processes: list[int] = []
        self.pidfds = 0
        self.cgroups: list[str] = []
        self.mounts: list[str] = []
        self.temp_dirs: list[str] = []
        self.ompi_user_dirs: list[str] = []
        self.fds_start = _fd_count()

    def check(self, run: ScenarioRun) -> dict[str, Any]:
        found: dict[str, Any] = {
            "processes": list(run.survivors) + [p for r in run.results for p in r.survivors] + _our_children(),
            "pidfds": max((r.pidfds_open or 0 for r in run.results), default=0),
            "cgroups": _cgroups(self.prefix),
            "mounts": [m for m in fuse_mounts() if m.startswith(self.tmpdir + os.sep)],
        }
        # The child's session has ended: whatever of its temp dirs is still there was left behind.
        # Open MPI's per-user session dir (ompi.<host>.<uid>) is made and kept in TMPDIR by Open MPI
        # itself for every job of the user, also after a clean exit: listed apart, not our leak.
        names = sorted(os.listdir(self.tmpdir))
        found["temp_dirs"] = [n for n in names if not OMPI_USER_DIR.match(n)]
        self.ompi_user_dirs += [n for n in names if OMPI_USER_DIR.match(n)]
        self.processes += found["processes"]
        self.pidfds = max(self.pidfds, found["pidfds"])
        self.cgroups += found["cgroups"]
        self.mounts += found["mounts"]
        self.temp_dirs += found["temp_dirs"]
        self._clean()
        return found

    def _clean(self) -> None:
        remove_leftover_groups(self.prefix)
        remove_leftover_mounts()  # tempfile.tempdir is the private dir during the soak
        remove_orphaned_prte_tmpdirs()
        for name in os.listdir(self.tmpdir):
            path = os.path.join(self.tmpdir, name)
            if path in fuse_mounts():
                continue  # never stat or remove a live mount (a dead owner's is unmounted above)
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.unlink(path)

    def to_dict(self) -> dict[str, Any]:
        return {"processes": len(self.processes), "process_pids": self.processes[:20], "pidfds": self.pidfds,
                "fds_growth": _fd_count() - self.fds_start, "cgroups": self.cgroups[:20],
                "mounts": self.mounts[:20], "temp_dirs": self.temp_dirs[:20], "temp_dirs_count": len(self.temp_dirs),
                "ompi_user_session_dirs": len(self.ompi_user_dirs)}


def run_soak(args: argparse.Namespace, prefix: str) -> int:
    minutes = float(args.soak)
    if not 0 < minutes <= 24 * 60:
        sys.stderr.write("fault_matrix: --soak takes minutes in (0, 1440]\n")
        return 2
    seed = args.seed if args.seed is not None else random.randrange(2**32)
    rng = random.Random(seed)
    skips = skip_reasons()
    # Controls shortened so the soak mixes many draws; every row has its own per-run timeout.
    rows = [row for row in plan(1, 5.0, True, prefix, args.executor) if skips.get(row.fault) is None]
    tmpdir = tempfile.mkdtemp(prefix="trtllm-liveness-soak-")
    previous_tempdir = tempfile.tempdir
    tempfile.tempdir = tmpdir  # the leftover sweeps (mounts, PRRTE bases) look here
    leaks = SoakLeaks(prefix, tmpdir)
    tallies: dict[str, Tally] = {}
    draws: list[dict[str, Any]] = []
    t_start = time.monotonic()
    deadline = t_start + minutes * 60
    longest = max(30 + row.per_run_s for row in rows)
    try:
        while time.monotonic() < deadline:
            row = rng.choice(rows)
            t = time.monotonic()
            tally = run_row(row, 1, {"TMPDIR": tmpdir})
            assert tally.last_run is not None
            found = leaks.check(tally.last_run)
            previous = tallies.get(row.name)
            tallies[row.name] = tally if previous is None else _merge(previous, tally)
            draws.append({"fault": row.name, "detected": tally.detected == 1, "false_alarm": tally.alarms > 0,
                          "ms": tally.latencies[0] if tally.latencies else None,
                          "leaks": {k: v for k, v in found.items() if v}, "wall_s": round(time.monotonic() - t, 1)})
            if not args.json:
                mark = "ok" if tally.detected == 1 and not tally.alarms else "MISS" if not tally.detected else "ALARM"
                leaked = {k: v for k, v in found.items() if v}
                print(f"[{time.monotonic() - t_start:7.1f} s] {row.name:48} {mark:5} {leaked or ''}", flush=True)
    finally:
        tempfile.tempdir = previous_tempdir
        left_groups = remove_leftover_groups(prefix)
        shutil.rmtree(tmpdir, ignore_errors=True)
    rows_out = [tallies[name].to_dict() for name in sorted(tallies)]
    faults = [r for r in rows_out if not r["fault"].startswith(("control", "SIGSTOP", "interpreter exit"))]
    leak_summary = leaks.to_dict()
    result = {
        "command": " ".join(["scripts/fault_matrix.py", *sys.argv[1:]]),
        "soak_minutes": minutes, "seed": seed, "draws": len(draws),
        "bound_s": round(minutes * 60 + longest + 15, 1),
        "missed_detections": sum(r["missed"] for r in faults),
        "false_alarms": sum(r["false_alarms"] for r in rows_out),
        "leaks": leak_summary, "rows": rows_out, "draw_log": draws,
        "cgroups_left_at_end": left_groups,
        "machine": {"cpus": os.cpu_count(), "kernel": os.uname().release},
        "wall_s": round(time.monotonic() - t_start, 1),
    }
    clean_leaks = (leak_summary["processes"] == 0 and leak_summary["pidfds"] == 0 and not leak_summary["cgroups"]
                   and not leak_summary["mounts"] and leak_summary["temp_dirs_count"] == 0
                   and leak_summary["fds_growth"] <= 0)
    targets = {"zero_missed_detections": result["missed_detections"] == 0,
               "zero_false_alarms": result["false_alarms"] == 0, "zero_leaks": clean_leaks}
    result["targets"] = targets
    result["targets_met"] = all(targets.values())
    print()
    print(f"soak: {len(draws)} draws in {result['wall_s']} s (seed {seed}; bound {result['bound_s']} s)")
    print_table(rows_out)
    print()
    print(f"{'missed detections':36} {result['missed_detections']}")
    print(f"{'false alarms':36} {result['false_alarms']}")
    for key in ("processes", "pidfds", "fds_growth", "cgroups", "mounts", "temp_dirs"):
        print(f"{'leaked ' + key:36} {leak_summary[key]}")
    ompi_dirs = leak_summary["ompi_user_session_dirs"]
    print(f"{'(Open MPI per-user session dirs)':36} {ompi_dirs} draws left one (Open MPI's, not counted)")
    for key, ok in targets.items():
        print(f"{'PASS' if ok else 'FAIL'}  {key}")
    if args.json:
        print(json.dumps(result))
    return 0 if result["targets_met"] else 1


def _merge(into: Tally, other: Tally) -> Tally:
    for name in ("runs", "completed", "detected", "missed", "alarms", "bounded"):
        setattr(into, name, getattr(into, name) + getattr(other, name))
    into.latencies += other.latencies
    into.causes += other.causes
    into.leftovers += other.leftovers
    into.pidfds = max(into.pidfds, other.pidfds)
    into.errors += other.errors
    into.wall_s += other.wall_s
    return into


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object after the table")
    parser.add_argument("--only", default="", metavar="TEXT", help="only the rows whose name contains TEXT")
    parser.add_argument("--runs", type=int, default=None, help="runs per fault (default 5, --quick 2)")
    parser.add_argument("--control-s", type=float, default=None, help="length of each control (default 60, --quick 10)")
    parser.add_argument("--quick", action="store_true", help="fewer runs and 10 s controls (about 90 s)")
    parser.add_argument("--soak", type=float, default=None, metavar="MINUTES",
                        help="draw faults at random, back to back, for MINUTES; report misses, false alarms, leaks")
    parser.add_argument("--executor", choices=EXECUTORS, default="fake",
                        help="what the fault rows run on: the upstream-shaped fakes of tensorrt_llm (default) or "
                             "the reference executor (the ending rows run on both either way)")
    parser.add_argument("--seed", type=int, default=None, help="the soak's random seed (default: drawn, printed)")
    parser.add_argument("--hosts", action=argparse.BooleanOptionalAction, default=True,
                        help="also the multi-host rows: mpirun across namespace test hosts (default on; root)")
    args = parser.parse_args()
    prefix = f"trtllm-liveness-matrix-{uuid.uuid4().hex[:8]}"
    return run_soak(args, prefix) if args.soak is not None else run_matrix(args, prefix)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


if __name__ == "__main__":
    try:
        sys.exit(main())
    finally:
        remove_orphaned_prte_tmpdirs()  # PRRTE bases of MPI launchers this run killed
