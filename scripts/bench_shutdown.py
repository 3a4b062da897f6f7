#!/usr/bin/env python3
"""Benchmark bounded shutdown: how far past its deadline ``stop_processes`` returns.

N workers (half ignore SIGTERM, so both phases run), of which k = 0, 1 and 4 are frozen in a
cgroup v1 freezer (state D, SIGKILL pending: unkillable). Each repetition starts fresh workers
and calls ``stop_processes(grace_s, kill_s)``:

- k > 0: overshoot = time the call took minus (grace + kill);
- k = 0: overshoot = time the call returned minus the moment the last worker died, as seen by an
  independent observer thread polling its own pidfds.

Baseline, side by side: a torchrun-style close (SIGTERM, wait grace, SIGKILL, then ``wait()``
WITHOUT a timeout) on the k = 1 case, run in a child process that is killed if it has not
returned within 10 s. Needs root and /sys/fs/cgroup/freezer for k > 0 and the baseline.

Usage: scripts/bench_shutdown.py [--json] [--reps N]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import logging
import math
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

from trtllm_liveness.demo._cgroup_faults import FreezerGroup, freezer_available
from trtllm_liveness.process import _procfs, capture_identity
from trtllm_liveness.stop._bounded_stop import stop_processes
from trtllm_liveness.stop._stop_report import StopOutcome

BASELINE_LIMIT_S = 10.0
PR_SET_CHILD_SUBREAPER = 36

# torchrun's close before PR #185414: SIGTERM, poll until the deadline, SIGKILL, then join
# without a timeout. Prints the worker pids, waits for "go", prints "returned" if it ever does.
BASELINE = r"""
import signal, subprocess, sys, time
grace, n = float(sys.argv[1]), int(sys.argv[2])
procs = [subprocess.Popen(["sleep", "3600"]) for _ in range(n)]
print(" ".join(str(p.pid) for p in procs), flush=True)
sys.stdin.readline()
for p in procs:
    p.send_signal(signal.SIGTERM)
deadline = time.monotonic() + grace
while time.monotonic() < deadline and any(p.poll() is None for p in procs):
    time.sleep(0.1)
for p in procs:
    if p.poll() is None:
        p.send_signal(signal.SIGKILL)
for p in procs:
    p.wait()
print("returned", flush=True)
"""


class Cgroup(FreezerGroup):
    """One freezer cgroup for the whole run; always thawed and removed."""

    def __init__(self) -> None:
        super().__init__("trtllm-liveness-bench")

    def freeze(self, pids: Iterable[int] = (), timeout: float = 10.0) -> bool:
        pids = list(pids)
        deadline = time.monotonic() + timeout
        if not super().freeze(pids, timeout):
            raise RuntimeError(f"freezer did not freeze within {timeout} s")
        while not all(_state(pid) == "D" for pid in pids):
            if time.monotonic() > deadline:
                raise RuntimeError(f"frozen workers not in D state within {timeout} s")
            time.sleep(0.002)
        return True

    def remove(self, timeout: float = 10.0) -> bool:
        if not super().remove(timeout):
            sys.stderr.write(f"warning: could not remove {self.path}\n")
            return False
        return True


def _state(pid: int) -> str | None:
    try:
        return _procfs.read_stat(pid).state
    except (OSError, ValueError):
        return None


def _start_workers(n: int) -> list[subprocess.Popen[bytes]]:
    workers = []
    for index in range(n):
        argv = ["sleep", "3600"] if index % 2 == 0 else ["sh", "-c", "trap '' TERM; exec sleep 3600"]
        workers.append(subprocess.Popen(argv, start_new_session=True))
    # Wait until every worker runs `sleep` (the trap is set before the exec).
    deadline = time.monotonic() + 10
    for worker in workers:
        while _comm(worker.pid) != "sleep" and time.monotonic() < deadline:
            time.sleep(0.001)
    return workers


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as handle:
            return handle.read().strip()
    except OSError:
        return ""


class DeathObserver:
    """Records when each pid's pidfd becomes readable, from a thread of its own."""

    def __init__(self, pids: list[int]) -> None:
        self.fds = {os.pidfd_open(pid): pid for pid in pids}
        self.died: dict[int, float] = {}
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="bench-death-observer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = select.poll()
        for fd in self.fds:
            poller.register(fd, select.POLLIN)
        while len(self.died) < len(self.fds) and not self._stop:
            for fd, _ in poller.poll(50):
                self.died.setdefault(self.fds[fd], time.monotonic())
                poller.unregister(fd)

    def close(self) -> None:
        self._stop = True
        self._thread.join(5)
        for fd in self.fds:
            os.close(fd)


