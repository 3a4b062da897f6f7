#!/usr/bin/env python3
"""Stalled engines on an upstream-shaped ``tensorrt_llm``: the fault matrix's stall rows.

A scenario program for ``run_scenario(..., program=[python, this file])``: it drives the fake
``tensorrt_llm`` on ``PYTHONPATH`` (``tests/fakes/trtllm_main`` or ``trtllm_v12``) through upstream's
own API, ``LLM(model, executor_cls=liveness_executor_class())``, with every step acknowledged by every
rank (``FakeEngine.step_acks``: a rank that stops participating stops the leader, as in a collective),
and prints the same JSON records as ``trtllm_liveness.demo._scenario_child`` (``ScenarioResult``,
``done``). The extension is configured from the scenario options plus ``stall_timeout_s`` (env
``TRTLLM_LIVENESS_STALL_TIMEOUT_S``, default 1) and ``stall_action=fatal``.

The stall (env ``TRTLLM_LIVENESS_STALL_SCENARIO``), on rank ``fault_rank``:

- ``block``: the rank's step loop waits forever on an event (user space);
- ``silent``: the rank stops answering the leader (the leader waits in its MPI receive);
- ``spin``: the rank busy-loops;
- ``stop``: the harness SIGSTOPs the rank (verified pidfd) while requests stream;
- ``near-miss``: no stall at all: for ``observe_s`` seconds, batches of requests on an idle engine
  whose first step comes at 80% of the timeout (a slow first token), then stream. Any stall is a
  false alarm.

With ``ending="serve_until_sigint"`` (and ``exit_on_fatal``) the program ends as a server does: after
the stall's fatal error it waits (up to ``observe_s``) for the exit guard's SIGINT, counted by a
handler as uvicorn's, prints the record, shuts down and leaves through a normal interpreter exit, so
the parent sees the guard's exit status (``scripts/exit_statuses.py``).

``fault_at`` is the stall's start: the harness's SIGSTOP, or, for the in-rank stalls, the engine's
last progress as the stall detector saw it. ``detected_ms`` is the stall event's detection from
there (about the timeout plus the timer's overshoot); ``health_false_ms`` and
``requests_failed_ms`` are polled from there. Every wait is bounded.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

from trtllm_liveness.demo._mpi_env import configure_mpi_env
from trtllm_liveness.demo._scenario_child import LIVENESS_ENV_VAR, liveness_env
from trtllm_liveness.demo._scenario_records import (
    Detection,
    EndingOutcome,
    ScenarioOptions,
    ScenarioResult,
    ShutdownOutcome,
    Victim,
)
from trtllm_liveness.process import _pidfd

SCENARIO_ENV = "TRTLLM_LIVENESS_STALL_SCENARIO"
TIMEOUT_ENV = "TRTLLM_LIVENESS_STALL_TIMEOUT_S"
KINDS = ("block", "silent", "spin", "stop", "near-miss")


def emit(record: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def _until(predicate: Any, timeout: float) -> float | None:
    """Monotonic time when ``predicate()`` first held, polling every ms; None past ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return time.monotonic()
        time.sleep(0.001)
    return None


def _signal(identity: Any, signum: int) -> None:

    _pidfd.signal_verified(identity.pid, identity.start_time, signum)  # never a recycled pid


def _failed(results: list[Any]) -> bool:
    import queue

    for result in results:
        while not result.finished:
            try:
                result._result_step(0)
            except queue.Empty:
                return False
            except Exception:
                break
    return True


