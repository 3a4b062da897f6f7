#!/usr/bin/env python3
"""Proxy death (issue 10 point 12): how long an engine's ranks outlive a SIGKILLed proxy.

Runs the child of tests/unittest/integrations/test_proxy_death.py
(``tests/programs/proxy_death_child.py``, the upstream-shaped fake ``tensorrt_llm`` of
tests/fakes/trtllm_main, Open MPI without ULFM) ``--runs`` times per case and prints one JSON
object: per case the time from the SIGKILL to the last rank's pidfd becoming readable (each rank's
pidfd opened and verified by start time before the kill), p50 and max in ms, or the number of runs
where a rank was still alive after ``--observe`` seconds. Cases:

- ``mpirun_liveness`` / ``mpirun_off``: ``mpirun --runtime-options recoverable -n 3``
  (``MpiCommSession``), SIGKILL of rank 0 (the proxy); ranks 1-2 measured;
- ``pool_proxy_liveness`` / ``pool_proxy_off``: ``MpiPoolSession`` (2 spawned ranks), SIGKILL of
  the proxy alone (prte ends the spawned job on its own without the extension);
- ``pool_group_liveness`` / ``pool_group_off``: the proxy and its prte SIGKILLed together.

Usage: ``python scripts/proxy_death_figures.py [--runs 5] [--observe 10]``. Every wait is bounded;
each child's session is killed after each run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import signal
import statistics
import sys
import time
from typing import Any

from tests.support.children import HelperProcess
from trtllm_liveness.process import _pidfd

OPEN_MPI_DEFAULT = {"OMPI_MCA_mpi_ft_enable": "0"}


def _open(entries: list[list[int]]) -> dict[int, int]:
    fds: dict[int, int] = {}
    for pid, start_time in entries:
        fds[pid] = _pidfd.open_verified_pidfd(pid, start_time)
    return fds


def _last_exit(fds: dict[int, int], t0: float, observe: float) -> float | None:
    """Seconds from ``t0`` until every fd is readable, or None if one is not within ``observe``."""
    pending = dict(fds)
    last = t0
    deadline = t0 + observe
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        poller = select.poll()
        for fd in pending.values():
            poller.register(fd, select.POLLIN)
        ready = {fd for fd, _ in poller.poll(max(1, int(remaining * 1000)))}
        now = time.monotonic()
        for pid in [pid for pid, fd in pending.items() if fd in ready]:
            del pending[pid]
            last = now
    return last - t0


def _kill(fds: dict[int, int]) -> None:
    for fd in fds.values():
        _pidfd.send_signal(fd, signal.SIGKILL)


def one_run(case: str, observe: float) -> float | None:
    liveness = case.endswith("_liveness")
    if case.startswith("mpirun"):
        options = {"session": "comm", "tree": "trtllm_main", "liveness": liveness}
        job = HelperProcess("mpirun_exec", {"mpirun_args": ["--runtime-options", "recoverable"], "n": 3,
                                            "module": "proxy_death_child", "options": options}, OPEN_MPI_DEFAULT)
    else:
        options = {"session": "pool", "tree": "trtllm_main", "liveness": liveness, "workers": 2}
        argv = [sys.executable, "-m", "tests.programs.proxy_death_child", json.dumps(options)]
        job = HelperProcess("subreaper", {"argv": argv, "linger_s": 120}, OPEN_MPI_DEFAULT)
    fds: dict[int, int] = {}
    victims: dict[int, int] = {}
    try:
        record = job.read_record(90, "ready")
        fds = _open([[pid, start] for _rank, pid, start in record["ranks"]])
        victim_entries = [record["proxy"]]
        if case.startswith("pool_group"):
            victim_entries = [*record["prte"], record["proxy"]]  # prte first (see the test module)
        victims = _open(victim_entries)
        t0 = time.monotonic()
        _kill(victims)
        return _last_exit(fds, t0, observe)
    finally:
        with contextlib.suppress(Exception):
            _kill({pid: fd for pid, fd in fds.items() if not _pidfd.is_exited(fd)})
        for fd in [*fds.values(), *victims.values()]:
            with contextlib.suppress(OSError):
                os.close(fd)
        job.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--observe", type=float, default=10.0, help="seconds to wait for the ranks to exit")
    parser.add_argument("--cases", default="mpirun_liveness,mpirun_off,pool_proxy_liveness,pool_proxy_off,"
                                            "pool_group_liveness,pool_group_off")
    args = parser.parse_args()
    figures: dict[str, Any] = {"runs": args.runs, "observe_s": args.observe}
    for case in args.cases.split(","):
        samples = [one_run(case, args.observe) for _ in range(args.runs if not case.startswith("mpirun_off") else 1)]
        exited = [s * 1e3 for s in samples if s is not None]
        figures[case] = {
            "ranks_gone_p50_ms": round(statistics.median(exited), 1) if exited else None,
            "ranks_gone_max_ms": round(max(exited), 1) if exited else None,
            "runs_with_survivors": sum(1 for s in samples if s is None), "runs_done": len(samples)}
        print(json.dumps({case: figures[case]}), file=sys.stderr, flush=True)
    print(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
