#!/usr/bin/env python3
"""Benchmark: the extension's own calls on the request path and in the wedge scan, one by one.

``bench_overhead.py`` measures a whole engine; on a small machine its wall-clock figures swing by
more than the extension's share. This one times, in one process, the pieces the extension adds,
each beside what upstream (or the plain procfs read) does without it, baseline and extension
interleaved round by round (median over ``--rounds``; CPU of the calling thread, ``thread_time``):

- ``dispatch_busy_added_ns`` / ``dispatch_idle_added_ns``: per response batch, upstream's
  ``dispatch_result_task()`` on the executor class (the mixin over upstream's, with its engine
  state on and its results table, a :class:`ForgottenResults`) minus upstream's own, on a real ZMQ
  PAIR socket over TCP loopback (the result queue's kind): "busy" with the batches already
  queued (a loaded engine), "idle" with each batch sent only once the receiver waits (the sender
  spins ``--gap-us`` between batches). Upstream is reduced to the receive and 1.2's lookup of the
  response's request in ``_results``;
- ``extension_calls_per_batch``: calls of the package's Python functions per dispatched batch
  (a profiler in the dispatch thread, in a run of its own, not timed);
- ``submit_added_ns``: per request, the mixin's ``submit()`` (the fatal checks, the send lock)
  minus upstream's, reduced to handing the request on;
- ``note_submitted_ns``: the stall timer's notes per submitted request (``note_submitted`` and
  ``note_registered`` of a running :class:`StallDetector`, a request pending), which the submit
  wrapper adds;
- ``output_sample_us``: one read of the dispatch thread's activity, the output progress the
  clock samples (per read of the clock, at most once a second by the stall timer while a request
  is pending: never per request);
- ``scan_us`` by thread count: one :class:`ThreadSampler` sample of a process with that many
  threads (its kept fds), beside ``scan_by_path_us``: the same thread states read by path (a
  ``listdir`` and an open-read-close per thread, as :func:`sample_d_state` does);
- ``request_added_us`` (also ``extension_cpu_us_per_request``): the extension's CPU for one tiny
  request (one batch): the worse dispatch case, the submit, its note. ``bench_overhead.py``
  reports the proxy's whole CPU per request without the extension
  (``proxy_cpu_us_per_request_off``): their ratio bounds what these calls can take from a
  proxy-bound engine's throughput.

Checks: no call of the package per batch; a sample with kept fds costs less than the reads by path
at 13 threads and more.

Usage: scripts/bench_request_path.py [--json] [--rounds N] [--batches N] [--gap-us U]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import _bench

from trtllm_liveness._config import LivenessConfig
from trtllm_liveness.integrations.trtllm._engine_stall import dispatch_activity
from trtllm_liveness.integrations.trtllm._mixin import LivenessProxyMixin
from trtllm_liveness.integrations.trtllm._state import STATE_ATTR, EngineLiveness
from trtllm_liveness.integrations.trtllm._upstream_teardown import forget_results
from trtllm_liveness.monitor._stall_timer import StallDetector
from trtllm_liveness.process import _procfs
from trtllm_liveness.process._thread_sampler import ThreadSampler

THREAD_COUNTS = (1, 13, 64)


PACKAGE = os.path.dirname(os.path.abspath(sys.modules["trtllm_liveness"].__file__ or ""))


class _Upstream:
    """Upstream's proxy reduced to its two request-path methods: ``submit`` hands the request on,
    ``dispatch_result_task`` receives one batch (a blocking receive) and looks its request up as
    1.2 does (``_results[client_id]``)."""

    def __init__(self, socket: Any) -> None:
        self.socket = socket
        self._results: dict[int, Any] = {0: None}

    def submit(self, request: Any) -> Any:
        return request

    def dispatch_result_task(self) -> bool:
        self._results[0]
        return bool(self.socket.recv())


class _WithLiveness(LivenessProxyMixin, _Upstream):
    """The same with the extension's wrappers (the mixin the executor class puts over upstream's)."""


def _proxy(liveness: bool, socket: Any) -> _Upstream:
    """An engine's proxy without starting an engine: the mixin's per-engine state set directly (on,
    with its results table as the constructor leaves it; the stall timer's note is timed on its own
    below)."""
    if not liveness:
        return _Upstream(socket)
    proxy = _WithLiveness.__new__(_WithLiveness)
    _Upstream.__init__(proxy, socket)
    proxy.__dict__[STATE_ATTR] = EngineLiveness(config=LivenessConfig(enabled=True))
    forget_results(proxy)
    return proxy


def _count_package_calls(calls: list[int]) -> Callable[[Any, str, Any], None]:
    def profile(frame: Any, event: str, _arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(PACKAGE):
            calls[0] += 1

    return profile


def _dispatch_cpu_ns(liveness: bool, busy: bool, batches: int, gap_s: float, calls: list[int] | None = None) -> float:
    """CPU ns per batch of upstream's result thread calling ``dispatch_result_task()``; with
    ``calls``, the package's Python calls in that thread are counted into ``calls[0]`` instead."""
    import zmq

    context = zmq.Context()
    server, client = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
    for socket in (server, client):
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SNDHWM, batches + 1)
        socket.setsockopt(zmq.RCVHWM, batches + 1)
    server.bind("tcp://127.0.0.1:*")
    client.connect(server.getsockopt_string(zmq.LAST_ENDPOINT))
    payload = b"r" * 200
    proxy = _proxy(liveness, server)
    waiting = threading.Event()
    result: list[float] = []

    def receiver() -> None:
        waiting.set()
        if calls is not None:
            sys.setprofile(_count_package_calls(calls))
        t0 = time.thread_time_ns()
        for _ in range(batches):
            proxy.dispatch_result_task()
        result.append((time.thread_time_ns() - t0) / batches)
        sys.setprofile(None)

    try:
        if busy:
            for _ in range(batches):
                client.send(payload)
            while not server.poll(0):
                time.sleep(0.001)
        thread = threading.Thread(target=receiver)
        thread.start()
        waiting.wait(10)
        if not busy:
            for _ in range(batches):
                end = time.perf_counter() + gap_s
                while time.perf_counter() < end:
                    pass
                client.send(payload)
        thread.join(60)
        if thread.is_alive() or not result:
            raise RuntimeError("the receiver did not finish")
    finally:
        server.close(0)
        client.close(0)
        context.term()
    return result[0]


