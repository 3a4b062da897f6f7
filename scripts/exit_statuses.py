#!/usr/bin/env python3
"""Exit statuses, measured: what a supervisor sees after each fatal verdict, for each way the
docs recommend starting the engine, under Open MPI's default error handling and under ULFM.

Usage: scripts/exit_statuses.py [--json] [--runs N] [--only TEXT] [--no-hosts]

Every run is a server that ends as ``trtllm-serve`` does (``ending="serve_until_sigint"``: after
the fault it waits for the exit guard's SIGINT, prints its record, shuts down and leaves through a
normal interpreter exit), configured ``exit_on_fatal=1,exit_code=3,exit_timeout_s=5`` (the
non-restartable status is the default, 69), its quarantine marker directory
(``TRTLLM_LIVENESS_QUARANTINE_DIR``) a private temporary one. Two ways of starting it:

  launch     the recommended one: ``trtllm-liveness launch --`` around the server (one host) or
             around ``mpirun`` (across hosts); the status is the wrapper's, what a Kubernetes
             container, a Slurm step or a supervisor of it sees. The contract: the documented
             status in every run, the marker where due (after a wedge, and only then), the job
             ended within the documented bound (README, "Exit statuses").
  process    for comparison: the server's process alone (rank 0 under ``mpirun`` across hosts,
             its status written by a shell in front of it): what Open MPI's abort does to it.

Recorded per run: the status, whether the quarantine marker was written, whether the server's
record line (naming the fatal error) came out, whether Open MPI's abort message is on its stderr,
and the time from the fault to the supervised process's exit (an upper bound of verdict -> exit).

Rows (``--runs`` each, default 3), each with ``OMPI_MCA_mpi_ft_enable=0`` (Open MPI's default,
the value ``ompi_info`` shows when it is unset) and ``=1`` (ULFM):

  death      SIGKILL of rank 1, requests streaming: the reference executor, and the upstream-shaped
             main fake through its own LLM API (scripts/fake_endings.py)
  wedge      rank 1 frozen in D (cgroup v1 freezer; d_state_timeout_s 0.5): the reference executor
  stall      rank 1 blocks in its step loop (stall_action=fatal, stall_timeout_s 1): the main
             fake through its own LLM API (scripts/fake_stalls.py)
  lost host  hostB's links down, requests in flight (namespace test hosts,
             tests/support/multihost_engine.py: the proxy, rank 0, on hostA)
  host crash hostB's processes all killed (its PID 1), the same engine

Prints the table and, with ``--json``, one JSON object last, with ``contract_held`` (launch runs
with the documented status and the marker where due, over launch runs) and ``job_end_p99_s``. The
table goes in docs/reliability.md.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import _bench

from tests.support.cgroups import remove_leftover_groups
from tests.support.upstream_fakes import FAKE_ENGINE, tree
from trtllm_liveness._config import parse_value
from trtllm_liveness.cli._launched_job import job_end_bound_s
from trtllm_liveness.demo._cgroup_faults import freezer_available
from trtllm_liveness.demo._scenario_launcher import run_scenario
from trtllm_liveness.demo._scenario_records import ScenarioRun
from trtllm_liveness.quarantine._marker import MARKER_NAME, QUARANTINE_DIR_VAR

SCRIPTS = Path(__file__).resolve().parent
FAKE_MAIN = tree("main")
FAKE_ENDINGS = SCRIPTS / "fake_endings.py"
FAKE_STALLS = SCRIPTS / "fake_stalls.py"
ON_FAKE: dict[str, Any] = {"via": "executor_cls", "engine": FAKE_ENGINE}  # upstream's API on the fake
MPI_MODES = {"default": "0", "ulfm": "1"}  # OMPI_MCA_mpi_ft_enable
EXIT_CODE = 3
EXIT_CODE_UNRESTARTABLE = 69  # the config's default
EXIT_TIMEOUT_S = 5.0
SERVER = {"exit_on_fatal": True, "exit_code": EXIT_CODE, "exit_timeout_s": EXIT_TIMEOUT_S,
          "ending": "serve_until_sigint", "observe_s": 10.0, "fault_rank": 1, "workers": 2, "tokens": 400,
          "shutdown_grace_s": 2.0, "shutdown_term_s": 0.5, "shutdown_kill_s": 1.0}
RUN_TIMEOUT_S = 45.0
JOB_END_BOUND_S = job_end_bound_s(parse_value(f"exit_on_fatal=1,exit_timeout_s={EXIT_TIMEOUT_S:g}"))
"""The documented bound on verdict -> the job gone, for these settings (exit_delay_s + exit_timeout_s + the
wrapper's graces)."""
HOST_WAIT_S = 40.0  # how long a host trial waits for the supervised process's end (then: "none")
LAUNCH = (sys.executable, "-m", "trtllm_liveness.cli", "launch", "--")
SCENARIO = (sys.executable, "-m", "trtllm_liveness.demo._scenario_child")
_ABORT = re.compile(r"MPI_ABORT|MPI_ERRORS_ARE_FATAL|An error occurred in")


@dataclass(frozen=True)
class Ending:
    """One run: how the server's process ended."""

    fault: str
    mpi: str  # "default" or "ulfm"
    executor: str
    launch: bool  # run under trtllm-liveness launch: ``status`` is the wrapper's
    status: int | None  # its exit status; None: it did not exit within the bound (killed after)
    marker: bool  # the quarantine marker was written
    record: bool  # its record line naming the fatal error came out (printed after the guard's SIGINT)
    fatal_kind: str  # the first event's kind ("" if none was recorded)
    mpi_abort: bool  # Open MPI's abort message is on its stderr
    exit_ms: float | None  # fault -> exit
    detail: str = ""


def fake_env() -> dict[str, str]:
    return {"PYTHONPATH": os.pathsep.join([str(FAKE_MAIN), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}


def scenario_run(fault: str, mpi: str, executor: str, launch: bool, options: dict[str, Any], env: dict[str, str],
                 program: tuple[str, ...] = SCENARIO) -> Ending:
    """One scenario child as a server (under the wrapper with ``launch``); its quarantine directory
    private to it."""
    quarantine = tempfile.mkdtemp(prefix="trtllm-exit-statuses-")
    try:
        run = run_scenario({**SERVER, **options}, RUN_TIMEOUT_S,
                           env={**env, "OMPI_MCA_mpi_ft_enable": MPI_MODES[mpi], QUARANTINE_DIR_VAR: quarantine},
                           program=(*LAUNCH, *program) if launch else program)
        marker = os.path.exists(os.path.join(quarantine, MARKER_NAME))
    finally:
        shutil.rmtree(quarantine, ignore_errors=True)
    return ending_of(fault, mpi, executor, launch, run, marker)


def ending_of(fault: str, mpi: str, executor: str, launch: bool, run: ScenarioRun, marker: bool) -> Ending:
    result = run.results[0] if run.results else None
    kind = result.events[0].kind if result is not None and result.events else ""
    named = result is not None and result.fatal_error is not None
    detail = run.error.strip().splitlines()[-1] if run.error else ""
    return Ending(fault, mpi, executor, launch, None if run.timed_out else run.returncode, marker, named, str(kind),
                  bool(_ABORT.search(run.stderr)), None if run.exit_ms is None else round(run.exit_ms, 1),
                  detail[:300])


def death(mpi: str, executor: str, launch: bool) -> Ending:
    if executor == "reference":
        return scenario_run("death", mpi, executor, launch, {"fault": "kill", "via": "class"}, {})
    return scenario_run("death", mpi, executor, launch, {"fault": "kill", **ON_FAKE}, fake_env(),
                        (sys.executable, str(FAKE_ENDINGS)))


def wedge(mpi: str, executor: str, launch: bool) -> Ending:
    prefix = f"trtllm-liveness-exit-statuses-{uuid.uuid4().hex[:8]}"
    try:
        return scenario_run("wedge", mpi, executor, launch, {"fault": "wedge", "via": "class", "d_state_timeout_s": 0.5,
                                                             "scan_interval_s": 0.05, "cgroup_prefix": prefix}, {})
    finally:
        remove_leftover_groups(prefix)


def stall(mpi: str, executor: str, launch: bool) -> Ending:
    return scenario_run("stall", mpi, executor, launch, {"fault": "stop", **ON_FAKE},
                        {**fake_env(), "TRTLLM_LIVENESS_STALL_SCENARIO": "block",
                         "TRTLLM_LIVENESS_STALL_TIMEOUT_S": "1"}, (sys.executable, str(FAKE_STALLS)))


def host_fault(fault: str, mpi: str, executor: str, launch: bool) -> Ending:
    """hostB lost (``lost host``: its links down) or crashed under a server whose proxy (rank 0)
    runs on hostA: rank 0's exit status, or with ``launch`` the wrapper's around mpirun (its outcome
    files in the hosts' shared directory)."""
    from tests.support.multihost_engine import DEFAULTS, Engine, StartFailed, start_hosts
    from tests.support.testhosts import TestHosts

    hosts = TestHosts()
    try:
        start_hosts(hosts)
        quarantine = os.path.join(hosts.shared, "quarantine")
        liveness = f"{DEFAULTS},exit_on_fatal=1,exit_code={EXIT_CODE},exit_timeout_s={EXIT_TIMEOUT_S:g}"
        wrapper = [*LAUNCH[:-1], "--outcome-dir", hosts.shared, "--"] if launch else []
        engine = Engine(hosts, liveness=liveness, fault_tolerant=mpi == "ulfm", env={QUARANTINE_DIR_VAR: quarantine},
                        exit_statuses=True, wrapper=wrapper)
        t0 = time.monotonic()
        if fault == "lost host":
            hosts.partition("hostB")
        else:
            hosts.crash("hostB")
        if launch:
            status = engine.job.wait_exit(HOST_WAIT_S)
        else:
            deadline = time.monotonic() + HOST_WAIT_S
            while engine.exit_status(0) is None and time.monotonic() < deadline and engine.job.popen.poll() is None:
                time.sleep(0.05)
            status = engine.exit_status(0)
        exited = time.monotonic()
        fatal = engine.record("fatal")
        named = fatal is not None and fatal.get("fatal") is not None
        detail = "" if status is not None else \
            (f"mpirun still runs {HOST_WAIT_S:.0f} s after (rank 0 exited {engine.exit_status(0)})" if launch
             else "rank 0's status never written (killed with its job)")
        return Ending(fault, mpi, executor, launch, status, os.path.exists(os.path.join(quarantine, MARKER_NAME)),
                      named, str(fatal.get("kind", "")) if named and fatal else "",
                      bool(_ABORT.search(engine.stderr() + engine.job.output())),
                      None if status is None else round((exited - t0) * 1000, 1), detail)
    except StartFailed as exc:
        return Ending(fault, mpi, executor, launch, None, False, False, "", False, None,
                      f"failed start: {str(exc)[-300:]}")
    finally:
        hosts.close()


def lost_host(mpi: str, executor: str, launch: bool) -> Ending:
    return host_fault("lost host", mpi, executor, launch)


def host_crash(mpi: str, executor: str, launch: bool) -> Ending:
    return host_fault("host crash", mpi, executor, launch)


Trial = Callable[[str, str, bool], Ending]
ROWS: tuple[tuple[str, str, Trial], ...] = (
    ("death", "reference", death),
    ("death", "main fake", death),
    ("wedge", "reference", wedge),
    ("stall", "main fake", stall),
    ("lost host", "main fake, 3 test hosts", lost_host),
    ("host crash", "main fake, 3 test hosts", host_crash),
)


def expected(fault: str) -> int:
    return EXIT_CODE_UNRESTARTABLE if fault == "wedge" else EXIT_CODE


def held_contract(cell: dict[str, Any], run: dict[str, Any]) -> bool:
    """The documented status, and the quarantine marker exactly where the fault calls for it."""
    return bool(run["status"] == cell["want_status"] and run["marker"] == (cell["fault"] == "wedge"))


def summary(endings: list[Ending]) -> str:
    def joined(values: list[str]) -> str:
        return "/".join(values)

    plain = [e for e in endings if not e.launch]
    wrapped = [e for e in endings if e.launch]
    return (f"status {joined(['none' if e.status is None else str(e.status) for e in plain])}"
            f"{' (MPI abort)' if any(e.mpi_abort and e.status == 14 for e in plain) else ''}; "
            f"under launch {joined(['none' if e.status is None else str(e.status) for e in wrapped])}; "
            f"marker {joined(['yes' if e.marker else 'no' for e in endings])}; "
            f"record {joined(['yes' if e.record else 'no' for e in endings])}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object after the table")
    parser.add_argument("--runs", type=int, default=3, help="runs per cell")
    parser.add_argument("--only", default="", help="only the rows whose fault or executor contains this")
    parser.add_argument("--hosts", action=argparse.BooleanOptionalAction, default=True,
                        help="the lost-host row on namespace test hosts (root; default on)")
    args = parser.parse_args()
    began = time.monotonic()
    skips: dict[str, str | None] = {"wedge": freezer_available()}
    if args.hosts:
        from tests.support.testhosts import unavailable

        skips["lost host"] = skips["host crash"] = unavailable()
    else:
        skips["lost host"] = skips["host crash"] = "--no-hosts"
    cells: list[dict[str, Any]] = []
    print(f"{'fault':10} {'executor':24} {'MPI':8} {'want':>4}  outcome (per run)")
    for fault, executor, trial in ROWS:
        if args.only and args.only not in fault and args.only not in executor:
            continue
        for mpi in MPI_MODES:
            reason = skips.get(fault)
            if reason is not None:
                cells.append({"fault": fault, "executor": executor, "mpi": mpi, "skipped": reason})
                print(f"{fault:10} {executor:24} {mpi:8} {expected(fault):>4}  skipped: {reason}")
                continue
            endings = [trial(mpi, executor, launch) for launch in (False, True) for _ in range(args.runs)]
            cells.append({"fault": fault, "executor": executor, "mpi": mpi, "want_status": expected(fault),
                          "runs": [asdict(e) for e in endings]})
            print(f"{fault:10} {executor:24} {mpi:8} {expected(fault):>4}  {summary(endings)}", flush=True)
    measured = [cell for cell in cells if "runs" in cell]
    launched = [(cell, run) for cell in measured for run in cell["runs"] if run["launch"]]
    held = [held_contract(cell, run) for cell, run in launched]
    ends = [run["exit_ms"] / 1000 if run["exit_ms"] is not None else float("inf") for _, run in launched]
    job_end_p99 = _bench.percentile(ends, 0.99) if ends else None
    result: dict[str, Any] = {"command": " ".join(["scripts/exit_statuses.py", *sys.argv[1:]]), "cells": cells,
              "exit_code": EXIT_CODE, "exit_code_unrestartable": EXIT_CODE_UNRESTARTABLE,
              "contract_held": round(sum(held) / len(held), 4) if held else None, "contract_runs": len(held),
              "job_end_p99_s": None if job_end_p99 is None or job_end_p99 == float("inf") else round(job_end_p99, 2),
              "job_end_bound_s": JOB_END_BOUND_S, "wall_s": round(time.monotonic() - began, 1)}
    print(f"contract held in {sum(held)} of {len(held)} runs under trtllm-liveness launch; fault -> the wrapper "
          f"gone, p99 {result['job_end_p99_s']} s (bound {JOB_END_BOUND_S:g} s after the verdict)")
    checks = [
        ("under trtllm-liveness launch every run ends with the documented status, the marker where due (contract_held "
         "= 1.0)", bool(held) and all(held)),
        (f"under trtllm-liveness launch the job is gone within {JOB_END_BOUND_S:g} s (job_end_p99_s, fault -> exit)",
         job_end_p99 is not None and job_end_p99 <= (JOB_END_BOUND_S or 0.0)),
        ("every server process exited or was killed with its job (none outlived its bound)",
         all(run["status"] is not None or run["fault"] == "host crash" for cell in measured for run in cell["runs"]
             if not run["launch"])),
        ("the marker after every wedge, after nothing else",
         all(run["marker"] == (cell["fault"] == "wedge") for cell in measured for run in cell["runs"])),
    ]
    return _bench.finish(checks, result, as_json=args.json, wall_s=round(time.monotonic() - began, 1))


if __name__ == "__main__":
    sys.exit(main())
