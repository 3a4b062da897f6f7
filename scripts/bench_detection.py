#!/usr/bin/env python3
"""Benchmark: how fast and how cheaply WorkerProcessMonitor notices a dead worker.

Usage: scripts/bench_detection.py [--json] [--kills N] [--quick] [--markdown] [--no-growth] [--no-hosts]

All measured processes are non-children (grandchildren: a helper process forks the sleepers and
reaps them), as MPI-spawned workers are for the TensorRT-LLM proxy. Measured side by side:

  floor      SIGKILL -> a bare pidfd becomes readable (the kernel's own latency)
  detect     SIGKILL -> the monitor's subscriber is called (watcher thread, event-driven);
             floor and detect kills alternate, so both series see the same machine noise
  poll100ms  SIGKILL -> noticed by a 0.1 s polling loop (torchrun's monitor_interval)
  check      one find_dead_worker() with 8 / 256 live workers vs re-reading /proc/<pid>/stat each
  register   registering 1024 live workers, beside its floor in the same run (samples alternate):
             per worker a bare pidfd_open, one read of /proc/<pid>/stat and one epoll registration;
             wall time (the target's) and the registering thread's CPU time (steady under load)
  idle cpu   watcher CPU per second, 64 workers, wedge scan every 1 s
  growth     how the costs grow with the workers watched (8, 64, 256, 1024 local sleepers, the
             wedge scan on): detection latency (SIGKILL -> subscriber), check cost, the watcher's
             idle CPU and memory (Python heap traced by tracemalloc, descriptors). Sleepers have
             one thread each; a real rank has ten or more, and the wedge scan reads each thread.
             Then 4, 18 (NVL72) and 128 hosts of 4 ranks (scripts/_host_scale.py: the real agent
             code over sleeper ranks; 4 on real test hosts where this machine can make them, 18
             and 128 simulated in UTS namespaces; --no-hosts: null): a remote
             rank's SIGKILL -> the hub's event, the hub's check cost, idle CPU (minus the hub with
             no host, same run) and memory. --markdown prints the table as docs show it.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import random
import resource
import select
import signal
import statistics
import subprocess
import sys
import threading
import time
import tracemalloc
from collections.abc import Callable

import _bench
import _growth_table
import _host_scale
from _growth_table import GROWTH_HOSTS, GROWTH_RANKS

from trtllm_liveness import WorkerEvent
from trtllm_liveness.monitor import WorkerProcessMonitor
from trtllm_liveness.process import ProcessIdentity, _procfs, capture_identity

# Forks sleepers on request ("N\n" -> one line of N pids); SIGCHLD ignored so the kernel reaps
# them; each sleeper dies with the spawner (PR_SET_PDEATHSIG), so nothing outlives the benchmark.
SPAWNER = r"""
import ctypes, os, signal, sys
signal.signal(signal.SIGCHLD, signal.SIG_IGN)
libc = ctypes.CDLL(None, use_errno=True)
me = os.getpid()
for line in sys.stdin:
    pids = []
    for _ in range(int(line)):
        pid = os.fork()
        if pid == 0:
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
            if os.getppid() != me:
                os._exit(0)
            while True:
                signal.pause()
        pids.append(pid)
    sys.stdout.write(" ".join(map(str, pids)) + "\n")
    sys.stdout.flush()
