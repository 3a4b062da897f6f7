"""Child process: start-up, submit, session and exit of the liveness proxy on an upstream-shaped fake.

Usage: ``python -m tests.programs.lifecycle_child '{"scenario": ..., "tree": "main" | "v12", ...}'``
with ``TRTLLM_WORKER_LIVENESS`` configuring the extension. The engine is built with upstream's
own ``GenerationExecutor.create(FakeEngine(...), model_world_size=2)`` (real MPI ranks) and the
extension installed as the import hook installs it (``patch_tensorrt_llm``). The upstream proxy
class is subclassed only to hand this program the instance while ``create()`` still runs (so the
ranks' identities can be reported before READY); it changes no behaviour.

Talks JSON lines on stdout; waits for commands (one word a line) on stdin where the parent acts
(freezes or thaws ranks: the parent owns every cgroup, so a killed child leaks none). Scenarios:

- ``startup``: emits ``{"identities": [[rank, pid, start_time], ...]}`` as soon as the extension
  registered the ranks (before READY), then ``{"created": ..., "ready_at": t}`` (``t`` monotonic,
  comparable with the parent's) or ``{"create_error": ...}``; then, on ``watch``, waits up to
  ``watch_s`` for a fatal error and emits ``{"fatal": ...}``; on ``done`` shuts down and exits.
- ``session``: ``passed_in`` True: the caller makes the ``MpiPoolSession`` and passes it to
  ``create(mpi_session=...)`` (the caller owns it); False: upstream's proxy makes its own. Every
  ``abandon()`` of the session is counted. Rank 1 is SIGKILLed, the fatal error awaited,
  ``shutdown()`` run; emits ``{"abandoned": n, "owns": ...}``; a caller-owned session is then
  abandoned by its owner (this program) before exit.
- ``exit_join``: emits the identities, then on ``watch`` waits for the fatal error (the parent
  froze the ranks), emits ``{"fatal": ...}``, runs ``shutdown()`` and returns: the interpreter exit
  must then end although no rank can ever answer mpi4py's manager thread.
- ``sends``: requests stream; the main thread (the owner of upstream's request socket) keeps
  submitting while rank ``rank`` is SIGKILLed, and on after the fatal error; emits
  ``{"violations": [...], "fatal": ..., ...}`` where ``violations`` are the ZMQ thread-ownership
  errors (``TLLM_LLMAPI_ZMQ_DEBUG=1``) seen in any log record or thread, with the thread's name.
- ``late_register``: ``threads`` threads submit back to back while rank 1 is SIGKILLed; every
  request that ``submit()`` returned must end (tokens or an error) within ``result_s``; emits
  ``{"submitted": n, "pending": [...], "errors": n, "rejected": n}``. ``result_delay_s`` lengthens
  upstream's making of a result (between the extension's check and the registration).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
import traceback
from typing import Any

from tests.support.ref_engine import emit, extension_threads
from tests.support.upstream_fakes import kill_rank, use_tree

VIOLATION = "ZMQ thread safety violation"


class Built:
    """The engine under test and what this program needs of the fake."""

    def __init__(self, tree: str, result_delay_s: float = 0.0, dispatch_delay_s: float = 0.0) -> None:
        use_tree(tree)
        from trtllm_liveness.demo._mpi_env import configure_mpi_env

        configure_mpi_env()
        import importlib

        from trtllm_liveness.integrations.trtllm import patch_tensorrt_llm

        proxy_module: Any = importlib.import_module("tensorrt_llm.executor.proxy")
        self.proxy_module = proxy_module
        self.session_module = importlib.import_module("tensorrt_llm.llmapi.mpi_session")
        self.common = importlib.import_module("_trtllm_fake_common")
        self.instances: list[Any] = []
        upstream = proxy_module.GenerationExecutorProxy
        instances = self.instances

        class Probe(upstream):  # type: ignore[misc, valid-type]
            __module__ = upstream.__module__
            __qualname__ = upstream.__qualname__

            def __init__(self, *args: Any, **kwargs: Any) -> None:
                instances.append(self)  # the extension's state exists already (mixin first)
                super().__init__(*args, **kwargs)

            def _new_result(self, request: Any) -> Any:
                # Upstream's GenerationResult does more work than the fake's (sampling and logprob
                # state, an asyncio queue): ``result_delay_s`` stands in for that time, between
                # upstream's check of the engine and the registration of the result.
                if result_delay_s:
                    time.sleep(result_delay_s)
                return super()._new_result(request)

            def dispatch_result_task(self) -> Any:
                # Likewise ``dispatch_delay_s`` stands in for upstream's heavier handling of each
                # response (its postprocessing, asyncio notifications) under load: the dispatch
                # thread falls behind a streaming leader, so responses wait in the result socket.
                if dispatch_delay_s:
                    time.sleep(dispatch_delay_s)
                return super().dispatch_result_task()

        proxy_module.GenerationExecutorProxy = Probe
        patch_tensorrt_llm(self.proxy_module)
        self.executor_cls = importlib.import_module("tensorrt_llm.executor.executor").GenerationExecutor

    def create(self, engine: dict[str, Any], **kwargs: Any) -> Any:
        return self.executor_cls.create(self.common.FakeEngine(**engine), model_world_size=2, **kwargs)


def identities(proxy: Any) -> list[list[int]]:
    monitor = proxy.liveness_monitor  # None with liveness off
    found = sorted(monitor.identities if monitor is not None else [], key=lambda identity: identity.rank)
    return [[identity.rank, identity.pid, identity.start_time] for identity in found]


def report_identities_when_known(built: Built, count: int, timeout: float) -> threading.Thread:
    """Emit the ranks' identities from a thread as soon as the extension registered them."""
    def run() -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if built.instances:
                found = identities(built.instances[0])
                if len(found) >= count:
                    emit({"identities": found})
                    return
            time.sleep(0.005)
        emit({"identities": None})

    thread = threading.Thread(target=run, name="report-identities", daemon=True)
    thread.start()
    return thread


