#!/usr/bin/env python3
"""Benchmark: what the extension costs a serving engine (throughput, latency, ticks, idle CPU, memory).

The engine is the upstream-shaped fake ``tensorrt_llm`` (``tests/fakes/trtllm_main``: main's proxy,
queues and ``HangDetector``), built through upstream's own API, ``LLM(FakeEngine(...),
tensor_parallel_size=N)``, with ``executor_cls=liveness_executor_class()`` when the extension is on.
Each run is a child process of its own (its proxy, its MPI-spawned ranks, its own session, killed
whole at the end); "off" and "on" runs alternate, pair by pair and configuration by configuration,
in one invocation (the order within a pair alternates too), so both see the same machine.

Configurations: 2 and 8 ranks, each with streaming (one response per token) and non-streaming (one
response per request) requests; tiny requests (a 3-token prompt, ``--tokens`` tokens, default 4) on
an engine without a model (``token_delay_s=0``: the engine's step is the fake's bookkeeping and its
MPI broadcast, so the extension's share is as large as it gets), ``--window`` requests in flight.

"On" is every feature: the death watcher with the wedge scan (``d_state_timeout_s=30``, 1 s scan),
the stall timer fed by output and by the ranks' executor iterations (``stall_timeout_s=5``: every
rank's ``HangDetector.checkpoint()`` counted and reported), metrics (``LivenessMetrics`` on the
engine's monitor, prometheus_client in multiprocess mode, as trtllm-serve's ``/prometheus/metrics``
runs it: its refresh thread included), the proxy-death watch in every rank, and the multi-host
agent hub (``hosts=on``, bound to 127.0.0.1). On one host no agent runs: the proxy's own host is
watched through pidfds and agents run only on the other hosts, so their cost is
``bench_multihost.py``'s, not this benchmark's.

Figures, per configuration, each the median over the off/on pairs (spread: min..max over pairs):

- ``throughput_ratio``: requests/s on / off (``--requests`` per run, after ``--warmup`` untimed);
- ``proxy_cpu_per_request_ratio``: the proxy process's whole CPU time per timed request, on / off
  (``stat``'s ticks: every thread, upstream's and ZMQ's included);
- ``added_latency_p50_us`` / ``added_latency_p99_us``: p50(on) - p50(off), p99(on) - p99(off) of
  each request's submit -> final response (the proxy's result thread handing it over);
- ``tick_ns``: what the extension adds to one executor iteration: the median time of the
  ``HangDetector.checkpoint()`` call, timed in the leader rank's own loop (the extension's iteration
  reporter wraps it when on), on minus off; ``tick_mean_ns`` the same with means (they include the
  iterations on which the loop thread lost the GIL to another thread inside the call);
- ``proxy_cpu_ms_per_s_idle`` / ``rank_cpu_ms_per_s_idle`` (the worst rank): CPU of the extension's
  threads only over ``--idle-s`` seconds of an idle engine, in each "on" run (7 x 12 s = 84 s per
  configuration by default). Per thread from ``/proc/<pid>/task/<tid>/schedstat`` (ns; ``stat``'s
  ticks where absent). Which threads: in the proxy, the Python threads named ``*liveness*`` plus
  the ZMQ background threads of the sockets the extension's code created; in a rank, every thread
  that appeared between the task's arrival and the fake's ``worker_main`` (the extension's rank
  entry starts them all there; names in the JSON);
- ``threads_added_proxy`` / ``threads_added_rank``, ``rss_added_kib_proxy`` / ``rss_added_kib_rank``:
  thread count and VmRSS on minus off, at the same point (idle, after the requests);
- ``proxy_cpu_us_per_request_off``, ``batches_per_request_off`` / ``_on`` (per configuration): the
  proxy's whole CPU per request without the extension, and the response batches its result thread
  received per request (what the per-request figures scale with);
- ``extension_switches_per_request``: the context switches of the extension's proxy threads (the
  same threads, alive at the end of the run) while the timed requests were served, per request
  (``status``'s ``voluntary_ctxt_switches + nonvoluntary_ctxt_switches``; by thread in
  ``extension_switches_per_request_by_thread``). A thread the request path wakes costs the proxy a
  switch of threads (and likely a hand-over of the GIL) per wake-up, far more than its own few
  instructions, and no CPU figure of this machine resolves that. The figure includes the periodic
  wake-ups (the watcher's scan, the progress beats, metrics, the stall timer's probe), which come
  by the second, not by the request: their share grows as requests/s falls;
- ``added_proxy_cpu_us_per_request`` / ``added_leader_cpu_us_per_request`` (no target): the CPU the
  proxy process / the leader rank spent per timed request (``stat``'s ticks), on minus off: less
  sensitive to a loaded machine than the wall-clock figures; per configuration also by proxy
  thread (``added_proxy_cpu_us_per_request_by_thread``: the submitting thread, upstream's result
  thread, ZMQ's, the extension's). (The other ranks are left out: Open
  MPI's blocking broadcast spins in them while they wait for the leader's next step.)

The JSON's top-level figures are the worst over the configurations; ``configs`` holds each one's.
Targets: throughput_ratio >= 0.99, proxy_cpu_per_request_ratio <= 1.05, added_latency_p99_us <= 50,
tick_ns <= 1000, idle CPU <= 1 ms/s (proxy) and <= 0.2 ms/s (rank), extension_switches_per_request
<= 0.05 (one context switch of an extension thread per 20 requests at most).

``--control``: each pair gets a third run, the extension off again (the three runs' order goes
through all six, :data:`CONTROL_ORDERS`), and each configuration the same figures for that off/off
pair (``control``: ``throughput_ratio``, ``proxy_cpu_per_request_ratio``,
``added_proxy_cpu_us_per_request``, median and spread): what this machine's noise alone reads, to set
beside the off/on figures (a target missed by less than the control's distance from 1 is not resolved
by the run).

Usage: scripts/bench_overhead.py [--quick] [--json] [--control] [--pairs N] [--requests N] [--idle-s S]
``--quick``: one pair per configuration, 200 requests, 0.5 s idle (a smoke test, about a minute).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import itertools
import json
import os
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _bench

from trtllm_liveness.process import _procfs

REPO = Path(__file__).resolve().parents[1]
FAKE_TREE = REPO / "tests" / "fakes" / "trtllm_main"
ON_SETTINGS = ("d_state_timeout_s=30,scan_interval_s=1,stall_timeout_s=5,stall_action=report,"
               "hosts=on,hosts_bind=127.0.0.1")
HUB_NOTE = ("hub on (hosts=on, 127.0.0.1); no host agent on one host (the proxy's host is watched by "
            "pidfds): agents' cost is bench_multihost.py's")
FIGURES = ("throughput_ratio", "proxy_cpu_per_request_ratio", "added_latency_p50_us", "added_latency_p99_us",
           "tick_ns", "tick_mean_ns",
           "proxy_cpu_ms_per_s_idle", "rank_cpu_ms_per_s_idle", "threads_added_proxy", "threads_added_rank",
           "rss_added_kib_proxy", "rss_added_kib_rank", "extension_switches_per_request",
           "added_proxy_cpu_us_per_request", "added_leader_cpu_us_per_request")
CONTROL_FIGURES = ("throughput_ratio", "proxy_cpu_per_request_ratio", "added_proxy_cpu_us_per_request")
WORST_IS_LOWEST = ("throughput_ratio",)
TARGETS = (("throughput_ratio", ">=", 0.99), ("proxy_cpu_per_request_ratio", "<=", 1.05),
           ("added_latency_p99_us", "<=", 50.0), ("tick_ns", "<=", 1000.0),
           ("proxy_cpu_ms_per_s_idle", "<=", 1.0), ("rank_cpu_ms_per_s_idle", "<=", 0.2),
           ("extension_switches_per_request", "<=", 0.05))


# ----------------------------------------------------------------------------- the child: one run


class _Tee(queue.Queue):  # type: ignore[type-arg]
    """A result's queue that hands each response, stamped, to the load driver instead."""

    completions: queue.SimpleQueue[tuple[int, Any, int]] = queue.SimpleQueue()

    def __init__(self, request_id: int) -> None:
        super().__init__()
        self.request_id = request_id

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        _Tee.completions.put((self.request_id, item, time.perf_counter_ns()))


