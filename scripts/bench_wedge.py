#!/usr/bin/env python3
"""Wedge detection benchmark: how late past ``d_state_timeout_s`` a real wedge is reported, and that
slow I/O in ``D`` beside it never is.

Usage: scripts/bench_wedge.py [--json] [--wedges N] [--quick] [--timeout-s S] [--interval-s S]

Each wedge gets a fresh ``WorkerProcessMonitor`` (``d_state_timeout_s`` 2 s, ``scan_interval_s``
1 s: the default) watching two children: the victim, and a reader of a FUSE file whose every READ
is answered after 100-300 ms (in ``D`` at nearly every sample while it makes progress: the healthy
look-alike). After a random delay of up to one scan interval (so the fault lands at a random phase
of the scan), the victim is put in ``D`` by the cgroup v1 freezer (the fault time: just before
FROZEN is written) or by a FUSE lookup nobody answers (the fault time: taken by the victim just
before its ``stat()``), alternately; where one source is missing, the other does every wedge.

- ``wedge_overshoot_p50_ms`` / ``_p99_ms`` / ``_max_ms``: the WEDGED event's ``detected_at`` minus
  (fault + timeout), all ``time.monotonic()``. The floor is 0 (the timeout itself: no rule can call
  a wedge before it); a sampler taking one sample per interval adds up to one interval (the phase
  between the fault and the first sample that sees it). Target p99 <= 1100 ms.
- ``wedge_overshoot_after_first_sample_p99_ms``: the event's ``detected_at`` minus (its ``fault_at``,
  the first sample that saw the thread stuck, + the timeout): what the monitor adds beyond the
  sampling phase.
- ``bare_sampler_overshoot_p50_ms`` / ``_p99_ms``, the baseline, measured on the same wedges: a
  thread of this process that reads the victim's ``stat`` and ``status`` by path every interval
  (its own random phase) and applies the same rule (in ``D``, switch count unchanged, for the
  timeout): the least any sampler at that interval does.
- ``false_wedges_slow_io``: events about the slow reader over all runs. Target 0.

Needs root (freezer, FUSE). Nothing is left behind: the freezer group is thawed and removed, each
FUSE mount released, every child killed, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from _bench import finish, percentile

from tests.support.fuse_stall import FuseStall
from tests.support.slow_reads import slow_reader_cmd
from trtllm_liveness import EventKind, WorkerEvent
from trtllm_liveness.demo._cgroup_faults import FreezerGroup, freezer_available
from trtllm_liveness.demo._fuse_stall import fuse_available
from trtllm_liveness.monitor import WorkerProcessMonitor
from trtllm_liveness.process import capture_identity

SLEEPER = "import sys, time\nsys.stdout.write('ready\\n'); sys.stdout.flush()\ntime.sleep(3600)\n"
# Waits for a line on stdin, then prints the monotonic time and stats argv[1] (stuck in the FUSE lookup).
FUSE_VICTIM = ("import os, sys, time\nsys.stdout.write('ready\\n'); sys.stdout.flush()\nsys.stdin.readline()\n"
               "sys.stdout.write(f'{time.monotonic()!r}\\n'); sys.stdout.flush()\n"
               "try:\n    os.stat(sys.argv[1])\nexcept OSError:\n    pass\n")


@dataclass(frozen=True)
class WedgeRun:
    """One wedge: its source, when the fault began, and when each sampler called it (None: not)."""

    source: str
    fault_at: float
    detected_at: float | None
    first_stuck_sample_at: float | None
    bare_detected_at: float | None
    false_events: int


def _switches(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/task/{pid}/status") as handle:
            return sum(int(line.split()[1]) for line in handle if "ctxt_switches:" in line)
    except OSError:
        return None


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/task/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


class BareSampler:
    """The baseline: one sample per interval at its own random phase, the same rule, by path."""

    def __init__(self, pid: int, timeout_s: float, interval_s: float, phase_s: float) -> None:
        self.detected_at: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(pid, timeout_s, interval_s, phase_s), daemon=True)
        self._thread.start()

    def _run(self, pid: int, timeout_s: float, interval_s: float, phase_s: float) -> None:
        since: float | None = None
        last: int | None = None
        if self._stop.wait(phase_s):
            return
        next_at = time.monotonic()
        while not self._stop.is_set():
            tick = next_at  # dated by its schedule: two samples k ticks apart are k intervals apart
            count = _switches(pid) if _state(pid) == "D" else None
            if count is None or count != last:
                since = tick if count is not None else None
            last = count
            if since is not None and tick - since >= timeout_s:
                self.detected_at = time.monotonic()
                return
            next_at += interval_s
            self._stop.wait(max(0.0, next_at - time.monotonic()))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def _kill(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(OSError):
        proc.kill()


def one_wedge(source: str, freezer: FreezerGroup | None, reader_pid: int, timeout_s: float, interval_s: float,
              rng: random.Random) -> WedgeRun:
    """Wedge one fresh victim from ``source`` under a fresh monitor that also watches the reader."""
    stall: FuseStall | None = None
    victim: subprocess.Popen[bytes] | None = None
    events: list[WorkerEvent] = []
    got = threading.Event()

    def on_event(event: WorkerEvent) -> None:
        events.append(event)
        if event.identity.pid != reader_pid:
            got.set()

    monitor = WorkerProcessMonitor(d_state_timeout_s=timeout_s, scan_interval_s=interval_s)
    bare: BareSampler | None = None
    try:
        if source == "fuse":
            stall = FuseStall().__enter__()
            victim = subprocess.Popen([sys.executable, "-I", "-S", "-c", FUSE_VICTIM, stall.new_path()],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
        else:
            victim = subprocess.Popen([sys.executable, "-I", "-S", "-c", SLEEPER], stdout=subprocess.PIPE,
                                      start_new_session=True)
        assert victim.stdout is not None
        if victim.stdout.readline() != b"ready\n":
            raise RuntimeError("the victim did not start")
        monitor.subscribe(on_event, reports=True)  # the benchmark reports; the monitor logs at DEBUG
        monitor.register([capture_identity(0, victim.pid), capture_identity(1, reader_pid)])
        monitor.start()
        bare = BareSampler(victim.pid, timeout_s, interval_s, rng.uniform(0, interval_s))
        time.sleep(rng.uniform(0, interval_s))  # the fault at a random phase of the monitor's scan
        if source == "fuse":
            assert victim.stdin is not None and stall is not None
            victim.stdin.write(b"go\n")
            victim.stdin.flush()
            fault_at = float(victim.stdout.readline())
            if not stall.wait_held(victim.pid, 10):
                raise RuntimeError("the FUSE server never read the victim's lookup")
        else:
            assert freezer is not None
            freezer.add(victim.pid)
            fault_at = time.monotonic()
            if not freezer.freeze():
                raise RuntimeError("the freezer group did not reach FROZEN")
        got.wait(timeout_s + 3 * interval_s + 5)
        wedged = next((e for e in list(events) if e.identity.pid == victim.pid and e.kind is EventKind.WEDGED), None)
        deadline = time.monotonic() + timeout_s + 2 * interval_s + 5
        while bare.detected_at is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return WedgeRun(source, fault_at, None if wedged is None else wedged.detected_at,
                        None if wedged is None else wedged.fault_at, bare.detected_at,
                        sum(1 for e in list(events) if e.identity.pid == reader_pid))
    finally:
        if bare is not None:
            bare.stop()
        monitor.close()
        if victim is not None:
            _kill(victim)
        if freezer is not None:
            freezer.thaw()
        if stall is not None:
            stall.release()
        if victim is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                victim.wait(10)
            for pipe in (victim.stdin, victim.stdout):
                if pipe is not None:
                    pipe.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object after the table")
    parser.add_argument("--wedges", type=int, default=20, help="real wedges timed (>= 10 for the p99 target)")
    parser.add_argument("--quick", action="store_true", help="10 wedges")
    parser.add_argument("--timeout-s", type=float, default=2.0, help="d_state_timeout_s of each monitor")
    parser.add_argument("--interval-s", type=float, default=1.0, help="scan_interval_s (default: the config's)")
    parser.add_argument("--seed", type=int, default=None, help="the random phases' seed (printed)")
    args = parser.parse_args()
    if args.quick:
        args.wedges = 10
    seed = args.seed if args.seed is not None else random.randrange(1 << 32)
    rng = random.Random(seed)
    no_freezer, no_fuse = freezer_available(), fuse_available()
    if no_fuse is not None:
        print(f"cannot run: FUSE is needed for the slow reader ({no_fuse})")
        return 2
    sources = ["freezer", "fuse"] if no_freezer is None else ["fuse"]
    started = time.monotonic()
    runs: list[WedgeRun] = []
    reader_seconds = args.wedges * (args.timeout_s + 4 * args.interval_s + 10)
    with contextlib.ExitStack() as stack:
        freezer = stack.enter_context(FreezerGroup("trtllm-liveness-bench")) if no_freezer is None else None
        slow = stack.enter_context(FuseStall())
        reader = subprocess.Popen(slow_reader_cmd(slow, reader_seconds), stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, start_new_session=True)
        stack.callback(_kill, reader)
        assert reader.stdout is not None
        int(reader.stdout.readline())
        for index in range(args.wedges):
            runs.append(one_wedge(sources[index % len(sources)], freezer, reader.pid, args.timeout_s,
                                  args.interval_s, rng))
        answered = slow.slow_reads_answered()
    detected = [run for run in runs if run.detected_at is not None]
    over = [(run.detected_at - run.fault_at - args.timeout_s) * 1000 for run in detected
            if run.detected_at is not None]
    after_first = [(run.detected_at - run.first_stuck_sample_at - args.timeout_s) * 1000 for run in detected
                   if run.detected_at is not None and run.first_stuck_sample_at is not None]
    bare = [(run.bare_detected_at - run.fault_at - args.timeout_s) * 1000 for run in runs
            if run.bare_detected_at is not None]
    by_source = {source: [(run.detected_at - run.fault_at - args.timeout_s) * 1000 for run in detected
                          if run.source == source and run.detected_at is not None] for source in sources}
    false_wedges = sum(run.false_events for run in runs)
    wall_s = time.monotonic() - started
    r: dict[str, object] = {
        "wedges": len(runs), "detected": len(detected), "sources": sources,
        "timeout_s": args.timeout_s, "scan_interval_s": args.interval_s, "floor_overshoot_ms": 0.0,
        "wedge_overshoot_p50_ms": percentile(over, 0.5), "wedge_overshoot_p99_ms": percentile(over, 0.99),
        "wedge_overshoot_max_ms": max(over, default=None),
        "wedge_overshoot_after_first_sample_p99_ms": percentile(after_first, 0.99),
        "bare_sampler_overshoot_p50_ms": percentile(bare, 0.5), "bare_sampler_overshoot_p99_ms": percentile(bare, 0.99),
        **{f"wedge_overshoot_{source}_p99_ms": percentile(values, 0.99) for source, values in by_source.items()},
        "false_wedges_slow_io": false_wedges, "slow_reads_answered": answered,
        "seed": seed, "wall_s": wall_s,
    }

    def ms(value: object) -> str:
        return "-" if not isinstance(value, float) else f"{value:.0f}"

    rows = [
        ("fault -> WEDGED past the timeout (monitor)", "p50/p99/max ms",
         f"{ms(r['wedge_overshoot_p50_ms'])} / {ms(r['wedge_overshoot_p99_ms'])} / {ms(r['wedge_overshoot_max_ms'])}"),
        *((f"  {source} only", "p99 ms", ms(r[f"wedge_overshoot_{source}_p99_ms"])) for source in sources),
        ("  after the first stuck sample", "p99 ms", ms(r["wedge_overshoot_after_first_sample_p99_ms"])),
        ("bare sampler, same rule (baseline)", "p50/p99 ms",
         f"{ms(r['bare_sampler_overshoot_p50_ms'])} / {ms(r['bare_sampler_overshoot_p99_ms'])}"),
        ("floor: the timeout itself", "ms", "0"),
        ("slow reader beside each wedge: events", "count", f"{false_wedges} ({answered} reads answered)"),
    ]
    print(f"{len(runs)} wedges ({', '.join(sources)}), d_state_timeout_s {args.timeout_s:g}, "
          f"scan_interval_s {args.interval_s:g}, seed {seed}")
    print(f"{'measure':44} {'unit':15} value")
    for name, unit, value in rows:
        print(f"{name:44} {unit:15} {value}")
    p99 = r["wedge_overshoot_p99_ms"]
    targets = [
        (f"every wedge reported ({len(detected)}/{len(runs)})", len(detected) == len(runs)),
        (f"wedges >= 10 ({len(runs)})", len(runs) >= 10),
        ("wedge_overshoot_p99 <= 1100 ms", isinstance(p99, float) and p99 <= 1100),
        ("no event about the slow reader", false_wedges == 0),
    ]
    return finish(targets, r, as_json=args.json, wall_s=wall_s)


if __name__ == "__main__":
    sys.exit(main())
