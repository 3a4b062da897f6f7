"""The engine side of ``trtllm-liveness drill``: the user's model on the installed TensorRT-LLM.

Run by the drill as ``python -m trtllm_liveness.drill._drill_engine '<DrillOptions>'``
in a session of its own, with ``TRTLLM_WORKER_LIVENESS`` set by the drill::

    LLM(model, tensor_parallel_size=tp, executor_cls=liveness_executor_class())
      -> ``requests`` streaming requests (``generate_async(..., streaming=True)``), each read by a thread
      -> once every request has tokens (and, across hosts, every rank is watched):
         {"ready": EngineReady} on stdout (the ranks, by verified identity; the agents' ranks)
      <- one line on stdin: {"fault_at": <monotonic>} (the drill injected the fault), or
         {"inject": {"rank": R, "fault": F}}: a rank of another host, whose agent makes the fault
         (asked through the engine's DrillHub, drill/_drill_faults.py; the engine never signals
         a remote pid) -> {"injected": FaultReply} on stdout; or EOF
      -> watch for ``observe_s``: the monitor's event, check_health(), the requests' errors, tokens
      -> llm.shutdown() (bounded by the extension) -> {"report": EngineReport}

``{"error": "..."}`` replaces what cannot come (TensorRT-LLM not importable, the extension not
attached, no tokens within ``stream_timeout_s``). The process ends with ``os._exit`` after its last
line, so no MPI or atexit join can hold it; the drill bounds it and cleans up after it in any case.

What of upstream's LLM API this relies on: docs/drill.md ("What of TensorRT-LLM it relies on").
"""

from __future__ import annotations

import inspect
import json
import os
import queue
import select
import sys
import threading
import time
from typing import Any

from ..demo._scenario_endings import emit
from ..demo._scenario_executor import engine_factory
from ._drill_records import DrillOptions, DrillRank, EngineReady, EngineReport

PROMPT = [1, 2, 3, 4]  # token ids: no tokenizer needed
_TICK_S = 0.001
_STOPPED_AFTER_S = 1.0  # tokens count as stopped after this long without one
_WATCHED_S = 30.0  # the agents' hellos come within a second or two of the ranks' start
_INJECT_S = 15.0  # the remote agent's answer to a fault request (a freeze waits at most 2 s)


class _Stream:
    """One streaming request, read by a daemon thread (upstream's result advances only while its
    consumer reads it): its token count, its error, when it ended."""

    def __init__(self, result: Any) -> None:
        self._result = result
        self.tokens = 0
        self.error: BaseException | None = None
        self.finished = False
        self.ended_at: float | None = None
        self.last_token_at: float | None = None
        threading.Thread(target=self._read, name="drill-request", daemon=True).start()

    def _count(self) -> int:
        outputs = getattr(self._result, "outputs", None)
        if outputs:
            return len(getattr(outputs[0], "token_ids", None) or ())
        return len(getattr(self._result, "token_ids", None) or ())

    def _read(self) -> None:
        while True:
            try:
                self._result._result_step(0.1)
            except queue.Empty:
                continue
            except BaseException as exc:  # the engine's error for this request
                self.error = exc
                self.ended_at = time.monotonic()
                return
            count = self._count()
            if count != self.tokens:
                self.tokens, self.last_token_at = count, time.monotonic()
            if self._result.finished:
                self.finished = True
                self.ended_at = time.monotonic()
                return

    @property
    def done(self) -> bool:
        return self.finished or self.error is not None


def _model(options: DrillOptions) -> Any:
    return engine_factory(options.engine)(options.model) if options.engine else options.model


def _submit(llm: Any, max_tokens: int) -> Any:
    parameters = inspect.signature(llm.generate_async).parameters
    if "sampling_params" in parameters:
        from tensorrt_llm import SamplingParams

        return llm.generate_async(PROMPT, sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                  streaming=True)
    return llm.generate_async(PROMPT, max_tokens=max_tokens, streaming=True)


def _read_fault(timeout: float, executor: Any) -> float | None:
    """The drill's fault time from stdin (None: EOF, garbage or nothing within ``timeout``), or
    the time a remote host's agent made the fault the drill asked for (None: it did not)."""
    ready, _, _ = select.select([sys.stdin], [], [], timeout)
    if not ready:
        return None
    try:
        line = json.loads(sys.stdin.readline())
        value, inject = line.get("fault_at"), line.get("inject")
    except (ValueError, AttributeError):
        return None
    if isinstance(inject, dict):
        return _inject_remote(executor, inject.get("rank"), inject.get("fault"))
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _inject_remote(executor: Any, rank: Any, fault: Any) -> float | None:
    from ._drill_faults import FAULTS, DrillHub

    hub = getattr(getattr(executor, "liveness_state", None), "hub", None)
    if not isinstance(hub, DrillHub):
        emit({"error": "this engine runs no drill's agent hub: no rank of another host can be hit"})
        return None
    if not isinstance(rank, int) or isinstance(rank, bool) or fault not in FAULTS:
        emit({"error": f"bad inject request: rank {rank!r}, fault {fault!r}"})
        return None
    reply = hub.inject_fault(rank, fault, _INJECT_S)
    emit({"injected": reply.to_dict()})
    return reply.at if reply.injected else None