def _reap(workers: list[subprocess.Popen[bytes]]) -> None:
    for worker in workers:
        with contextlib.suppress(OSError):
            if worker.poll() is None:
                worker.kill()
    for worker in workers:
        with contextlib.suppress(subprocess.TimeoutExpired):
            worker.wait(10)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (for 10 samples, p99 is the maximum)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100.0 * len(ordered)) - 1)]


def run_case(k: int, reps: int, n: int, grace: float, kill: float, cgroup: Cgroup | None,
             live: list[subprocess.Popen[bytes]]) -> dict[str, Any]:
    overshoots: list[float] = []
    reported: list[int] = []
    elapsed: list[float] = []
    for _ in range(reps):
        workers = _start_workers(n)
        live.extend(workers)
        try:
            capture_identity(0, workers[0].pid)  # warms the hostname and namespace caches
            frozen = [worker.pid for worker in workers[:k]]
            if frozen:
                assert cgroup is not None
                cgroup.freeze(frozen)
            observer = DeathObserver([worker.pid for worker in workers])
            try:
                started = time.monotonic()
                report = stop_processes(workers, grace_s=grace, kill_s=kill)
                returned = time.monotonic()
            finally:
                if cgroup is not None:
                    cgroup.thaw()
                # Give the observer a moment to see the thawed workers die before it stops.
                deadline = time.monotonic() + 5
                while len(observer.died) < n and time.monotonic() < deadline:
                    time.sleep(0.005)
                observer.close()
            elapsed.append(returned - started)
            if k == 0:
                overshoots.append(returned - max(observer.died.values()))
            else:
                overshoots.append((returned - started) - (grace + kill))
            unkillable_pids = {item.pid for item in report.unkillable}
            reported.append(len(unkillable_pids & set(frozen)))
            if k == 0 and report.by_outcome(StopOutcome.UNKILLABLE):
                sys.stderr.write("warning: a worker was reported unkillable with nothing frozen\n")
        finally:
            _reap(workers)
            for worker in workers:
                live.remove(worker)
    return {
        "k": k,
        "reps": reps,
        "overshoot_p50_ms": percentile(overshoots, 50) * 1000,
        "overshoot_p99_ms": percentile(overshoots, 99) * 1000,
        "overshoot_max_ms": max(overshoots) * 1000,
        "elapsed_mean_s": sum(elapsed) / len(elapsed),
        "unkillable_reported_min": min(reported),
        "unkillable_expected": k,
    }


