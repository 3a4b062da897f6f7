"""The upstream-shaped engine across test hosts, with its agents: start it, fault it, read its fatal error.

Shared by scripts/bench_multihost.py (through scripts/_multihost_agents.py), the multi-host demo
(``trtllm-liveness demo --hosts 3``, from a checkout) and tests. The engine is
``tests/helpers/proxy_death_child.py`` in comm mode (the fake TensorRT-LLM main tree,
``MpiCommSession`` under ``mpirun``, liveness on, the agent hub on by default) with one long request
in flight; rank 0 (the proxy, on hostA) prints the engine's fatal error with the monotonic time it
was recorded (CLOCK_MONOTONIC is the machine's one clock), whether the pending request failed,
then a bounded shutdown's reports. A fault's clock starts right before the fault's own system call.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

from tests.helpers.testhosts import MpiJob, TestHosts
from trtllm_liveness.reference._faults import FreezerGroup

REPO = Path(__file__).resolve().parents[2]
START_S = 90.0
LAYOUT = (("hostA", 2), ("hostB", 1), ("hostC", 1))
RECOVERABLE = ["--runtime-options", "recoverable"]


class Fatal(NamedTuple):
    ms: float | None  # fault -> the engine's fatal error recorded; None: none within the wait
    kind: str
    host: str
    rank: int | None
    pending_failed: bool
    message: str


def start_engine(hosts: TestHosts, *, layout: tuple[tuple[str, int], ...] = LAYOUT, liveness: str = "1",
                 request: bool = True) -> tuple[MpiJob, dict[str, Any]]:
    options = {"session": "comm", "tree": "trtllm_main", "liveness": True, "watch_fatal": True,
               "no_request": not request}
    job = hosts.mpirun(layout, [sys.executable, "-u", "-m", "tests.helpers.proxy_death_child", json.dumps(options)],
                       mpirun_args=RECOVERABLE,
                       env={"TRTLLM_WORKER_LIVENESS": liveness, "PYTHONPATH": str(REPO)})
    if not job.wait_for(lambda lines: any(line.startswith('{"ready"') for line in lines), START_S):
        raise RuntimeError(f"the engine did not start:\n{job.output()[-4000:]}")
    return job, record(job, '{"ready"')


def record(job: MpiJob, prefix: str) -> dict[str, Any]:
    """The first JSON line of the job's output that starts with ``prefix``."""
    found: dict[str, Any] = json.loads(next(line for line in job.output().splitlines() if line.startswith(prefix)))
    return found


def wait_fatal(job: MpiJob, t0: float, wait: float) -> Fatal:
    if not job.wait_for(lambda lines: any(line.startswith('{"fatal"') for line in lines), wait):
        return Fatal(None, "", "", None, False, "")
    got = record(job, '{"fatal"')
    if got["fatal"] is None:
        return Fatal(None, "", "", None, False, "")
    return Fatal((got["detected_at"] - t0) * 1000, got["kind"], got["host"], got["rank"], got["pending_failed"],
                 got["fatal"])


def pid_on(ready: dict[str, Any], rank: int) -> int:
    return int(ready["hosts"][str(rank)][2])


def remote_kill() -> Fatal:
    """SIGKILL of rank 2 (hostB, its agent's own rank) -> fatal, pending request failed."""
    with TestHosts() as hosts:
        job, ready = start_engine(hosts)
        fd, _pid = hosts.pidfd_of("hostB", pid_on(ready, 2))  # opened and verified before the clock
        try:
            t0 = time.monotonic()
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        finally:
            os.close(fd)
        return wait_fatal(job, t0, 20)


def host_fault(kind: str) -> Fatal:
    """crash | partition | silent of hostB, on fresh hosts (the fault cannot be undone)."""
    with TestHosts() as hosts:
        job, _ready = start_engine(hosts)
        t0 = time.monotonic()
        {"crash": lambda: hosts.crash("hostB"), "partition": lambda: hosts.partition("hostB"),
         "silent": lambda: hosts.silent_loss("hostB")}[kind]()
        return wait_fatal(job, t0, 20)


def remote_wedge(d_state_timeout_s: float = 2.0) -> Fatal:
    """hostB has ranks 2 (its agent) and 3; rank 3 frozen in D (cgroup v1 freezer) -> wedged.
    Measured from the freeze; the target is the D timeout plus one scan (1 s)."""
    layout = (("hostA", 2), ("hostB", 2))
    with TestHosts() as hosts:
        job, ready = start_engine(hosts, layout=layout, liveness=f"d_state_timeout_s={d_state_timeout_s}")
        victim = hosts.root_pid("hostB", pid_on(ready, 3))
        group = FreezerGroup()
        try:
            assert victim is not None
            t0 = time.monotonic()
            group.freeze([victim])
            return wait_fatal(job, t0, d_state_timeout_s + 20)
        finally:
            group.thaw()
            job.kill()
            group.remove()