def _wait_watched(executor: Any, tp: int, deadline: float) -> None:
    """Across hosts: until every rank but the proxy's own (rank 0) is watched, here or by its host's
    agent (a rank of another host is ``none`` until its agent's hello), bounded."""
    wanted = set(range(1, tp))
    while time.monotonic() < deadline:
        if wanted <= {status.identity.rank for status in executor.liveness_statuses() if str(status.method) != "none"}:
            return
        time.sleep(0.05)


def _agents(executor: Any) -> tuple[int, ...]:
    hub = getattr(getattr(executor, "liveness_state", None), "hub", None)
    return () if hub is None else tuple(host.agent_rank for host in hub.hosts())


def _ranks(executor: Any) -> tuple[DrillRank, ...]:
    return tuple(DrillRank(rank=s.identity.rank, pid=s.identity.pid, start_time=s.identity.start_time,
                           host=s.identity.hostname, pid_namespace=s.identity.pid_namespace, method=str(s.method))
                 for s in executor.liveness_statuses())


def _observe(executor: Any, streams: list[_Stream], t0: float, observe_s: float) -> dict[str, Any]:
    deadline = t0 + observe_s
    health_false = failed_all = None
    while time.monotonic() < deadline:
        now = time.monotonic()
        if health_false is None and not executor.check_health():
            health_false = now
        if failed_all is None and all(stream.error is not None for stream in streams):
            failed_all = max(stream.ended_at or now for stream in streams)
        if health_false is not None and failed_all is not None:
            break
        if all(stream.done for stream in streams):
            break
        time.sleep(_TICK_S)
    last = [stream.last_token_at for stream in streams if stream.last_token_at is not None]
    stopped = max(last) if last and time.monotonic() - max(last) >= _STOPPED_AFTER_S else None
    events = list(executor.liveness_events)
    return {"detected_at": events[0].detected_at if events else None, "health_false_at": health_false,
            "failed_all_at": failed_all, "tokens_stopped_at": stopped,
            "pending": sum(1 for stream in streams if not stream.done)}


def run(options: DrillOptions) -> int:
    try:
        import tensorrt_llm
        from tensorrt_llm import LLM
    except Exception as exc:  # ImportError, or the package failing at import (a CUDA library)
        emit({"error": f"tensorrt_llm cannot be imported by {sys.executable}: {type(exc).__name__}: {exc}"})
        return 4
    from ..integrations.trtllm import _hosts, liveness_executor_class
    from ._drill_faults import DrillHub

    _hosts.use_hub_class(DrillHub)  # this engine's agent hub (across hosts) is a drill's: its agents make its faults
    extra = {"_mpi_session": engine_factory(options.session)()} if options.session else {}
    llm = LLM(_model(options), tensor_parallel_size=options.tp, executor_cls=liveness_executor_class(), **extra)
    executor = llm._executor
    if not hasattr(executor, "liveness_statuses"):
        emit({"error": "the extension did not attach to this TensorRT-LLM's executor (run 'trtllm-liveness doctor')"})
        return 3
    streams = [_Stream(_submit(llm, options.max_tokens)) for _ in range(options.requests)]
    deadline = time.monotonic() + options.stream_timeout_s
    while not all(stream.tokens or stream.done for stream in streams) and time.monotonic() < deadline:
        time.sleep(0.01)
    if not all(stream.tokens and not stream.done for stream in streams):
        problems = sorted({repr(stream.error) for stream in streams if stream.error is not None})
        emit({"error": f"the requests did not all stream within {options.stream_timeout_s:g} s"
                       + (f": {'; '.join(problems)}" if problems else "")})
        return 1
    if options.hosts:
        _wait_watched(executor, options.tp, min(deadline, time.monotonic() + _WATCHED_S))
    emit({"ready": EngineReady(ranks=_ranks(executor), proxy_pid=os.getpid(),
                               version=str(getattr(tensorrt_llm, "__version__", "?")),
                               streaming=len(streams), agents=_agents(executor)).to_dict()})
    t0 = _read_fault(options.fault_wait_s, executor)
    if t0 is None:
        emit({"error": f"no fault made within {options.fault_wait_s:g} s"})
        return 1
    seen = _observe(executor, streams, t0, options.observe_s)
    started = time.monotonic()
    llm.shutdown()
    shutdown_s = time.monotonic() - started
    fatal = executor.liveness_fatal_error
    stop_report = executor.liveness_shutdown_report
    emit({"report": EngineReport(
        **seen, fatal="" if fatal is None else str(fatal), fatal_kind="" if fatal is None else fatal.event.kind.value,
        fatal_rank=None if fatal is None else fatal.event.identity.rank,
        restartable=None if fatal is None else fatal.restartable and (stop_report is None or stop_report.restartable),
        total=len(streams), shutdown_s=shutdown_s,
        unkillable=() if stop_report is None else tuple(worker.pid for worker in stop_report.unkillable)).to_dict()})
    return 0


def main(argv: list[str]) -> None:
    code = 2
    try:
        code = run(DrillOptions.from_dict(json.loads(argv[0])))
    except BaseException as exc:  # one line for the drill, never a hang in a half-built engine
        emit({"error": f"{type(exc).__name__}: {exc}"})
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