def _submit_cpu_ns(liveness: bool, calls: int) -> float:
    proxy = _proxy(liveness, None)
    return _per_call_ns(lambda: proxy.submit(1), calls)


def _per_call_ns(call: Callable[[], object], calls: int) -> float:
    t0 = time.thread_time_ns()
    for _ in range(calls):
        call()
    return (time.thread_time_ns() - t0) / calls


def _note_submitted_ns(calls: int) -> float:
    detector = StallDetector(3600.0, lambda: 1, on_stall=lambda info: None)
    detector.start()
    try:
        def notes() -> None:
            detector.note_submitted(was_idle=False)
            detector.note_registered()

        return _per_call_ns(notes, calls)
    finally:
        detector.close()


def _output_sample_us(samples: int) -> float:
    """One read of a dispatch thread's activity (a thread of this process, blocked)."""
    done = threading.Event()

    class Proxy:
        dispatch_result_thread = threading.Thread(target=done.wait, daemon=True)

    proxy = Proxy()
    proxy.dispatch_result_thread.start()
    try:
        import weakref

        return _per_call_ns(dispatch_activity(weakref.ref(proxy)), samples) / 1000
    finally:
        done.set()
        proxy.dispatch_result_thread.join(10)


def _scan_us(threads: int, samples: int) -> tuple[float, float]:
    """(a kept sampler's sample, the reads by path), us, of this process with ``threads`` threads."""
    done = threading.Event()
    extra = [threading.Thread(target=done.wait, daemon=True) for _ in range(threads - 1)]
    for thread in extra:
        thread.start()
    try:
        pid = os.getpid()
        sampler = ThreadSampler(pid, _procfs.read_stat(pid).start_time)
        try:
            sampler.sample()
            kept = _per_call_ns(sampler.sample, samples) / 1000
            by_path = _per_call_ns(lambda: _procfs.read_thread_states(pid), samples) / 1000
        finally:
            sampler.close()
        return kept, by_path
    finally:
        done.set()
        for thread in extra:
            thread.join(10)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default 7)")
    parser.add_argument("--batches", type=int, default=20000, help="batches per dispatch run (default 20000)")
    parser.add_argument("--gap-us", type=float, default=50.0, help="the idle case's gap between batches")
    args = parser.parse_args()
    started = time.monotonic()
    rows: dict[str, list[float]] = {}

    def add(key: str, value: float) -> None:
        rows.setdefault(key, []).append(value)

    for round_no in range(args.rounds):
        order = (True, False) if round_no % 2 else (False, True)
        for busy in (True, False):
            case = "busy" if busy else "idle"
            for liveness in order:
                key = f"dispatch_{case}_{'liveness' if liveness else 'upstream'}_ns"
                add(key, _dispatch_cpu_ns(liveness, busy, args.batches, args.gap_us / 1e6))
        for liveness in order:
            add(f"submit_{'liveness' if liveness else 'upstream'}_ns", _submit_cpu_ns(liveness, args.batches))
        add("note_submitted_ns", _note_submitted_ns(args.batches))
        add("output_sample_us", _output_sample_us(2000))
        for count in THREAD_COUNTS:
            kept, by_path = _scan_us(count, 2000)
            add(f"scan_us_{count}", kept)
            add(f"scan_by_path_us_{count}", by_path)
    calls = [0]
    _dispatch_cpu_ns(True, True, args.batches, 0.0, calls)
    med = {key: statistics.median(values) for key, values in rows.items()}
    spread = {key: (min(values), max(values)) for key, values in rows.items()}
    result: dict[str, Any] = {}
    for step in ("dispatch_busy", "dispatch_idle", "submit"):
        with_it, without = med[f"{step}_liveness_ns"], med[f"{step}_upstream_ns"]
        result[f"{step}_upstream_ns"] = without
        result[f"{step}_liveness_ns"] = with_it
        result[f"{step}_added_ns"] = with_it - without
    result["note_submitted_ns"] = med["note_submitted_ns"]
    result["output_sample_us"] = med["output_sample_us"]
    result["extension_calls_per_batch"] = calls[0] / args.batches
    result["scan_us"] = {str(count): round(med[f"scan_us_{count}"], 2) for count in THREAD_COUNTS}
    result["scan_by_path_us"] = {str(count): round(med[f"scan_by_path_us_{count}"], 2) for count in THREAD_COUNTS}
    result["request_added_us"] = (max(result["dispatch_busy_added_ns"], result["dispatch_idle_added_ns"])
                                  + result["submit_added_ns"] + result["note_submitted_ns"]) / 1000
    result["extension_cpu_us_per_request"] = result["request_added_us"]
    result["rounds"] = args.rounds

    print(f"{'figure (median over rounds; [min..max])':44s} {'baseline':>22s} {'with the extension':>22s}")
    steps = (("dispatch_busy", "dispatch per batch, busy, ns"), ("dispatch_idle", "dispatch per batch, idle, ns"),
             ("submit", "submit per request, ns"))
    for step, label in steps:
        b, g = f"{step}_upstream_ns", f"{step}_liveness_ns"
        print(f"{label:44s} "
              f"{med[b]:8.0f} [{spread[b][0]:.0f}..{spread[b][1]:.0f}] "
              f"{med[g]:8.0f} [{spread[g][0]:.0f}..{spread[g][1]:.0f}]")
    key = "note_submitted_ns"
    print(f"{'stall note per request, ns':44s} {'-':>22s} {med[key]:8.0f} [{spread[key][0]:.0f}..{spread[key][1]:.0f}]")
    key = "output_sample_us"
    print(f"{'output sample (<= 1/s while pending), us':44s} {'-':>22s} {med[key]:8.2f} "
          f"[{spread[key][0]:.2f}..{spread[key][1]:.2f}]")
    print(f"{'calls of the package per batch':44s} {'':22s} {result['extension_calls_per_batch']:22.3f}")
    for count in THREAD_COUNTS:
        k, p = f"scan_us_{count}", f"scan_by_path_us_{count}"
        print(f"{f'wedge scan of a {count}-thread process, us':44s} {med[p]:22.2f} {med[k]:22.2f}")
    print(f"{'the extension per tiny request (one batch), us':44s} {'':22s} {result['request_added_us']:22.2f}")
    checks = [("no call of the package per batch", result["extension_calls_per_batch"] == 0)]
    checks += [(f"scan with kept fds cheaper than reads by path at {count} threads",
               med[f"scan_us_{count}"] < med[f"scan_by_path_us_{count}"]) for count in THREAD_COUNTS if count >= 13]
    return _bench.finish(checks, result, as_json=args.json, wall_s=time.monotonic() - started)


if __name__ == "__main__":
    raise SystemExit(main())