def _extension_zmq_threads() -> set[int]:
    """Thread ids of the ZMQ background threads that the extension's sockets started (filled as
    sockets are made: libzmq starts a context's threads with its first socket)."""
    import zmq

    import trtllm_liveness

    ours: set[int] = set()
    package = os.path.dirname(trtllm_liveness.__file__)
    zmq_dir = os.path.dirname(zmq.__file__)
    original = zmq.Context.socket

    def socket(self: Any, *args: Any, **kwargs: Any) -> Any:
        before = _bench.task_tids()
        sock = original(self, *args, **kwargs)
        new = _bench.task_tids() - before
        frame = sys._getframe(1)
        while frame is not None and frame.f_code.co_filename.startswith(zmq_dir):
            frame = frame.f_back  # type: ignore[assignment]
        if new and frame is not None and frame.f_code.co_filename.startswith(package):
            ours.update(new)  # named by the threads themselves, maybe not yet: checked when measured
        return sock

    zmq.Context.socket = socket  # type: ignore[method-assign]
    return ours


def _drive(proxy: Any, count: int, window: int, tokens: int, streaming: bool) -> tuple[float, list[float]]:
    """``count`` requests, ``window`` in flight; (requests/s, each one's submit -> final in us)."""
    starts: dict[int, int] = {}
    latencies: list[float] = []

    def submit() -> None:
        t0 = time.perf_counter_ns()
        result = proxy.generate_async([1, 2, 3], max_tokens=tokens, streaming=streaming)
        starts[result.request_id] = t0

    begin = time.perf_counter_ns()
    sent = 0
    while sent < min(window, count):
        submit()
        sent += 1
    end = begin
    while len(latencies) < count:
        request_id, item, at = _Tee.completions.get(timeout=60)
        if not getattr(item, "is_final", False):
            if not hasattr(item, "is_final"):
                raise RuntimeError(f"request {request_id} failed: {item!r}")
            continue
        latencies.append((at - starts.pop(request_id)) / 1000)
        end = at
        if sent < count:
            submit()
            sent += 1
    return count / ((end - begin) / 1e9), latencies