def run_baseline(n: int, grace: float, cgroup: Cgroup) -> dict[str, Any]:
    """The torchrun-style close on k = 1, in a child we kill if it has not returned in 10 s."""
    child = subprocess.Popen([sys.executable, "-c", BASELINE, str(grace), str(n)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
    assert child.stdin is not None and child.stdout is not None
    pids: list[int] = []
    try:
        pids = [int(pid) for pid in child.stdout.readline().split()]
        cgroup.freeze(pids[:1])
        started = time.monotonic()
        child.stdin.write(b"go\n")
        child.stdin.flush()
        ready, _, _ = select.select([child.stdout], [], [], BASELINE_LIMIT_S)
        returned = bool(ready) and child.stdout.readline().strip() == b"returned"
        waited = time.monotonic() - started
    finally:
        with contextlib.suppress(OSError):
            child.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(10)
        cgroup.thaw()
        # The baseline's workers are orphans now; as a subreaper we collect them by pid.
        deadline = time.monotonic() + 10
        for pid in pids:
            while time.monotonic() < deadline:
                try:
                    if os.waitpid(pid, os.WNOHANG)[0]:
                        break
                except ChildProcessError:
                    break
                time.sleep(0.01)
    return {"returned": returned, "waited_s": waited}


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    # A SIGTERM to the bench must also run the cleanup (thaw, rmdir), like Ctrl-C does.
    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object after the table")
    parser.add_argument("--reps", type=int, default=10, help="repetitions per k (default 10)")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--grace", type=float, default=0.5)
    parser.add_argument("--kill", type=float, default=0.5)
    args = parser.parse_args()
    n, grace, kill = args.workers, args.grace, args.kill

    # Every frozen worker logs one ERROR line by design; keep them out of the table.
    logging.getLogger("trtllm_liveness").addHandler(logging.NullHandler())
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)

    reason = freezer_available()
    ks = [0, 1, 4] if reason is None else [0]
    if reason is not None:
        sys.stderr.write(f"note: {reason}; only k=0 runs, no baseline\n")
    results: dict[int, dict[str, Any]] = {}
    baseline: dict[str, Any] | None = None
    live: list[subprocess.Popen[bytes]] = []
    cgroup: Cgroup | None = None
    t0 = time.monotonic()
    try:
        with _sigterm_as_interrupt():
            cgroup = Cgroup() if reason is None else None
            for k in ks:
                results[k] = run_case(k, args.reps, n, grace, kill, cgroup, live)
            if cgroup is not None:
                baseline = run_baseline(n, grace, cgroup)
    except KeyboardInterrupt:
        sys.stderr.write("interrupted; cleaning up\n")
        return 130
    finally:
        if cgroup is not None:
            cgroup.thaw()
        _reap(live)
        if cgroup is not None:
            cgroup.remove()
    total = time.monotonic() - t0

    print(f"bounded shutdown: N={n} workers, grace {grace}s, kill {kill}s, {args.reps} reps per k")
    print(f"{'k':>3} {'p50 ms':>9} {'p99 ms':>9} {'max ms':>9} {'mean call s':>12} {'unkillable reported':>20}")
    for k, row in results.items():
        print(f"{k:>3} {row['overshoot_p50_ms']:>9.2f} {row['overshoot_p99_ms']:>9.2f} "
              f"{row['overshoot_max_ms']:>9.2f} {row['elapsed_mean_s']:>12.3f} "
              f"{row['unkillable_reported_min']:>9} of {row['unkillable_expected']}")
    print("(k=0: past the last worker's death as seen by an observer thread, negative when it saw the death "
          "after the call returned; k>0: past grace+kill)")
    if baseline is not None:
        verdict = "returned" if baseline["returned"] else f"did NOT return within {BASELINE_LIMIT_S:.0f}s (killed)"
        print(f"baseline torchrun-style close (join without timeout), k=1: {verdict}")
    print(f"total {total:.1f}s")

    if args.json:
        out: dict[str, Any] = {"workers": n, "grace_s": grace, "kill_s": kill, "reps": args.reps}
        for k in (0, 1, 4):
            case = results.get(k)
            out[f"overshoot_p50_ms_k{k}"] = None if case is None else round(case["overshoot_p50_ms"], 3)
            out[f"overshoot_p99_ms_k{k}"] = None if case is None else round(case["overshoot_p99_ms"], 3)
            out[f"overshoot_max_ms_k{k}"] = None if case is None else round(case["overshoot_max_ms"], 3)
            if k:
                out[f"unkillable_reported_k{k}"] = None if case is None else case["unkillable_reported_min"]
        out["baseline_unbounded_returned"] = None if baseline is None else baseline["returned"]
        out["baseline_waited_s"] = None if baseline is None else round(baseline["waited_s"], 3)
        out["freezer"] = reason or "available"
        out["total_s"] = round(total, 2)
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
