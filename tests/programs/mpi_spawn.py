"""Spawn a two-rank ``MPIPoolExecutor`` the way the reference session does and report on it.

Prints one JSON line ``{"ok": true, "prte_pid": ..., "prte_tmpdir_base": ...}`` once both ranks ran
a task, then shuts the pool down. When the spawn fails (mpi4py's spawn thread dies), nothing is
printed and the process hangs: the parent reads stderr and kills the session.
"""

from __future__ import annotations

import json
import os
import sys

from trtllm_liveness.demo._mpi_env import PRTE_TMPDIR_VAR, configure_mpi_env


def child_pids_named(name: str) -> list[int]:
    pids: list[int] = []
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/children") as handle:
            for pid in handle.read().split():
                with open(f"/proc/{pid}/comm") as comm:
                    if comm.read().strip() == name:
                        pids.append(int(pid))
    return pids


def main() -> None:
    configure_mpi_env()
    from mpi4py.futures import MPIPoolExecutor

    pool = MPIPoolExecutor(max_workers=2)
    results = list(pool.map(abs, [1, -2]))
    prte = child_pids_named("prte")
    sys.stdout.write(json.dumps({
        "ok": results == [1, 2], "prte_pid": prte[0] if prte else None,
        "prte_tmpdir_base": os.environ[PRTE_TMPDIR_VAR],
    }) + "\n")
    sys.stdout.flush()
    pool.shutdown(wait=True)


if __name__ == "__main__":
    main()