def wait_fatal(proxy: Any, timeout: float) -> str | None:
    deadline = time.monotonic() + timeout
    while proxy.liveness_fatal_error is None and time.monotonic() < deadline:
        time.sleep(0.005)
    fatal = proxy.liveness_fatal_error
    return None if fatal is None else str(fatal)


def command(timeout: float) -> str:
    """The parent's next word on stdin ("" at end of input or past ``timeout``)."""
    import select

    ready, _, _ = select.select([sys.stdin], [], [], timeout)
    return sys.stdin.readline().strip() if ready else ""


def startup(options: dict[str, Any]) -> int:
    built = Built(str(options.get("tree", "main")))
    report_identities_when_known(built, 2, 60)
    try:
        executor = built.create({"token_delay_s": 0.01, "init_delay_s": float(options.get("init_delay_s", 4.0))})
    except Exception as exc:
        emit({"create_error": f"{type(exc).__name__}: {exc}", "at": time.monotonic()})
        command(60)  # the parent thaws what it froze first
        return 0
    proxy = built.instances[0]
    monitor = proxy.liveness_monitor
    emit({"created": type(executor).__name__, "ready_at": time.monotonic(),
          "fatal": None if proxy.liveness_fatal_error is None else str(proxy.liveness_fatal_error),
          "wedge_armed": monitor.wedge_armed, "events": [str(event) for event in proxy.liveness_events]})
    if command(60) == "watch":
        emit({"fatal": wait_fatal(proxy, float(options.get("watch_s", 15)))})
        command(60)
    executor.shutdown()
    return 0


def session(options: dict[str, Any]) -> int:
    built = Built(str(options.get("tree", "main")))
    passed_in = bool(options.get("passed_in"))
    abandoned: list[str] = []

    def counted(target: Any) -> None:
        original = target.abandon

        def abandon() -> None:
            abandoned.append(threading.current_thread().name)
            original()

        target.abandon = abandon

    own_session = built.session_module.MpiPoolSession(n_workers=2) if passed_in else None
    if own_session is not None:
        counted(own_session)
    executor = built.create({"token_delay_s": 0.01}, mpi_session=own_session)
    proxy = built.instances[0]
    if own_session is None:
        counted(proxy.mpi_session)
    results = [executor.generate_async([1, 2], max_tokens=100000) for _ in range(2)]
    time.sleep(0.2)
    kill_rank(proxy, 1)
    fatal = wait_fatal(proxy, 15)
    started = time.monotonic()
    executor.shutdown()
    emit({"fatal": fatal, "abandoned": len(abandoned), "abandoned_by": abandoned,
          "owns": getattr(proxy, "_owns_mpi_session", None), "shutdown_s": round(time.monotonic() - started, 3),
          "results": len(results)})
    if own_session is not None:  # the owner's own teardown of its dead world
        own_session.abandon()
    return 0


def exit_join(options: dict[str, Any]) -> int:
    built = Built(str(options.get("tree", "v12")))
    executor = built.create({"token_delay_s": 0.01})
    proxy = built.instances[0]
    emit({"identities": identities(proxy)})
    if command(60) != "watch":
        return 1
    emit({"fatal": wait_fatal(proxy, float(options.get("watch_s", 15)))})
    executor.shutdown()
    emit({"returning": time.monotonic(), "threads": [thread.name for thread in threading.enumerate()],
          "extension_threads": extension_threads()})
    return 0  # the interpreter exit: threading's exit joins, then atexit


