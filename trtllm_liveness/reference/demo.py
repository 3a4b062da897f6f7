"""``trtllm-liveness demo``: a real fault in a real MPI worker, and the timeline of what follows.

Runs the reference executor (Open MPI with ``OMPI_MCA_mpi_ft_enable=1``, where upstream hangs)
with liveness on, streams requests, injects the fault into one rank and prints: fault at t0,
detection, health false, requests failed, shutdown done (milliseconds after t0).

Faults: ``kill`` (SIGKILL: a death), ``wedge`` (cgroup v1 freezer: real ``D`` state, survives
SIGKILL; a non-restartable fatal error, and shutdown reports the rank unkillable), ``fuse`` (one
helper thread of the rank stuck in a FUSE lookup nobody answers, wchan ``request_wait_answer``, as a
driver call that never returns; detected per thread while the main thread keeps serving), ``stop``
(SIGSTOP). A stopped process is alive and killable, not dead or in ``D``, so the monitor does
not call it a failure (a debugger or job control may stop a worker on purpose); the demo surfaces
it as a *stall* (no token progress for ``--stall-timeout`` seconds) and shows that ``shutdown()``
still ends it within its bound (SIGTERM is held while stopped; SIGKILL ends it).

Exit status: 0 when the fault was detected (a stall for ``stop``) and shutdown was bounded with
no process left; 1 otherwise; 2 when the fault cannot be made here.
"""

from __future__ import annotations

import argparse
import json
import sys

from ._records import ScenarioOptions, ScenarioResult
from ._scenario import FREEZER_ROOT, run_scenario


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the demo's options to ``parser``."""
    parser.add_argument("--fault", choices=["kill", "stop", "wedge", "fuse"], default="kill",
                        help="fault to inject: SIGKILL, SIGSTOP, the whole rank frozen in D (cgroup v1 "
                             "freezer), or one of its threads stuck in D in a FUSE lookup")
    parser.add_argument("--workers", type=int, default=2, help="MPI worker ranks (>= 2)")
    parser.add_argument("--rank", type=int, default=None, help="rank to hit (default: the last)")
    parser.add_argument("--mode", choices=["main", "1.2"], default="main", help="TensorRT-LLM behaviour to mimic")
    parser.add_argument("--requests", type=int, default=4, help="requests in flight")
    parser.add_argument("--stall-timeout", type=float, default=1.0, help="seconds without tokens = stall (stop)")
    parser.add_argument("--timeout", type=float, default=60.0, help="outer bound on the whole run (s)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the timeline")


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:9.1f} ms"


def run(args: argparse.Namespace) -> int:
    """Run the demo; returns the exit status (see the module docstring). Blocks up to ``--timeout``."""
    if args.workers < 2:
        sys.stderr.write("trtllm-liveness: demo: --workers must be >= 2\n")
        return 2
    rank = args.workers - 1 if args.rank is None else args.rank
    if not 0 <= rank < args.workers:
        sys.stderr.write(f"trtllm-liveness: demo: --rank must be in [0, {args.workers - 1}]\n")
        return 2
    if args.fault == "wedge":
        import os

        if not os.access(FREEZER_ROOT, os.W_OK):
            sys.stderr.write(
                f"trtllm-liveness: demo: --fault wedge needs a writable cgroup v1 freezer at {FREEZER_ROOT}\n"
            )
            return 2
    if args.fault == "fuse":
        from ._fuse_stall import fuse_available

        reason = fuse_available()
        if reason is not None:
            sys.stderr.write(f"trtllm-liveness: demo: --fault fuse cannot run here: {reason}\n")
            return 2
    options = ScenarioOptions(mode=args.mode, workers=args.workers, fault=args.fault, fault_rank=rank,
                              requests=args.requests, stall_timeout_s=args.stall_timeout,
                              observe_s=max(5.0, args.timeout / 3), shutdown_grace_s=1.0)
    run = run_scenario(options, args.timeout)
    if not run.results:
        problem = run.error or run.stderr or "no record"
        sys.stderr.write(f"trtllm-liveness: demo: the scenario failed: {problem[-2000:]}\n")
        return 1
    out = run.results[0]
    survivors = list(run.survivors)
    ok = _detected(out, args.fault) is not None and _shutdown_ms(out) is not None and not survivors
    if args.json:
        record = out.to_dict()
        record.pop("options", None)
        record.update(survivors=survivors, ok=ok)
        sys.stdout.write(json.dumps(record) + "\n")
        return 0 if ok else 1
    victim = out.victim
    detection = out.detection
    lines = [
        f"trtllm-liveness demo: {args.workers} MPI workers ({args.mode} mode), {out.in_flight} requests in "
        f"flight, fault '{args.fault}' on rank {rank} (pid {victim.pid if victim else '?'})",
        f"  t0  fault injected              {_fmt(0.0)}",
    ]
    if args.fault == "stop":
        stall = None if detection is None else detection.stall_detected_ms
        lines.append(f"      stall noticed (no tokens)  {_fmt(stall)}")
        lines.append("      (SIGSTOP: alive and killable, not a liveness failure; health stays as it is)")
    else:
        lines += [
            f"      detected by the monitor    {_fmt(None if detection is None else detection.detected_ms)}",
            f"      check_health() False       {_fmt(None if detection is None else detection.health_false_ms)}",
            f"      every request failed       {_fmt(None if detection is None else detection.requests_failed_ms)}",
        ]
    lines.append(f"      shutdown() took            {_fmt(_shutdown_ms(out))}")
    if out.fatal_error:
        lines.append(f"  fatal error: {out.fatal_error}")
    if out.shutdown is not None and out.shutdown.unkillable:
        lines.append(f"  unkillable after SIGKILL: pids {list(out.shutdown.unkillable)} (host must be recycled)")
    lines.append(f"  processes left: {survivors or 'none'}")
    lines.append("  result: " + ("OK: detected and shut down within bounds" if ok else "FAILED"))
    sys.stdout.write("\n".join(lines) + "\n")
    return 0 if ok else 1


def _detected(out: ScenarioResult, fault: str) -> float | None:
    """When the fault was noticed: the stall for ``stop`` (not a liveness failure), else the event."""
    if out.detection is None:
        return None
    return out.detection.stall_detected_ms if fault == "stop" else out.detection.detected_ms


def _shutdown_ms(out: ScenarioResult) -> float | None:
    return None if out.shutdown is None else out.shutdown.shutdown_ms


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trtllm_liveness.reference.demo", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