"""


class Spawner:
    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", SPAWNER], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, start_new_session=True)

    def spawn(self, count: int) -> list[int]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{count}\n")
        self.proc.stdin.flush()
        return [int(p) for p in self.proc.stdout.readline().split()]

    def close(self) -> None:
        self.proc.kill()  # its sleepers follow through PR_SET_PDEATHSIG
        self.proc.wait(10)


def settle(pids: list[int], timeout: float = 30.0) -> None:
    """Wait until every sleeper sleeps in ``pause()``: freshly forked ones still run their first
    instructions, and on two cores a thousand of them compete with what is being measured."""
    deadline = time.monotonic() + timeout
    pending = list(pids)
    while pending and time.monotonic() < deadline:
        pending = [pid for pid in pending if _procfs.read_stat(pid).state != "S"]
        if pending:
            time.sleep(0.05)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def kill_and_time_floor(pid: int) -> float | None:
    """SIGKILL ``pid`` and time until a bare pidfd of it is readable (the kernel's own latency)."""
    fd = os.pidfd_open(pid)
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        t0 = time.perf_counter_ns()
        os.kill(pid, signal.SIGKILL)
        ready = poller.poll(5000)
        t1 = time.perf_counter_ns()
    finally:
        os.close(fd)
    return (t1 - t0) / 1000 if ready else None


def bench_floor_and_detect(floor_pids: list[int], detect_pids: list[int]) -> tuple[list[float], list[float]]:
    """Alternate one floor kill and one monitored kill, so both series see the same machine noise.

    On a shared 2-core VM a burst of host noise can add milliseconds to a few samples; measured
    in separate phases, that burst lands in one series only and the p99 ratio says nothing.
    """
    identities = [capture_identity(rank, pid) for rank, pid in enumerate(detect_pids)]
    seen: dict[int, int] = {}
    got = threading.Event()

    def on_event(event: WorkerEvent) -> None:
        seen[event.identity.pid] = time.perf_counter_ns()
        got.set()

    floor: list[float] = []
    detect: list[float] = []
    with WorkerProcessMonitor() as monitor:
        monitor.subscribe(on_event)
        monitor.register(identities)
        monitor.start()
        time.sleep(0.05)
        for floor_pid, pid in zip(floor_pids, detect_pids, strict=True):
            sample = kill_and_time_floor(floor_pid)
            if sample is not None:
                floor.append(sample)
            got.clear()
            t0 = time.perf_counter_ns()
            os.kill(pid, signal.SIGKILL)
            if got.wait(5) and pid in seen:
                detect.append((seen[pid] - t0) / 1000)
    return floor, detect


def bench_poll100ms(pids: list[int]) -> list[float]:
    """A torchrun-style loop: every 0.1 s, re-read each worker's stat (gone or zombie = dead)."""
    out = []
    phases = random.Random(1234)
    for pid in pids:
        start = _procfs.read_start_time(pid)
        # The kill lands at a random phase of the poller's cycle, as in production.
        phase = 0.1 * phases.random()
        t0 = time.perf_counter_ns()
        threading.Timer(phase, os.kill, (pid, signal.SIGKILL)).start()
        while True:
            try:
                info = _procfs.read_stat(pid)
                dead = info.start_time != start or info.state in ("Z", "X")
            except OSError:
                dead = True
            if dead:
                break
            time.sleep(0.1)
        t1 = time.perf_counter_ns()
        out.append((t1 - t0) / 1000 - phase * 1e6)
    return out


def time_call(func: object, repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        func()  # type: ignore[operator]
        samples.append((time.perf_counter_ns() - t0) / 1000)
    return statistics.median(samples)


def bench_check_cost(pids: list[int]) -> tuple[float, float]:
    identities = [capture_identity(rank, pid) for rank, pid in enumerate(pids)]
    with WorkerProcessMonitor() as monitor:
        monitor.register(identities)
        ours = time_call(monitor.find_dead_worker, 2000)

    def procfs_sweep() -> None:
        for ident in identities:
            info = _procfs.read_stat(ident.pid)
            if info.start_time != ident.start_time or info.state in ("Z", "X"):
                raise RuntimeError("worker died during the benchmark")

    return ours, time_call(procfs_sweep, 100 if len(pids) > 64 else 1000)


def register_floor(identities: list[ProcessIdentity]) -> tuple[float, float]:
    """The least a pidfd monitor does per worker, in ms for all (wall, this thread's CPU):
    pidfd_open, one read of the worker's stat (its start time verified) and one epoll registration."""
    epoll = select.epoll()
    fds: list[int] = []
    try:
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        for identity in identities:
            fd = os.pidfd_open(identity.pid)
            fds.append(fd)
            if _procfs.read_stat(identity.pid).start_time != identity.start_time:
                raise RuntimeError("a sleeper died during the benchmark")
            epoll.register(fd, select.EPOLLIN)
        return (time.perf_counter_ns() - t0) / 1e6, (time.thread_time_ns() - c0) / 1e6
    finally:
        for fd in fds:
            os.close(fd)
        epoll.close()


def bench_register(pids: list[int], rounds: int = 5) -> dict[str, float]:
    """Registering ``pids`` and its floor, round by round alternately (both see the same machine):
    medians in ms, wall and this thread's CPU, and of the per-round ratios. The CPU figures hardly
    move with the machine's load; the wall figures are the target's."""
    identities = [capture_identity(rank, pid) for rank, pid in enumerate(pids)]
    samples: dict[str, list[float]] = {key: [] for key in ("ms", "floor_ms", "cpu_ms", "floor_cpu_ms")}
    ratios: dict[str, list[float]] = {"wall": [], "cpu": []}
    for _ in range(rounds):
        floor_ms, floor_cpu = register_floor(identities)
        monitor = WorkerProcessMonitor()
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        monitor.register(identities)
        ours_ms, ours_cpu = (time.perf_counter_ns() - t0) / 1e6, (time.thread_time_ns() - c0) / 1e6
        assert all(s.method == "pidfd" for s in monitor.statuses()), "pidfd fallback during register bench"
        monitor.close()
        for key, value in (("ms", ours_ms), ("floor_ms", floor_ms), ("cpu_ms", ours_cpu), ("floor_cpu_ms", floor_cpu)):
            samples[key].append(value)
        ratios["wall"].append(ours_ms / floor_ms)
        ratios["cpu"].append(ours_cpu / floor_cpu)
    out = {key: statistics.median(values) for key, values in samples.items()}
    out["ratio"] = statistics.median(ratios["wall"])
    out["cpu_ratio"] = statistics.median(ratios["cpu"])
    return out


def bench_idle_cpu(pids: list[int], seconds: float) -> float:
    identities = [capture_identity(rank, pid) for rank, pid in enumerate(pids)]
    with WorkerProcessMonitor(d_state_timeout_s=30, scan_interval_s=1.0) as monitor:
        monitor.register(identities)
        monitor.start()
        time.sleep(0.2)
        thread = monitor._watcher._thread
        assert thread is not None and thread.native_id is not None
        c0, t0 = _bench.thread_cpu_ns("self", thread.native_id) or 0, time.monotonic()
        time.sleep(seconds)
        c1, t1 = _bench.thread_cpu_ns("self", thread.native_id) or 0, time.monotonic()
    return (c1 - c0) / 1e6 / (t1 - t0)


def _fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def bench_growth(spawner: Spawner, pool: list[int], kills: int, idle_seconds: float,
                 counts: tuple[int, ...] = GROWTH_RANKS) -> dict[str, float | int | None]:
    """The growth table: for each count of watched sleepers, one monitor as an engine runs it (wedge
    scan every 1 s), its memory after registering and a first scan, its check cost, its watcher's
    idle CPU, then ``kills`` deaths timed (each victim registered beside the others just before its
    SIGKILL, so the count watched stays the same)."""
    out: dict[str, float | int | None] = {}
    for count in counts:
        identities = [capture_identity(rank, pid) for rank, pid in enumerate(pool[:count])]
        victims = spawner.spawn(kills)
        settle(victims)
        fds_before = _fd_count()
        tracemalloc.start()
        traced_before = tracemalloc.get_traced_memory()[0]
        monitor = WorkerProcessMonitor(d_state_timeout_s=30, scan_interval_s=1.0)
        try:
            monitor.register(identities)
            monitor.start()
            # The first scan opens each sampler's stat file: wait for it (bounded) before counting.
            deadline = time.monotonic() + 30
            while _fd_count() < fds_before + 2 * count and time.monotonic() < deadline:
                time.sleep(0.01)
            out[f"growth_memory_kib_{count}"] = (tracemalloc.get_traced_memory()[0] - traced_before) / 1024
            tracemalloc.stop()
            out[f"growth_fds_{count}"] = _fd_count() - fds_before
            out[f"growth_check_us_{count}"] = time_call(monitor.find_dead_worker, 2000)
            thread = monitor._watcher._thread
            assert thread is not None and thread.native_id is not None
            c0, t0 = _bench.thread_cpu_ns("self", thread.native_id) or 0, time.monotonic()
            time.sleep(idle_seconds)
            c1, t1 = _bench.thread_cpu_ns("self", thread.native_id) or 0, time.monotonic()
            out[f"growth_idle_cpu_ms_per_s_{count}"] = (c1 - c0) / 1e6 / (t1 - t0)
            seen: dict[int, int] = {}
            got = threading.Event()

            def on_event(event: WorkerEvent, seen: dict[int, int] = seen, got: threading.Event = got) -> None:
                seen[event.identity.pid] = time.perf_counter_ns()
                got.set()

            monitor.subscribe(on_event)
            latencies = []
            for index, pid in enumerate(victims):
                monitor.register([capture_identity(count + index, pid)])
                got.clear()
                t_kill = time.perf_counter_ns()
                os.kill(pid, signal.SIGKILL)
                if got.wait(5) and pid in seen:
                    latencies.append((seen[pid] - t_kill) / 1000)
            out[f"growth_detect_p50_us_{count}"] = pct(latencies, 50) if latencies else None
            out[f"growth_detect_p99_us_{count}"] = pct(latencies, 99) if latencies else None
            out[f"growth_kills_{count}"] = len(latencies)
        finally:
            if tracemalloc.is_tracing():
                tracemalloc.stop()
            monitor.close()
    return out


def columns_of(allowed: tuple[int, ...]) -> Callable[[str], tuple[int, ...]]:
    """An argparse type: a comma-separated subset of the table's ``allowed`` columns."""
    def parse(text: str) -> tuple[int, ...]:
        chosen = tuple(int(item) for item in text.split(",") if item)
        if not set(chosen) <= set(allowed):
            raise argparse.ArgumentTypeError(f"{text!r}: each must be one of {allowed}")
        return chosen
    return parse


def host_columns(args: argparse.Namespace) -> dict[str, object]:
    """The growth table's host columns (scripts/_host_scale.py), null with the reason when
    ``--no-hosts`` or where this machine cannot make the rig's hosts."""
    reason = "--no-hosts" if args.no_hosts else _host_scale.unavailable()
    if reason is not None:
        return {**{f"growth_{metric}_hosts_{hosts}": None for metric in _host_scale.COLUMN_KEYS
                   for hosts in args.growth_hosts}, "host_scale_null_reason": reason, "host_scale_failed_starts": {}}
    logging.getLogger("trtllm_liveness").setLevel(logging.ERROR)
    window, settle = _host_scale.windows(args.quick, args.host_window)
    columns = _host_scale.host_columns(args.growth_hosts, kills=5 if args.quick else 20, window=window, settle=settle)
    return {**columns, "host_scale_null_reason": None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object after the table")
    parser.add_argument("--kills", type=int, default=250, help="kills per latency series (>= 200 for p99)")
    parser.add_argument("--idle-seconds", type=float, default=5.0)
    parser.add_argument("--no-gc-freeze", action="store_true", help="do not gc.freeze() setup objects first")
    parser.add_argument("--growth-kills", type=int, default=40, help="kills timed per column of the growth table")
    parser.add_argument("--no-growth", action="store_true", help="skip the growth table")
    parser.add_argument("--no-hosts", action="store_true", help="leave the growth table's host columns null")
    parser.add_argument("--quick", action="store_true",
                        help="fewer kills (50, 10 per growth column, 5 per host column), 2 s idle windows (5 s hosts)")
    parser.add_argument("--host-window", type=_host_scale.window_seconds, default=None, metavar="S",
                        help="the host columns' CPU windows, s (default 20, 5 with --quick)")
    parser.add_argument("--markdown", action="store_true", help="also print the growth table in Markdown")
    parser.add_argument("--growth-ranks", type=columns_of(GROWTH_RANKS), default=GROWTH_RANKS,
                        help=f"the ranks columns measured, comma-separated, of {GROWTH_RANKS} (default all)")
    parser.add_argument("--growth-hosts", type=columns_of(GROWTH_HOSTS), default=GROWTH_HOSTS,
                        help=f"the hosts columns measured, comma-separated, of {GROWTH_HOSTS} (default all)")
    args = parser.parse_args()
    if args.quick:
        args.kills, args.growth_kills, args.idle_seconds = 50, 10, 2.0
    logging.getLogger("trtllm_liveness").setLevel(logging.ERROR)  # 1 warning per kill otherwise
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))
    started = time.monotonic()
    spawner = Spawner()
    try:
        pool = spawner.spawn(1024)
        settle(pool)
        register = bench_register(pool)
        cost8, procfs8 = bench_check_cost(pool[:8])
        cost256, procfs256 = bench_check_cost(pool[:256])
        idle = bench_idle_cpu(pool[:64], args.idle_seconds)
        floor_pids, detect_pids = spawner.spawn(args.kills), spawner.spawn(args.kills)
        if not args.no_gc_freeze:
            # Move the benchmark's own setup objects out of the cyclic collector's sight, as a
            # long-running server does after start-up: a full collection then scans only what the
            # measured path allocates, not thousands of benchmark objects (--no-gc-freeze to compare).
            gc.collect()
            gc.freeze()
        floor, detect = bench_floor_and_detect(floor_pids, detect_pids)
        poll = bench_poll100ms(spawner.spawn(20))
        growth = {} if args.no_growth else bench_growth(spawner, pool, args.growth_kills, args.idle_seconds,
                                                        args.growth_ranks)
    finally:
        spawner.close()
    if growth:
        growth.update(host_columns(args))
    r: dict[str, float | int | None] = {
        "floor_p50_us": pct(floor, 50), "floor_p99_us": pct(floor, 99),
        "detect_p50_us": pct(detect, 50), "detect_p99_us": pct(detect, 99),
        "poll100ms_p50_us": pct(poll, 50),
        "check_cost_8_us": cost8, "check_cost_256_us": cost256,
        "procfs_check_cost_8_us": procfs8, "procfs_check_cost_256_us": procfs256,
        "register_1024_ms": register["ms"], "register_floor_1024_ms": register["floor_ms"],
        "register_ratio_to_floor": register["ratio"], "register_1024_cpu_ms": register["cpu_ms"],
        "register_floor_1024_cpu_ms": register["floor_cpu_ms"], "register_cpu_ratio_to_floor": register["cpu_ratio"],
        "idle_cpu_ms_per_s": idle,
        "kills": len(detect), "floor_kills": len(floor), **growth, "wall_s": time.monotonic() - started,
    }
    rows = [
        ("SIGKILL -> pidfd readable (floor)", "p50/p99 us", f"{r['floor_p50_us']:.0f} / {r['floor_p99_us']:.0f}"),
        ("SIGKILL -> subscriber (monitor)", "p50/p99 us", f"{r['detect_p50_us']:.0f} / {r['detect_p99_us']:.0f}"),
        ("SIGKILL -> 0.1 s poll (baseline)", "p50 us", f"{r['poll100ms_p50_us']:.0f}"),
        ("find_dead_worker, 8 / 256 workers", "us", f"{cost8:.1f} / {cost256:.1f}"),
        ("procfs re-read, 8 / 256 (baseline)", "us", f"{procfs8:.1f} / {procfs256:.1f}"),
        ("register 1024 workers, wall / CPU", "ms", f"{register['ms']:.1f} / {register['cpu_ms']:.1f}"),
        ("  floor: pidfd_open + stat + epoll each", "ms",
         f"{register['floor_ms']:.1f} / {register['floor_cpu_ms']:.1f} "
         f"(ratios {register['ratio']:.2f} / {register['cpu_ratio']:.2f})"),
        ("watcher idle CPU, 64 workers, 1 s scan", "ms/s", f"{idle:.3f}"),
    ]
    print(f"{'measure':42} {'unit':12} value")
    for name, unit, value in rows:
        print(f"{name:42} {unit:12} {value}")
    if growth:
        _growth_table.print_text(growth)
        if args.markdown:
            print(_growth_table.markdown(growth, " ".join([".venv/bin/python", "scripts/bench_detection.py",
                                                            *sys.argv[1:]])))
    targets = [
        ("detect_p99 <= 5 x floor_p99", r["detect_p99_us"] <= 5 * r["floor_p99_us"]),
        ("detect_p99 <= 2000 us", r["detect_p99_us"] <= 2000),
        ("check_cost_256 >= 100x below procfs", r["check_cost_256_us"] * 100 <= r["procfs_check_cost_256_us"]),
        ("register_1024 <= 50 ms", register["ms"] <= 50),
        ("idle_cpu <= 1 ms/s", r["idle_cpu_ms_per_s"] <= 1),
        (f"kills >= 200 ({len(detect)}, floor {len(floor)})", min(len(detect), len(floor)) >= 200),
    ]
    if growth and not args.no_hosts:
        failed, reason = growth.get("host_scale_failed_starts"), growth.get("host_scale_null_reason")
        targets.append((f"every host column measured (failed starts: {failed})" + (f" ({reason})" if reason else ""),
                        not failed and not reason))
    return _bench.finish(targets, r, as_json=args.json, wall_s=r["wall_s"])


if __name__ == "__main__":
    sys.exit(main())