def main(argv: list[str]) -> int:
    opts = ScenarioOptions.from_dict(json.loads(argv[0]) if argv else {})
    kind = os.environ.get(SCENARIO_ENV, "")
    if kind not in KINDS:
        raise ValueError(f"{SCENARIO_ENV}={kind!r}: expected one of {', '.join(KINDS)}")
    timeout = float(os.environ.get(TIMEOUT_ENV, "1"))
    os.environ[LIVENESS_ENV_VAR] = f"{liveness_env(opts)},stall_timeout_s={timeout:g},stall_action=fatal"
    configure_mpi_env()
    sigints: list[float] = []
    if opts.ending == "serve_until_sigint":
        signal.signal(signal.SIGINT, lambda signum, frame: sigints.append(time.monotonic()))
    import importlib

    from tensorrt_llm import LLM  # type: ignore[import-not-found]  # the fake on PYTHONPATH

    from trtllm_liveness.integrations.trtllm import liveness_executor_class

    engine: dict[str, Any] = {"token_delay_s": opts.token_delay_s, "step_acks": True}
    if kind in ("block", "silent", "spin"):
        engine["stall"] = {"rank": opts.fault_rank, "kind": kind, "after_tokens": 20}
    if kind == "near-miss":
        engine["first_step_delay_s"] = 0.8 * timeout
    fake_engine = importlib.import_module("_trtllm_fake_common").FakeEngine
    llm = LLM(fake_engine(**engine), executor_cls=liveness_executor_class(), tensor_parallel_size=opts.workers)
    proxy = llm._executor
    identities = sorted(proxy.liveness_monitor.identities, key=lambda identity: identity.rank)
    victim = identities[opts.fault_rank]
    emit({"pids": [i.pid for i in identities], "iteration": 0})
    batches = 0
    results: list[Any] = []
    t0: float | None = None
    if kind == "near-miss":
        end = time.monotonic() + opts.observe_s
        while time.monotonic() < end and proxy.liveness_fatal_error is None:
            batch = [proxy.generate_async([rank] * 4, max_tokens=20, streaming=True) for rank in range(opts.requests)]
            batches += 1
            _until(lambda batch=batch: _failed(batch), 30)
    else:
        # Streaming (through the executor: the fake LLM API has no streaming flag), so that output
        # is progress on 1.2.x too, which reports no iterations: the stall is the fault's.
        results = [proxy.generate_async([rank] * 4, max_tokens=10**6, streaming=True) for rank in range(opts.requests)]
        if kind == "stop":
            time.sleep(0.3)  # streaming
            t0 = time.monotonic()
            _signal(victim, signal.SIGSTOP)
    stall_event = _until(lambda: proxy.liveness_fatal_error is not None, 0 if kind == "near-miss" else opts.observe_s)
    events = list(proxy.liveness_events)
    first = events[0] if events else None
    if t0 is None and first is not None and first.fault_at is not None:
        t0 = first.fault_at  # the stall's start: the engine's last progress
    health_false = _until(lambda: not proxy.check_health(), 5) if stall_event is not None else None
    failed = _until(lambda: _failed(results), 5) if stall_event is not None and results else None
    if kind == "stop":
        _signal(victim, signal.SIGCONT)

    def ms(at: float | None) -> float | None:
        return None if at is None or t0 is None else round((at - t0) * 1e3, 3)

    ending = None
    if opts.ending == "serve_until_sigint":
        _until(lambda: bool(sigints), max(0.0, opts.observe_s - (time.monotonic() - (t0 or time.monotonic()))))
        ending = EndingOutcome(ending=opts.ending, sigints=len(sigints),
                               sigint_ms=ms(sigints[0]) if sigints else None)
    detected = ms(first.detected_at) if first is not None else None
    detection = Detection(detected_ms=detected, health_false_ms=ms(health_false), requests_failed_ms=ms(failed),
                          e2e_ms=None if health_false is None or failed is None else ms(max(health_false, failed)),
                          stall_detected_ms=detected, floor_ms=None, pending_errors=(), new_request_error=None,
                          window_s=opts.observe_s)
    serving = ending is not None  # a server prints its record first: shutting down may end the process

    def record(shutdown: ShutdownOutcome | None) -> dict[str, Any]:
        fatal = proxy.liveness_fatal_error
        return ScenarioResult(
            iteration=0, options=opts, phase="serving", proxy_class=type(proxy).__name__,
            pids=tuple(i.pid for i in identities), victims=(Victim(victim.rank, victim.pid),),
            in_flight=len(results) or batches, fault_at=t0,
            events=tuple(events),
            fatal_error=None if fatal is None else str(fatal),
            fatal_error_type=None if fatal is None else type(fatal).__name__,
            pending_not_done=None, detection=detection, shutdown=shutdown, ending=ending).to_dict()

    if serving:
        emit(record(None))
    started = time.monotonic()
    llm.shutdown()
    if not serving:
        emit(record(ShutdownOutcome(shutdown_ms=round((time.monotonic() - started) * 1e3, 3))))
    emit({"done": True})
    return 0


if __name__ == "__main__":
    try:
        status = main(sys.argv[1:])
    except BaseException:
        import traceback

        emit({"error": traceback.format_exc()})
        status = 1
    sys.exit(status)  # a real interpreter exit: upstream's and the exit guard's hooks run
