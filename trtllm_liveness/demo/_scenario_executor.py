"""The executor under test in a scenario: building it, submitting to it, asking it.

Two executors answer the same questions here: the reference proxy (``via="class"``, requests echo
their prompt) and upstream's API of the ``tensorrt_llm`` on ``sys.path`` (``GenerationExecutor.create(
engine, ...)`` with the engine of the ``engine`` option, whose requests count 1..``max_tokens``).
Upstream's results advance only while read, so each is read by a thread of its own
(:class:`_UpstreamRequest`) and seen through the reference result's surface. Every wait is bounded.
"""

from __future__ import annotations

import contextlib
import importlib
import queue
import threading
import time
from typing import Any

from ..stop._stop_report import StopReport
from ._executor_protocol import GenerationResult
from ._scenario_records import InitOutcome, ScenarioOptions, ShutdownOutcome

__all__ = ["Build", "bounded", "build_executor", "engine_factory", "expected_tokens",
           "fatal_fields", "health", "settled_fatal_error", "shutdown_outcome", "submit", "upstream_api"]


def build_executor(opts: ScenarioOptions, worker_kwargs: dict[str, Any]) -> Any:
    """The executor: the reference proxy (``via="class"``), else upstream's ``create()`` of the
    ``tensorrt_llm`` on ``sys.path``, given the engine that ``opts.engine`` makes."""
    if opts.via == "class":
        return _proxy_class(opts)(worker_kwargs, model_world_size=opts.workers)
    if opts.via == "autoload":
        importlib.import_module("trtllm_liveness.integrations.trtllm_autoload")
    from tensorrt_llm.executor.executor import GenerationExecutor

    executor_cls: Any = GenerationExecutor
    if opts.via == "executor_cls":
        from ..integrations.trtllm import liveness_executor_class

        executor_cls = liveness_executor_class(GenerationExecutor)
    engine = engine_factory(opts.engine)(
        token_delay_s=opts.token_delay_s, init_delay_s=opts.init_delay_s,
        announce_dir=worker_kwargs["announce_dir"], fault=worker_kwargs.get("fault"))
    return executor_cls.create(engine, model_world_size=opts.workers)


def engine_factory(name: str) -> Any:
    """The callable ``name`` ("module:attribute") names; ``ValueError`` saying why it cannot be had."""
    module_name, _, attribute = name.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"scenario option engine={name!r}: cannot import {module_name!r}: {exc}") from exc
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise ValueError(f"scenario option engine={name!r}: {module_name!r} has no attribute {attribute!r}")
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"scenario option engine={name!r}: {attribute!r} is not callable")
    return target


def _proxy_class(opts: ScenarioOptions) -> type:
    from ._executor_proxy import PROXY_CLASSES

    base = PROXY_CLASSES[opts.mode]
    if not opts.liveness:
        return base
    from ..integrations.trtllm import liveness_proxy_class

    return liveness_proxy_class(base, default_enabled=True)


def upstream_api(opts: ScenarioOptions) -> bool:
    """Whether the executor is built through upstream's API rather than being the reference's."""
    return opts.via != "class"


class _UpstreamRequest(GenerationResult):
    """A request on an upstream-shaped executor, seen through the reference result's surface
    (``started``, ``done``, ``tokens``, ``error``, ``finished_at``, ``wait``, ``result``).

    Upstream's ``GenerationResult`` advances only while its consumer reads it, so a daemon thread
    reads it here (each read bounded), until it finishes, fails, or ``stop`` is set (the end of
    the iteration: a request of a dead engine without liveness never finishes).
    """

    def __init__(self, result: Any, stop: threading.Event) -> None:
        super().__init__(result.request_id)
        self._result = result
        self._stop = stop
        self._last_delivery: float | None = None
        self._time_deliveries(getattr(result, "queue", None))
        threading.Thread(target=self._read, name="scenario-request", daemon=True).start()

    def _time_deliveries(self, item_queue: Any) -> None:
        # finished_at is when the final item (the last token, or the engine's error) was put into
        # the request's queue, by whichever thread put it: what the reference's results record
        # (they are completed where they are failed). When this harness thread then gets the GIL
        # to read it is the harness's cost, not the engine's.
        put = getattr(item_queue, "put", None)
        if not callable(put):
            return

        def timed_put(item: Any, *args: Any, **kwargs: Any) -> Any:
            self._last_delivery = time.monotonic()
            return put(item, *args, **kwargs)

        item_queue.put = timed_put

    def _read(self) -> None:
        while not self._result.finished and not self._stop.is_set():
            try:
                self._result._result_step(0.1)
            except queue.Empty:
                continue
            except BaseException as exc:  # the engine's error for this request (EngineDeadError, ...)
                self.error = exc
                break
            self.tokens = list(self._result.token_ids)
            self.started.set()
        if self.error is None and not self._result.finished:
            return  # stopped, not finished: stays pending
        self.finished_at = self._last_delivery if self._last_delivery is not None else time.monotonic()
        self._event.set()


