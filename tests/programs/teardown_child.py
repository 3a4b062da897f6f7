"""Child process: what a user sees of upstream's own threads and teardown after a rank is SIGKILLed.

Usage: ``python -m tests.programs.teardown_child '{"tree": "v12" | "main", "rank": 0 | 1, "requests": 8,
"dispatch_delay_s": 0.002, "fault": "kill" | "stall" | "none"}'``
with ``TRTLLM_WORKER_LIVENESS`` configuring the extension. The engine is built with upstream's own
``GenerationExecutor.create(FakeEngine(...), model_world_size=2)`` on real MPI ranks (see
``lifecycle_child.Built``); ``requests`` streaming requests run until every one has received
responses (with ``dispatch_delay_s`` the dispatch thread lags behind the leader, so responses wait
in the result socket, as under load), then rank ``rank`` is SIGKILLed (by verified pid; ``fault``
"stall": it stops making progress in its step loop instead, for a fatal stall verdict), the fatal
error and the failure of every pending request are awaited, and ``shutdown()`` runs (``fault``
"none": at once, on the healthy engine with its requests in flight).

Emits two JSON lines on stdout:

- ``{"after_shutdown": [names], "fatal": ..., "failed": n, "upstream_errors": [...],
  "teardown_warnings": [...], "abandon_notes": [...]}`` as soon as ``shutdown()`` returned:
  ``after_shutdown`` names every thread of upstream's teardown still alive then (upstream's own
  ``proxy_*`` threads and the extension's thread that runs upstream's ``shutdown()``), and
  ``extension_threads`` every thread the extension started that is still alive then;
- ``{"left": [names], "upstream_errors": [...], ...}`` once those threads ended (or after
  ``linger_s``): what they logged after ``shutdown()`` returned is counted too.

``upstream_errors`` holds every log record at ERROR or above from upstream's logger
(``tensorrt_llm``) or from a thread of upstream's, and every exception that ended such a thread,
each as ``{"thread", "logger", "level", "lines", "text"}`` (``lines``: how many lines it printed,
traceback included).
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
import traceback
from typing import Any

from tests.programs.lifecycle_child import Built, wait_fatal
from tests.support.ref_engine import emit, extension_threads
from tests.support.upstream_fakes import kill_rank
from trtllm_liveness.integrations.trtllm._engine_shutdown import UPSTREAM_SHUTDOWN_THREAD

UPSTREAM_LOGGER = "tensorrt_llm"
UPSTREAM_THREAD_PREFIX = "proxy_"  # upstream's proxy names its threads proxy_dispatch_result_thread, ...
TEARDOWN_WARNINGS = ("upstream shutdown still blocked", "upstream shutdown raised", "has no abandon()")
ABANDON_NOTE = "has no abandon()"


def upstream_thread(name: str) -> bool:
    return name.startswith(UPSTREAM_THREAD_PREFIX) or name == UPSTREAM_SHUTDOWN_THREAD


class Seen(logging.Handler):
    """Every record this program reports on, kept in order."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.upstream_errors: list[dict[str, Any]] = []
        self.teardown_warnings: list[str] = []
        self.abandon_notes: list[dict[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            text += "\n" + "".join(traceback.format_exception(record.exc_info[1])).rstrip()
        thread = record.threadName or "?"
        upstream = record.name == UPSTREAM_LOGGER or record.name.startswith(UPSTREAM_LOGGER + ".")
        if record.levelno >= logging.ERROR and (upstream or upstream_thread(thread)):
            self.upstream_errors.append({"thread": thread, "logger": record.name, "level": record.levelname,
                                         "lines": len(text.splitlines()), "text": text[-1500:]})
        if record.name.startswith("trtllm_liveness") and record.levelno >= logging.WARNING and any(
                marker in text for marker in TEARDOWN_WARNINGS):
            self.teardown_warnings.append(text)
        if ABANDON_NOTE in text:
            self.abandon_notes.append({"level": record.levelname, "text": text})

    def excepthook(self, args: Any) -> None:
        name = getattr(args.thread, "name", "?")
        if upstream_thread(name) and args.exc_value is not None:
            text = "".join(traceback.format_exception(args.exc_value)).rstrip()
            self.upstream_errors.append({"thread": name, "logger": "excepthook", "level": "UNCAUGHT",
                                         "lines": len(text.splitlines()), "text": text[-1500:]})

    def report(self) -> dict[str, Any]:
        return {"upstream_errors": list(self.upstream_errors), "teardown_warnings": list(self.teardown_warnings),
                "abandon_notes": list(self.abandon_notes)}


def teardown_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if upstream_thread(thread.name) and thread.is_alive()]


def wait_streaming(results: list[Any], timeout: float) -> bool:
    """True once every request has received at least one response (tokens are flowing)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(result.queue.qsize() > 0 or result.token_ids for result in results):
            return True
        time.sleep(0.005)
    return False


def main(options: dict[str, Any]) -> int:
    seen = Seen()
    logging.getLogger().addHandler(seen)
    threading.excepthook = seen.excepthook
    built = Built(str(options.get("tree", "v12")), dispatch_delay_s=float(options.get("dispatch_delay_s", 0.0)))
    fault, rank = str(options.get("fault", "kill")), int(options.get("rank", 1))
    engine: dict[str, Any] = {"token_delay_s": 0.01}
    if fault == "stall":
        engine.update(step_acks=True, stall={"rank": rank, "kind": "block", "after_tokens": 5})
    executor = built.create(engine)
    proxy = built.instances[0]
    results = [executor.generate_async([1, 2], max_tokens=10**6, streaming=True)
               for _ in range(int(options.get("requests", 4)))]
    streaming = wait_streaming(results, 30)
    fatal, failed = None, 0
    if fault != "none":
        if fault == "kill":
            kill_rank(proxy, rank)
        fatal = wait_fatal(proxy, 30)
        for result in results:
            try:
                result.result(timeout=10)
            except Exception as exc:
                failed += type(exc).__name__ != "Empty"
    executor.shutdown()
    emit({"after_shutdown": [thread.name for thread in teardown_threads()], "extension_threads": extension_threads(),
          "fatal": fatal, "failed": failed, "requests": len(results), "streaming": streaming, **seen.report()})
    deadline = time.monotonic() + float(options.get("linger_s", 15))
    for thread in teardown_threads():
        thread.join(max(0.0, deadline - time.monotonic()))
    emit({"left": [thread.name for thread in teardown_threads()], **seen.report()})
    return 0


if __name__ == "__main__":  # mpi4py's workers import this module as __worker__: nothing may run then
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(threadName)s %(levelname)s %(name)s: %(message)s")
    sys.exit(main(json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}))
