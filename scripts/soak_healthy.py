#!/usr/bin/env python3
"""Healthy chaos: hard but healthy conditions must raise no verdict; a real fault after each must.

Usage: scripts/soak_healthy.py [--json] [--minutes M] [--smoke] [--families a,b,...]

Each round is a fresh engine on fresh namespace test hosts (scripts/_soak_families.py: the
upstream-shaped engine under ``mpirun``, one long request in flight, every step needing every rank
over the data network; ranks 0 and 1 on hostA, 2 (hostB's agent) and 3 on hostB), with the soak's
settings: ``d_state_timeout_s=3, scan_interval_s=1, stopped_timeout_s=5, heartbeat_timeout_s=1``
(short enough to fit; the rules are the defaults'). A round runs one condition for its seconds while
the engine serves (its ``progress`` records show rank 0's iterations, each of which needed every
rank); any fatal error before the real fault is a **false verdict**. Then a real fault of the same
family, **detected** when the engine's fatal error has the expected kind, names the victim's host
and comes within its bound:

  family        the healthy condition                          the real fault             verdict  bound
  slow-io       rank 3's loader thread reads a FUSE file, each  the same thread reads a    wedged   3+1+1 s
                READ answered after 0.1-0.3 s: in D most of the FUSE file never answered
                time, switching at each answer (the look-alike  (D, no context switch)
                of a wedge, tests/support/slow_reads.py)
  cpu-throttle  rank 1 limited to 10% of a CPU (cgroup v1        rank 1 SIGSTOPped, held    stalled  5+1+1 s
                cpu.cfs_quota_us 10000 / cfs_period_us 100000,
                cgroup v2's cpu.max "10000 100000")
  short-stops   rank 1 SIGSTOPped 2 s then continued, every 5 s  rank 1 SIGSTOPped, held    stalled  5+1+1 s
  mgmt-netem    hostB's management link: 1% loss and 0-0.2 s     hostB partitioned (both    lost     1.5 s
                jitter each way, 2 of every 5 frames into it     networks)
                dropped (tests/support/netem.py)
  mgmt-outage   hostB's management network down (its data        hostB partitioned (both    lost     1.5 s
                network up), healed, heard again                 networks)
  memory        rank 3 in a 32 MiB cgroup v1 memory group        rank 3's loader allocates  died     1 s
                while its loader streams a 64 MiB file through   96 MiB: the kernel's OOM
                the page cache (memory.failcnt counts the        kill of rank 3
                reclaims)

Why these ranks: the stopped-rank rule watches the proxy's local ranks (rank 1); hostB's agent
samples the other ranks of its host (rank 3) for D, and reports deaths. The test hosts' ranks have
private mount namespaces, so a FUSE mount of this process is not visible to them: the file is
opened by a short-lived child and handed to the rank's loader thread over a unix socket in the
hosts' shared directory (tests/support/rank_loader.py, the engine's ``loader`` option); the read
happens in the rank, through this process's FUSE server. The outage round is
scripts/_multihost_agents.py's ``false_alarms_mgmt_outage`` (3 hosts) with the soak's settings.

Times: a fault is timed from just before it is injected (the hand-over of the unanswered file,
the SIGSTOP, the partition) to the fatal error's ``detected_at``; the OOM kill from the last 10 ms
sample of the memory group's ``oom_kill`` counter before it moved.

Length: ``--minutes M`` (default 10) runs the families in turn, each condition for its full length
(slow-io 60 s, cpu-throttle 20 s, short-stops 40 s, mgmt-netem 60 s, mgmt-outage 30 s, memory
60 s), until the conditions add up to M minutes; ``--smoke`` (CI) runs each family once for 3 s
(18 s of conditions, each followed by its real fault). ``--families`` picks some.

Targets: ``false_verdicts`` 0 over >= M minutes of conditions (the smoke: 18 s);
``real_faults_detected`` == ``real_faults_injected`` > 0 (a soak that detects nothing cannot pass);
every round started and its engine kept serving under its condition; nothing left behind
(``leftovers``: test hosts' namespaces and processes, cgroups of this run's prefix, FUSE mounts of
this process, children of this process, each also removed on failure). ``real_faults_reported``:
the expected verdicts whatever their time (a bound missed on a loaded machine is then visible).
Needs root, cgroup v1 cpu and memory controllers, FUSE, nftables and the test hosts.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import asdict
from typing import Any

import _bench
import _soak_families as soak

from tests.support.cgroups import cpu_cgroup_available, memory_cgroup_available, remove_leftover_groups
from tests.support.netem import unavailable as netem_unavailable
from tests.support.testhosts import NS_PREFIX, netns_names
from tests.support.testhosts import unavailable as testhosts_unavailable
from trtllm_liveness.demo._fuse_stall import MOUNT_PREFIX, fuse_available, fuse_mounts

FULL_S = {"slow-io": 60.0, "cpu-throttle": 20.0, "short-stops": 40.0, "mgmt-netem": 60.0, "mgmt-outage": 30.0,
          "memory": 60.0}
SMOKE_S = dict.fromkeys(soak.FAMILIES, 3.0)


def plan(minutes: float, smoke: bool, families: tuple[str, ...]) -> tuple[list[tuple[str, float]], float]:
    """The rounds (family, seconds) and the conditions' total they must reach."""
    if smoke:
        rounds = [(family, SMOKE_S[family]) for family in families]
        return rounds, sum(seconds for _, seconds in rounds)
    target = minutes * 60
    rounds, total = [], 0.0
    while total < target:
        for family in families:
            if total >= target:
                break
            rounds.append((family, FULL_S[family]))
            total += FULL_S[family]
    return rounds, target