def _wait_for(paths: list[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not all(os.path.exists(path) for path in paths):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the ranks did not write {[p for p in paths if not os.path.exists(p)]}")
        time.sleep(0.05)


def _read_json(path: str) -> dict[str, Any]:
    with open(path) as handle:
        return dict(json.load(handle))


def child(opts: dict[str, Any]) -> dict[str, Any]:
    from trtllm_liveness.demo._mpi_env import configure_mpi_env

    configure_mpi_env()
    on = bool(opts["on"])
    zmq_threads = _extension_zmq_threads() if on else set()
    # The fake on PYTHONPATH, first: importing it puts tests/fakes (the fakes' common code) on sys.path.
    llm_cls = importlib.import_module("tensorrt_llm").LLM
    import _overhead_rank
    import _trtllm_fake_common as fake

    original_init = fake.GenerationResultBase.__init__

    def init(self: Any, generation_request: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, generation_request, *args, **kwargs)
        self.queue = _Tee(self.request_id)

    fake.GenerationResultBase.__init__ = init
    # Upstream's dispatch, counted: how many response batches the result thread received (the
    # per-request CPU of that thread follows how the leader batches its responses).
    proxy_cls = importlib.import_module("tensorrt_llm.executor.proxy").GenerationExecutorProxy
    original_dispatch = proxy_cls.dispatch_result_task
    batches = [0]

    def dispatch(self: Any) -> Any:
        batches[0] += 1
        return original_dispatch(self)

    proxy_cls.dispatch_result_task = dispatch
    probe_dir = tempfile.mkdtemp(prefix="bench-overhead-")
    try:
        engine = _overhead_rank.ProbedEngine(token_delay_s=float(opts["token_delay_s"]), probe_dir=probe_dir)
        kwargs: dict[str, Any] = {"tensor_parallel_size": int(opts["ranks"])}
        if on:
            from trtllm_liveness.integrations.trtllm import liveness_executor_class

            kwargs["executor_cls"] = liveness_executor_class()
        llm = llm_cls(engine, **kwargs)
        proxy = llm._executor
        metrics = None
        if on:
            from trtllm_liveness.integrations.prometheus import LivenessMetrics

            metrics = LivenessMetrics(proxy.liveness_monitor)
        ranks = [os.path.join(probe_dir, f"rank{rank}.json") for rank in range(int(opts["ranks"]))]
        _wait_for(ranks, 60)
        window, tokens, streaming = int(opts["window"]), int(opts["tokens"]), bool(opts["streaming"])
        _drive(proxy, int(opts["warmup"]), window, tokens, streaming)
        leader = _read_json(ranks[0])["pid"]
        cpu0, leader0 = _process_cpu_s(os.getpid()), _process_cpu_s(leader)
        threads0, batches0, switches0 = _threads_cpu_ns(), batches[0], _thread_switches()
        rps, latencies = _drive(proxy, int(opts["requests"]), window, tokens, streaming)
        threads1, batches1, switches1 = _threads_cpu_ns(), batches[0], _thread_switches()
        cpu1, leader1 = _process_cpu_s(os.getpid()), _process_cpu_s(leader)
        time.sleep(1.0)  # the last responses' bookkeeping done: idle from here
        rank_info = [_read_json(path) for path in ranks]
        names = {thread.native_id: thread.name for thread in threading.enumerate() if thread.native_id is not None}
        ext_proxy = [tid for tid, name in names.items() if "liveness" in name]
        ext_proxy += sorted(tid for tid in zmq_threads if _bench.thread_name("self", tid).startswith("ZMQbg"))
        switched: dict[str, float] = {}
        for tid in ext_proxy:
            label = names.get(tid) or _bench.thread_name("self", tid)
            ran = switches1.get(tid, 0) - switches0.get(tid, 0)
            switched[label] = switched.get(label, 0.0) + ran / len(latencies)
        record: dict[str, Any] = {
            "rps": rps, "p50_us": _bench.percentile(latencies, 0.5), "p99_us": _bench.percentile(latencies, 0.99),
            "requests": len(latencies), "batches_per_request": (batches1 - batches0) / len(latencies),
            "proxy_cpu_us_per_request": (cpu1 - cpu0) * 1e6 / len(latencies),
            "leader_cpu_us_per_request": (leader1 - leader0) * 1e6 / len(latencies),
            "proxy_cpu_us_per_request_by_thread": _per_request_by_name(threads0, threads1, len(latencies)),
            "ext_switches_per_request": sum(switched.values()),
            "ext_switches_per_request_by_thread": {name: round(value, 4) for name, value in sorted(switched.items())},
            "threads_proxy": len(_bench.task_tids()), "rss_kib_proxy": _bench.rss_kib("self"),
            "threads_rank": [len(_bench.task_tids(info["pid"])) for info in rank_info],
            "rss_kib_rank": [_bench.rss_kib(info["pid"]) for info in rank_info],
            "ext_threads_proxy": sorted(names.get(tid) or _bench.thread_name("self", tid) for tid in ext_proxy),
            "ext_threads_rank": [sorted(_rank_thread_label(info["pid"], t) for t in info["added_threads"])
                                 for info in rank_info],
        }
        if on and float(opts["idle_s"]) > 0:
            labels = {tid: names.get(tid) or _bench.thread_name("self", tid) for tid in ext_proxy}
            record.update(_idle_cpu(labels, rank_info, float(opts["idle_s"])))
        if metrics is not None:
            metrics.close()
        llm.shutdown()
        ticks = os.path.join(probe_dir, "ticks.json")
        _wait_for([ticks], 30)
        record["tick"] = _read_json(ticks)
        return record
    finally:
        shutil.rmtree(probe_dir, ignore_errors=True)


def _threads_cpu_ns() -> dict[int, tuple[str, int]]:
    """Every thread of this process: (its name, its CPU ns so far)."""
    names = {thread.native_id: thread.name for thread in threading.enumerate() if thread.native_id is not None}
    out = {}
    for tid in _bench.task_tids():
        cpu = _bench.thread_cpu_ns("self", tid)
        if cpu is not None:
            out[tid] = (names.get(tid) or _bench.thread_name("self", tid), cpu)
    return out


def _thread_switches() -> dict[int, int]:
    """Every thread of this process: its context switches so far (a thread that is gone: absent)."""
    out = {}
    for tid in _bench.task_tids():
        with contextlib.suppress(OSError, ValueError):
            switches = _procfs.read_status("self", tid).context_switches
            if switches is not None:
                out[tid] = switches
    return out


def _per_request_by_name(before: dict[int, tuple[str, int]], after: dict[int, tuple[str, int]],
                         requests: int) -> dict[str, float]:
    """CPU us per request of each thread name between two :func:`_threads_cpu_ns` snapshots."""
    out: dict[str, float] = {}
    for tid, (name, cpu) in after.items():
        out[name] = out.get(name, 0.0) + (cpu - before.get(tid, (name, 0))[1]) / 1000 / requests
    return {name: round(value, 2) for name, value in sorted(out.items())}


def _process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a whole process (``stat``'s ticks)."""
    return _procfs.read_stat(pid).cpu_ticks / os.sysconf("SC_CLK_TCK")


def _rank_thread_label(pid: int, thread: dict[str, Any]) -> str:
    """A rank thread's name: Python's, else the kernel's now (a native thread names itself after it
    starts, so the name read at ``worker_main``'s entry may still be the process's)."""
    name = str(thread["name"])
    return name if "liveness" in name else (_bench.thread_name(pid, thread["tid"]) or name)


def _idle_cpu(ext_proxy: dict[int, str], rank_info: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    """The extension's threads' CPU over ``seconds`` of an idle engine (ms per s): the proxy's (and
    by thread name), each rank's."""
    threads = [(os.getpid(), tid) for tid in ext_proxy]
    threads += [(info["pid"], t["tid"]) for info in rank_info for t in info["added_threads"]]
    before = {key: _bench.thread_cpu_ns(*key) for key in threads}
    t0 = time.monotonic()
    time.sleep(seconds)
    after = {key: _bench.thread_cpu_ns(*key) for key in threads}
    elapsed = time.monotonic() - t0

    def rate(pid: int, tids: list[int]) -> float:
        return sum(max(0, (after[(pid, t)] or 0) - (before[(pid, t)] or 0)) for t in tids) / 1e6 / elapsed

    by_name: dict[str, float] = {}
    for tid, name in ext_proxy.items():
        by_name[name] = by_name.get(name, 0.0) + rate(os.getpid(), [tid])
    return {"idle_s": elapsed, "proxy_cpu_ms_per_s_idle": rate(os.getpid(), list(ext_proxy)),
            "proxy_cpu_ms_per_s_idle_by_thread": by_name,
            "rank_cpu_ms_per_s_idle": [rate(info["pid"], [t["tid"] for t in info["added_threads"]])
                                       for info in rank_info]}


# ----------------------------------------------------------------------------- the parent


@dataclass(frozen=True)
class Config:
    ranks: int
    streaming: bool

    @property
    def name(self) -> str:
        return f"ranks{self.ranks}_{'streaming' if self.streaming else 'final'}"


def run_child(opts: dict[str, Any], timeout: float) -> dict[str, Any]:
    """One run in a child process of its own session; whatever it leaves in that session is killed."""
    from trtllm_liveness.demo._scenario_launcher import kill_session, session_members
    from trtllm_liveness.quarantine._marker import QUARANTINE_DIR_VAR

    scratch = tempfile.mkdtemp(prefix="bench-overhead-run-")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(FAKE_TREE), str(REPO)]),
           QUARANTINE_DIR_VAR: os.path.join(scratch, "quarantine")}
    env.pop("TRTLLM_WORKER_LIVENESS", None)
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    if opts["on"]:
        env["TRTLLM_WORKER_LIVENESS"] = ON_SETTINGS
        env["PROMETHEUS_MULTIPROC_DIR"] = os.path.join(scratch, "prometheus")
        os.makedirs(env["PROMETHEUS_MULTIPROC_DIR"])
    child_proc = subprocess.Popen([sys.executable, __file__, "--child", json.dumps(opts)], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, start_new_session=True, env=env)
    try:
        stdout, stderr = child_proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_session(child_proc.pid)
        stdout, stderr = child_proc.communicate(timeout=10)
        stderr += b"\n[run timed out]"
    except BaseException:
        kill_session(child_proc.pid)
        raise
    finally:
        deadline = time.monotonic() + 3  # prte and the ranks outlive the proxy a moment
        while session_members(child_proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        survivors = kill_session(child_proc.pid)
        shutil.rmtree(scratch, ignore_errors=True)
    lines = [line for line in stdout.decode(errors="replace").splitlines() if line.startswith("{")]
    if child_proc.returncode != 0 or not lines:
        raise RuntimeError(f"run {opts} failed (status {child_proc.returncode}):\n"
                           f"{stderr.decode(errors='replace')[-3000:]}")
    record = dict(json.loads(lines[-1]))
    record["survivors"] = len(survivors)
    return record


CONTROL_ORDERS = tuple(itertools.permutations(("off", "on", "control")))
"""With ``--control``, pair ``i`` runs in order ``i`` modulo 6: over each six pairs each run takes each
place twice and "off" precedes "on" in three, so a drift over a pair's runs (the machine warming,
another tenant) weighs on the control no more than on the off/on pair."""


def run_order(index: int, control: bool) -> tuple[str, ...]:
    """The runs of pair ``index`` in the order they run: off and on alternating which comes first,
    or with ``control`` one of :data:`CONTROL_ORDERS`."""
    if control:
        return CONTROL_ORDERS[index % len(CONTROL_ORDERS)]
    return ("off", "on") if index % 2 == 0 else ("on", "off")


def pair_figures(off: dict[str, Any], on: dict[str, Any]) -> dict[str, float | None]:
    """One off/on pair's figures."""
    def diff(key: str) -> float:
        return float(on[key]) - float(off[key])

    def worst_rank_diff(key: str) -> float:
        return float(max(a - b for a, b in zip(on[key], off[key], strict=True)))

    def tick(key: str) -> float | None:
        a, b = on["tick"].get(key), off["tick"].get(key)
        return None if a is None or b is None else float(a) - float(b)

    return {
        "throughput_ratio": on["rps"] / off["rps"],
        "proxy_cpu_per_request_ratio": float(on["proxy_cpu_us_per_request"]) / float(off["proxy_cpu_us_per_request"]),
        "added_proxy_cpu_us_per_request": diff("proxy_cpu_us_per_request"),
        "added_leader_cpu_us_per_request": diff("leader_cpu_us_per_request"),
        "added_latency_p50_us": diff("p50_us"), "added_latency_p99_us": diff("p99_us"),
        "tick_ns": tick("p50_ns"), "tick_mean_ns": tick("mean_ns"),
        "proxy_cpu_ms_per_s_idle": on.get("proxy_cpu_ms_per_s_idle"),
        "extension_switches_per_request": on["ext_switches_per_request"],
        "rank_cpu_ms_per_s_idle": max(on["rank_cpu_ms_per_s_idle"]) if on.get("rank_cpu_ms_per_s_idle") else None,
        "threads_added_proxy": diff("threads_proxy"), "threads_added_rank": worst_rank_diff("threads_rank"),
        "rss_added_kib_proxy": diff("rss_kib_proxy"), "rss_added_kib_rank": worst_rank_diff("rss_kib_rank"),
    }


def summarize(pairs: list[dict[str, float | None]], figures: tuple[str, ...] = FIGURES) -> dict[str, Any]:
    """Median per figure over the pairs, with its spread (min, max)."""
    out: dict[str, Any] = {}
    for key in figures:
        values = [float(v) for pair in pairs if (v := pair[key]) is not None]
        out[key] = statistics.median(values) if values else None
        out[f"{key}_spread"] = [round(min(values), 3), round(max(values), 3)] if values else None
    return out


def added_by_thread(off: dict[str, float], on: dict[str, float]) -> dict[str, float]:
    """Per thread name, on minus off (a name absent off counts 0 there: the extension's threads)."""
    return {name: on.get(name, 0.0) - off.get(name, 0.0) for name in sorted(set(on) | set(off))}


def median_by_key(samples: list[dict[str, float]]) -> dict[str, float]:
    keys = sorted({key for sample in samples for key in sample})
    return {key: round(statistics.median(s[key] for s in samples if key in s), 4) for key in keys}


def worst(configs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in FIGURES:
        values = [(c[key], name) for name, c in configs.items() if c[key] is not None]
        if not values:
            out[key], out[f"{key}_config"] = None, None
            continue
        value, name = min(values) if key in WORST_IS_LOWEST else max(values)
        out[key], out[f"{key}_config"] = value, name
    return out


def _rounded(figures: dict[str, Any]) -> dict[str, Any]:
    """Floats to 3 digits, the control's too; the per-thread tables keep their own 4."""
    return {k: round(v, 3) if isinstance(v, float) else _rounded(v) if k == "control" else v
            for k, v in figures.items()}


def check(op: str, value: float | None, bound: float) -> bool:
    return value is not None and (value >= bound if op == ">=" else value <= bound)


def fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    parser.add_argument("--quick", action="store_true", help="one pair, small counts: a smoke test (about a minute)")
    parser.add_argument("--pairs", type=int, default=None, help="off/on pairs per configuration (default 7)")
    parser.add_argument("--requests", type=int, default=None, help="timed requests per run (default 10000)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed requests first (default 500)")
    parser.add_argument("--idle-s", type=float, default=None, help="idle window per 'on' run (default 12)")
    parser.add_argument("--window", type=int, default=8, help="requests in flight (default 8)")
    parser.add_argument("--tokens", type=int, default=4, help="tokens per request (default 4)")
    parser.add_argument("--token-delay-s", type=float, default=0.0, help="the fake engine's step time (default 0)")
    parser.add_argument("--ranks", default="2,8", help="rank counts (default 2,8)")
    parser.add_argument("--control", action="store_true",
                        help="a third run per pair, off again: the off/off figures beside the off/on ones")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    pairs = args.pairs if args.pairs is not None else (1 if args.quick else 7)
    requests = args.requests if args.requests is not None else (200 if args.quick else 10_000)
    warmup = args.warmup if args.warmup is not None else (20 if args.quick else 500)
    idle_s = args.idle_s if args.idle_s is not None else (0.5 if args.quick else 12.0)
    configs = [Config(int(ranks), streaming) for ranks in args.ranks.split(",") for streaming in (False, True)]
    started = time.monotonic()
    runs: dict[str, list[dict[str, float | None]]] = {c.name: [] for c in configs}
    controls: dict[str, list[dict[str, float | None]]] = {c.name: [] for c in configs}
    threads: dict[str, dict[str, Any]] = {}
    by_thread: dict[str, list[dict[str, float]]] = {c.name: [] for c in configs}
    switches: dict[str, list[dict[str, float]]] = {c.name: [] for c in configs}
    request_cpu: dict[str, list[dict[str, float]]] = {c.name: [] for c in configs}
    baseline: dict[str, list[dict[str, float]]] = {c.name: [] for c in configs}
    survivors = 0
    for index in range(pairs):
        for config in configs:
            record: dict[str, dict[str, Any]] = {}
            for run in run_order(index, args.control):
                opts = {"on": run == "on", "ranks": config.ranks, "streaming": config.streaming,
                        "requests": requests, "warmup": warmup, "window": args.window, "tokens": args.tokens,
                        "token_delay_s": args.token_delay_s, "idle_s": idle_s}
                record[run] = run_child(opts, timeout=300 + idle_s)
                survivors += record[run]["survivors"]
            runs[config.name].append(pair_figures(record["off"], record["on"]))
            if args.control:
                controls[config.name].append(pair_figures(record["off"], record["control"]))
            by_thread[config.name].append(record["on"].get("proxy_cpu_ms_per_s_idle_by_thread", {}))
            switches[config.name].append(record["on"]["ext_switches_per_request_by_thread"])
            request_cpu[config.name].append(added_by_thread(record["off"]["proxy_cpu_us_per_request_by_thread"],
                                                            record["on"]["proxy_cpu_us_per_request_by_thread"]))
            baseline[config.name].append({
                "proxy_cpu_us_per_request_off": record["off"]["proxy_cpu_us_per_request"],
                "batches_per_request_off": record["off"]["batches_per_request"],
                "batches_per_request_on": record["on"]["batches_per_request"]})
            threads.setdefault(config.name, {
                "proxy": record["on"]["ext_threads_proxy"],
                # the distinct lists over the ranks (the same list on every rank, normally)
                "rank": sorted({tuple(names) for names in record["on"]["ext_threads_rank"]}),
                "rank_off": sorted({tuple(names) for names in record["off"]["ext_threads_rank"]})})
            print(f"pair {index + 1}/{pairs} {config.name}: {json.dumps(runs[config.name][-1])}", file=sys.stderr)
            if args.control:
                control = {key: controls[config.name][-1][key] for key in CONTROL_FIGURES}
                print(f"control {index + 1}/{pairs} {config.name}: {json.dumps(control)}", file=sys.stderr)
    per_config = {c.name: {**summarize(runs[c.name]), "extension_threads": threads[c.name],
                           "proxy_cpu_ms_per_s_idle_by_thread": median_by_key(by_thread[c.name]),
                           "extension_switches_per_request_by_thread": median_by_key(switches[c.name]),
                           "added_proxy_cpu_us_per_request_by_thread": median_by_key(request_cpu[c.name]),
                           **median_by_key(baseline[c.name]),
                           **({"control": summarize(controls[c.name], CONTROL_FIGURES)} if args.control else {})}
                  for c in configs}
    top = worst(per_config)
    result: dict[str, Any] = {
        **top, "pairs": pairs, "requests_per_run": requests, "warmup_per_run": warmup, "window": args.window,
        "tokens": args.tokens, "idle_s_per_run": idle_s, "survivors": survivors, "hub": HUB_NOTE,
        "configs": {name: _rounded(c) for name, c in per_config.items()},
        "wall_s": time.monotonic() - started,
    }
    names = [c.name for c in configs]
    print(f"{'figure (median over pairs; [min..max])':26} " + " ".join(f"{n:>26}" for n in names) + f" {'worst':>10}")
    for key in FIGURES:
        cells = []
        for name in names:
            c = per_config[name]
            spread = c[f"{key}_spread"]
            cells.append(f"{fmt(c[key])} [{fmt(spread[0])}..{fmt(spread[1])}]" if spread else "-")
        print(f"{key:26} " + " ".join(f"{cell:>26}" for cell in cells) + f" {fmt(top[key]):>10}")
    if args.control:
        for key in CONTROL_FIGURES:
            cells = [f"{fmt(c[key])} [{fmt(c[f'{key}_spread'][0])}..{fmt(c[f'{key}_spread'][1])}]"
                     for c in (per_config[name]["control"] for name in names)]
            print(f"control (off/off) {key}: " + " ".join(f"{cell:>26}" for cell in cells))
    print(f"extension threads: {json.dumps(threads)}")
    print(HUB_NOTE)
    checks = [(f"{key} {op} {bound} (worst: {fmt(top[key])}, {top[f'{key}_config']})", check(op, top[key], bound))
              for key, op, bound in TARGETS]
    checks.append((f"no process left behind ({survivors})", survivors == 0))
    return _bench.finish(checks, result, as_json=args.json, wall_s=result["wall_s"])


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