class Violations(logging.Handler):
    """ZMQ thread-ownership errors in any log record (upstream's and the extension's loggers)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.seen: list[dict[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            text += " " + "".join(traceback.format_exception(record.exc_info[1]))
        if VIOLATION in text:
            self.seen.append({"thread": record.threadName or "?", "logger": record.name, "text": text[-1500:]})


def _signalled(report: Any) -> list[int]:
    """Ranks the bounded stop had to signal (none when each left by itself)."""
    if report is None:
        return []
    return [worker.rank for worker in report.workers if worker.outcome.name != "ALREADY_GONE"]


def sends(options: dict[str, Any]) -> int:
    violations = Violations()
    logging.getLogger().addHandler(violations)

    def excepthook(args: Any) -> None:
        text = "".join(traceback.format_exception(args.exc_value)) if args.exc_value is not None else ""
        if VIOLATION in text:
            violations.seen.append({"thread": getattr(args.thread, "name", "?"), "logger": "excepthook",
                                    "text": text[-1500:]})

    threading.excepthook = excepthook
    built = Built(str(options.get("tree", "main")))
    executor = built.create({"token_delay_s": 0.01})
    proxy = built.instances[0]
    submitted = rejected = 0
    for _ in range(4):
        executor.generate_async([1, 2], max_tokens=100000)
        submitted += 1
    if options.get("healthy"):
        # A healthy shutdown with requests in flight, from the thread that submitted them (the
        # request socket's owner): upstream's pre_shutdown() sends its cancellations and the stop
        # sentinel; from any other thread its debug mode raises.
        started = time.monotonic()
        executor.shutdown()
        emit({"violations": violations.seen, "fatal": None if proxy.liveness_fatal_error is None
              else str(proxy.liveness_fatal_error), "submitted": submitted,
              "debug": os.environ.get("TLLM_LLMAPI_ZMQ_DEBUG"),
              "signalled": _signalled(proxy.liveness_shutdown_report),
              "shutdown_s": round(time.monotonic() - started, 3)})
        return 0
    killer = threading.Timer(0.3, kill_rank, (proxy, int(options.get("rank", 1))))
    killer.start()
    deadline = time.monotonic() + 15
    after_fatal = 0
    while time.monotonic() < deadline and after_fatal < 50:
        try:
            executor.generate_async([3], max_tokens=4)
            submitted += 1
        except Exception as exc:
            if VIOLATION in str(exc):
                violations.seen.append({"thread": threading.current_thread().name, "logger": "submit",
                                        "text": str(exc)})
            rejected += 1
        if proxy.liveness_fatal_error is not None:
            after_fatal += 1
        time.sleep(0.002)
    killer.join(5)
    state = proxy.liveness_state
    state.fatal_path.done.wait(10)  # the fatal path's upstream pre_shutdown() has run (or was given up)
    executor.shutdown()
    emit({"violations": violations.seen, "fatal": None if proxy.liveness_fatal_error is None
          else str(proxy.liveness_fatal_error), "submitted": submitted, "rejected": rejected,
          "debug": os.environ.get("TLLM_LLMAPI_ZMQ_DEBUG"),
          "pre_shutdown_calls": proxy.liveness_state.pre_shutdown_entries})
    return 0


def late_register(options: dict[str, Any]) -> int:
    built = Built(str(options.get("tree", "v12")), float(options.get("result_delay_s", 0.0)))
    executor = built.create({"token_delay_s": 0.01})
    proxy = built.instances[0]
    lock = threading.Lock()
    returned: list[Any] = []
    rejected = [0]
    stop = threading.Event()

    def submitter() -> None:
        while not stop.is_set():
            try:
                result = executor.generate_async([1], max_tokens=100000)
            except Exception:
                with lock:
                    rejected[0] += 1
                continue
            with lock:
                returned.append(result)

    threads = [threading.Thread(target=submitter, name=f"submit-{i}", daemon=True)
               for i in range(int(options.get("threads", 16)))]
    for thread in threads:
        thread.start()
    time.sleep(0.3)
    kill_rank(proxy, 1)
    fatal = wait_fatal(proxy, 15)
    time.sleep(0.5)  # submits keep coming after the fatal error: each must be rejected
    stop.set()
    for thread in threads:
        thread.join(10)
    alive = [thread.name for thread in threads if thread.is_alive()]
    outcomes = {"error": 0, "done": 0}
    pending: list[int] = []
    result_s = float(options.get("result_s", 10))
    deadline = time.monotonic() + result_s
    for result in returned:
        try:
            result.result(timeout=max(0.01, deadline - time.monotonic()))
            outcomes["done"] += 1
        except Exception as exc:
            if type(exc).__name__ == "Empty":
                pending.append(result.request_id)
            else:
                outcomes["error"] += 1
    emit({"fatal": fatal, "submitted": len(returned), "rejected": rejected[0], "pending": pending,
          "errors": outcomes["error"], "done": outcomes["done"], "stuck_submitters": alive})
    executor.shutdown()
    return 0


SCENARIOS = {"startup": startup, "session": session, "exit_join": exit_join, "sends": sends,
             "late_register": late_register}


if __name__ == "__main__":  # mpi4py's workers import this module as __worker__: nothing may run then
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(threadName)s %(levelname)s %(name)s: %(message)s")
    opts = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
    sys.exit(SCENARIOS[str(opts.get("scenario"))](opts))