def missing() -> list[str]:
    reasons = [testhosts_unavailable(), netem_unavailable(), cpu_cgroup_available(), memory_cgroup_available(),
               fuse_available()]
    return [reason for reason in reasons if reason]


def leftovers(cgroup_prefix: str) -> list[str]:
    """What of this run is still there (and is removed now): cgroups of its prefix, its FUSE mounts,
    its test hosts' namespaces, its children."""
    left = [f"cgroup {path}" for path in remove_leftover_groups(cgroup_prefix)]
    left += [f"FUSE mount {path}" for path in fuse_mounts() if f"/{MOUNT_PREFIX}-{os.getpid()}-" in path]
    left += [f"netns {name}" for name in netns_names() if name.startswith(f"{NS_PREFIX}{os.getpid()}-")]
    for child in _children():
        left.append(f"child process {child}")
        with contextlib.suppress(OSError):
            os.kill(child, signal.SIGKILL)
    return left


def _children() -> list[int]:
    found = []
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError), open(f"/proc/self/task/{task}/children") as handle:
            for pid in handle.read().split():
                with contextlib.suppress(OSError, IndexError), open(f"/proc/{pid}/stat") as stat:
                    if stat.read().rpartition(")")[2].split()[0] not in "ZX":
                        found.append(int(pid))
    return found


def table(rounds: list[soak.RoundResult]) -> None:
    print("| round | condition | s | false verdicts | real fault | detected | ms | bound ms |")
    print("|---:|---|---:|---:|---|---|---:|---:|")
    for number, r in enumerate(rounds, 1):
        if r.error:
            got = f"not run: {r.error.splitlines()[0][:80]}"
        elif not r.injected:
            got = "not injected (false verdict first)"
        else:
            got = "yes" if r.detected else f"NO ({r.kind or 'no verdict'}{' late' if r.reported else ''})"
        verdict = f"{r.fault} -> `{r.expected}`"
        ms = "-" if r.ms is None else f"{r.ms:.0f}"
        print(f"| {number} | {r.family}: {r.condition} | {r.seconds:.0f} | {r.false_verdicts} | {verdict} | {got} | "
              f"{ms} | {r.bound_ms:.0f} |")
    print()
    for number, r in enumerate(rounds, 1):
        pause = "-" if r.longest_pause_s is None else f"{r.longest_pause_s:.2f} s"
        print(f"round {number} {r.family}: {r.iterations} iterations under the condition (longest pause {pause}); "
              f"{', '.join(f'{key} {value}' for key, value in r.evidence.items())}"
              + (f"; FALSE VERDICT: {r.false_verdict[:300]}" if r.false_verdict else "")
              + (f"; leftovers {r.leftovers}" if r.leftovers else ""))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object after the table")
    parser.add_argument("--minutes", type=float, default=10.0, help="conditions in all, minutes (default 10)")
    parser.add_argument("--smoke", action="store_true", help="each family once for 3 s (CI)")
    parser.add_argument("--families", default=",".join(soak.FAMILIES), help="which families, comma-separated")
    args = parser.parse_args()
    families = tuple(name for name in args.families.split(",") if name)
    unknown = [name for name in families if name not in soak.FAMILIES]
    if unknown or not families or args.minutes <= 0:
        parser.error(f"families from {', '.join(soak.FAMILIES)} (not {unknown}), minutes > 0")
    reasons = missing()
    if reasons:
        print(f"cannot run: {'; '.join(reasons)}", file=sys.stderr)
        return 2
    rounds_planned, target = plan(args.minutes, args.smoke, families)
    began = time.monotonic()
    workdir = tempfile.mkdtemp(prefix="trtllm-soak-")
    prefix = f"trtllm-liveness-soak-{os.getpid()}"
    results: list[soak.RoundResult] = []
    left: list[str] = []
    try:
        data_file = os.path.join(workdir, "stream.bin")
        soak.write_data_file(data_file)
        for number, (family, seconds) in enumerate(rounds_planned, 1):
            print(f"round {number}/{len(rounds_planned)}: {family} for {seconds:.0f} s", file=sys.stderr, flush=True)
            results.append(soak.run_round(family, seconds, data_file, prefix))
            left += results[-1].leftovers
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        left += leftovers(prefix)
        if os.path.exists(workdir):
            left.append(f"directory {workdir}")
    wall = time.monotonic() - began
    table(results)
    false = sum(r.false_verdicts for r in results)
    healthy = sum(r.seconds for r in results)
    injected = sum(r.injected for r in results)
    detected = sum(r.detected for r in results)
    served = sum(not r.error and r.served for r in results)
    result: dict[str, Any] = {
        "mode": "smoke" if args.smoke else f"{args.minutes:g} minutes", "settings": soak.SETTINGS,
        "false_verdicts": false, "healthy_seconds": round(healthy, 1), "healthy_target_s": target,
        "real_faults_injected": injected, "real_faults_detected": detected,
        "real_faults_reported": sum(r.reported for r in results), "rounds_run": served,
        "rounds": [{**asdict(r), "served": r.served} for r in results], "leftovers": left, "wall_s": round(wall, 1),
    }
    checks = [
        (f"false_verdicts == 0 over >= {target:.0f} s of healthy conditions ({false} in {healthy:.0f} s)",
         false == 0 and round(healthy, 1) >= target),
        (f"real_faults_detected == real_faults_injected > 0, each within its bound ({detected} of {injected})",
         injected > 0 and detected == injected),
        (f"every round started and its engine kept serving under the condition ({served} of {len(results)})",
         served == len(results) == len(rounds_planned)),
        (f"nothing left behind ({len(left)})", not left),
    ]
    return _bench.finish(checks, result, as_json=args.json, wall_s=wall)


if __name__ == "__main__":
    sys.exit(main())
