#!/usr/bin/env python3
"""How a process that uses the liveness extension ends, on an upstream-shaped ``tensorrt_llm``.

A scenario program for ``run_scenario(..., program=[python, this file])`` (the fault matrix's
ending rows): it drives the fake ``tensorrt_llm`` in ``tests/fakes/trtllm_main`` (put it on
``PYTHONPATH``) through upstream's own API, ``LLM(model, executor_cls=liveness_executor_class())``,
so the blocking PAIR sends, ``threading._register_atexit(pre_shutdown)`` and ``atexit(shutdown)``
of upstream are the ones in play, not the reference executor's. It prints the same JSON records as
``trtllm_liveness.demo._scenario_child`` (``ScenarioResult.to_dict()``, progress lines, ``done``).

Endings (``ScenarioOptions.ending``; the extension is configured through ``TRTLLM_WORKER_LIVENESS``
with ``exit_on_fatal`` as given):

- ``serve_until_sigint``: a server. ``requests`` requests stream, the harness SIGKILLs rank
  ``fault_rank`` (verified through a pidfd) while they are pending, then waits up to ``observe_s``
  for the exit guard's SIGINT (counted by a handler, as uvicorn's), prints the record and shuts down
  gracefully (``llm.shutdown()``) and leaves through a normal interpreter exit. The parent reads
  the exit status and time: with ``exit_on_fatal`` the guard's status, within its bound.
- ``interpreter_exit``: a script. The requests complete, then the script ends without
  ``shutdown()``; the record (fatal error, events) is printed by an ``atexit`` hook registered before
  the LLM is built, so it runs after upstream's exit hooks. Expected: no fatal error, status 0.

Every wait is bounded; the parent bounds the whole process with its outer timeout.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
import threading
import time
from typing import Any

from trtllm_liveness.demo._mpi_env import configure_mpi_env
from trtllm_liveness.demo._scenario_child import LIVENESS_ENV_VAR, liveness_env
from trtllm_liveness.demo._scenario_records import EndingOutcome, ScenarioOptions, ScenarioResult, Victim
from trtllm_liveness.process import _pidfd


def emit(record: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


class Sigints:
    """SIGINT counted by a handler, as a server's (uvicorn's) would, instead of KeyboardInterrupt."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.received = threading.Event()
        signal.signal(signal.SIGINT, self._handler)

    def _handler(self, signum: int, frame: object) -> None:
        self.times.append(time.monotonic())
        self.received.set()


def identities_of(executor: Any, count: int, timeout: float) -> list[Any]:
    """The ranks' identities as the extension registered them (rank order), waiting up to ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        monitor = getattr(executor, "liveness_monitor", None)
        found = list(monitor.identities if monitor is not None else [])
        if len(found) >= count or time.monotonic() >= deadline:
            return sorted(found, key=lambda identity: identity.rank)
        time.sleep(0.01)


def record(opts: ScenarioOptions, executor: Any, **fields: Any) -> dict[str, Any]:
    fatal = getattr(executor, "_fatal_error", None)
    events = getattr(executor, "liveness_events", None)
    events = list(events() if callable(events) else events or [])
    result = ScenarioResult(
        iteration=0, options=opts, phase="serving", proxy_class=type(executor).__name__,
        events=tuple(events),
        fatal_error=None if fatal is None else str(fatal),
        fatal_error_type=None if fatal is None else type(fatal).__name__, **fields)
    return result.to_dict()


def build(opts: ScenarioOptions, engine_kwargs: dict[str, Any]) -> Any:
    import importlib

    from tensorrt_llm import LLM  # type: ignore[import-not-found]  # the fake on PYTHONPATH

    from trtllm_liveness.integrations.trtllm import liveness_executor_class

    # The fake's shared code, importable once tensorrt_llm (the fake) has put its folder on sys.path.
    fake_engine = importlib.import_module("_trtllm_fake_common").FakeEngine
    return LLM(fake_engine(**engine_kwargs), executor_cls=liveness_executor_class(),
               tensor_parallel_size=opts.workers)


def serve_until_sigint(opts: ScenarioOptions) -> int:
    sigints = Sigints()
    llm = build(opts, {"token_delay_s": opts.token_delay_s})
    executor = llm._executor
    identities = identities_of(executor, opts.workers, 10)
    emit({"pids": [i.pid for i in identities], "iteration": 0})
    results = [llm.generate_async([rank] * 4, max_tokens=opts.tokens) for rank in range(opts.requests)]
    time.sleep(0.2)  # the requests are in flight (tokens stream every token_delay_s)
    victim = identities[opts.fault_rank]
    fd = _pidfd.open_verified_pidfd(victim.pid, victim.start_time)  # never a recycled pid
    try:
        t0 = time.monotonic()
        _pidfd.send_signal(fd, signal.SIGKILL)
    finally:
        os.close(fd)
    emit({"fault_at": t0, "iteration": 0})
    sigints.received.wait(opts.observe_s)
    first = sigints.times[0] if sigints.times else None
    pending = sum(1 for r in results if not r.finished)
    ending = EndingOutcome(ending=opts.ending, sigints=len(sigints.times),
                           sigint_ms=None if first is None else round((first - t0) * 1e3, 3))
    emit(record(opts, executor, pids=tuple(i.pid for i in identities), victims=(Victim(victim.rank, victim.pid),),
                in_flight=opts.requests, fault_at=t0, pending_not_done=pending, ending=ending))
    llm.shutdown()  # what trtllm-serve does once uvicorn returns; may block (the guard bounds it)
    emit({"done": True})
    return 0


def interpreter_exit(opts: ScenarioOptions) -> int:
    holder: dict[str, Any] = {}

    def report() -> None:  # registered first, so it runs after the hooks the build registers
        executor = holder.get("executor")
        if executor is None:
            return
        emit(record(opts, executor, pids=holder["pids"], tokens_ok=holder.get("tokens_ok"),
                    ending=EndingOutcome(ending=opts.ending, at_exit=True)))
        emit({"done": True})

    atexit.register(report)
    llm = build(opts, {"token_delay_s": opts.token_delay_s})
    holder["executor"] = llm._executor
    holder["pids"] = tuple(i.pid for i in identities_of(llm._executor, opts.workers, 10))
    results = [llm.generate_async([rank] * 4, max_tokens=opts.tokens) for rank in range(opts.requests)]
    holder["tokens_ok"] = all(len(r.result(timeout=30).token_ids) == opts.tokens for r in results)
    return 0  # and the script ends, without llm.shutdown()


def main(argv: list[str]) -> int:
    opts = ScenarioOptions.from_dict(json.loads(argv[0]) if argv else {})
    os.environ[LIVENESS_ENV_VAR] = liveness_env(opts)
    configure_mpi_env()
    try:
        if opts.ending == "serve_until_sigint":
            return serve_until_sigint(opts)
        if opts.ending == "interpreter_exit":
            return interpreter_exit(opts)
        raise ValueError(f"ending {opts.ending!r}: this program runs serve_until_sigint and interpreter_exit")
    except BaseException:
        import traceback

        emit({"error": traceback.format_exc()})
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))  # a real interpreter exit: upstream's and the guard's hooks run