def submit(opts: ScenarioOptions, proxy: Any, prompt: int, stop: threading.Event) -> Any:
    """One request of ``opts.tokens`` tokens; the reference echoes its prompt, upstream's API
    takes ``max_tokens``."""
    if not upstream_api(opts):
        return proxy.generate_async([prompt] * opts.tokens)
    return _UpstreamRequest(proxy.generate_async([prompt] * 4, max_tokens=opts.tokens, streaming=True), stop)


def expected_tokens(opts: ScenarioOptions, prompt: int) -> list[int]:
    """What a healthy engine answers to :func:`submit`: the reference echoes the prompt, the
    engine given to upstream's API counts 1..n."""
    return list(range(1, opts.tokens + 1)) if upstream_api(opts) else [prompt] * opts.tokens


def shutdown_outcome(proxy: Any, **fields: Any) -> ShutdownOutcome:
    """``fields`` and what the executor's shutdown left: how often upstream's ``pre_shutdown()`` did
    its work (the reference's counter, or the count an instrumented upstream-shaped executor keeps of
    it), the liveness shutdown's stop report (None without one) and the pids it found unkillable."""
    runs = next((value for name in ("pre_shutdown_runs", "_fake_pre_shutdown_runs")
                 if isinstance(value := getattr(proxy, name, None), int)), None)
    report: StopReport | None = getattr(proxy, "liveness_shutdown_report", None)
    return ShutdownOutcome(pre_shutdown_runs=runs, report=report,
                           unkillable=() if report is None else tuple(u.pid for u in report.unkillable), **fields)


def bounded(action: Any, timeout: float = 5.0) -> None:
    """Run a harness clean-up step (``action()``) in a daemon thread, waiting at most ``timeout``:
    upstream's session and queue shutdowns wait without a bound on a dead world."""
    def run() -> None:
        with contextlib.suppress(Exception):
            action()

    thread = threading.Thread(target=run, name="scenario-cleanup", daemon=True)
    thread.start()
    thread.join(timeout)


def health(proxy: Any, probe: str) -> bool:
    """The executor's health as ``probe`` asks it: ``check_health()`` or upstream's ``_fatal_error`` alone."""
    if probe == "fatal_error":
        return getattr(proxy, "_fatal_error", None) is None
    check = getattr(proxy, "check_health", None)
    return bool(check()) if callable(check) else not proxy.is_shutdown()


def settled_fatal_error(proxy: Any, wait: bool = True, timeout: float = 2.0) -> Any:
    """The executor's recorded fatal error, waiting (bounded; only if ``wait``) for it to be published.

    The liveness extension turns ``check_health()`` False at once but may publish ``_fatal_error``
    a few milliseconds later (after its fatal path's other steps), so a reader that just saw
    health turn False may be early.
    """
    deadline = time.monotonic() + timeout
    fatal = getattr(proxy, "_fatal_error", None)
    while wait and fatal is None and time.monotonic() < deadline:
        time.sleep(0.001)
        fatal = getattr(proxy, "_fatal_error", None)
    return fatal


def fatal_fields(proxy: Any, fatal: Any) -> dict[str, Any]:
    """The executor's events and fatal error as they stand: the ``ScenarioResult`` fields
    ``events``, ``fatal_error`` and ``fatal_error_type``."""
    return {"events": tuple(getattr(proxy, "liveness_events", [])),
            "fatal_error": None if fatal is None else str(fatal),
            "fatal_error_type": None if fatal is None else type(fatal).__name__}


class Build:
    """The executor built in a daemon thread (construction blocks until READY, or forever): ``proxy``,
    or ``error`` and ``at`` (``time.monotonic()`` of the raise)."""

    def __init__(self, opts: ScenarioOptions, worker_kwargs: dict[str, Any]) -> None:
        self.proxy: Any = None
        self.error: BaseException | None = None
        self.at: float | None = None
        self.thread = threading.Thread(target=self._build, args=(opts, worker_kwargs), name="scenario-build",
                                       daemon=True)
        self.thread.start()

    def _build(self, opts: ScenarioOptions, worker_kwargs: dict[str, Any]) -> None:
        try:
            self.proxy = build_executor(opts, worker_kwargs)
        except BaseException as exc:
            self.error = exc
            self.at = time.monotonic()

    @staticmethod
    def outcome(hung: bool, error: BaseException | None, **fields: Any) -> InitOutcome:
        """The build's :class:`InitOutcome` from one reading of it (``hung``: still building, read
        first; then its ``error``), with ``fields``."""
        return InitOutcome(hung=hung, error_type=None if error is None else type(error).__name__,
                           error=None if error is None else str(error), **fields)
