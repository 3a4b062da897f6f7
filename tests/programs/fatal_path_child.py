"""Child process: the fatal path and the interpreter exit on an upstream-shaped fake ``tensorrt_llm``.

Usage: ``python -m tests.programs.fatal_path_child '{"scenario": "kill" | "clean_exit", ...}'``
with ``TRTLLM_WORKER_LIVENESS`` configuring the extension (installed as ``trtllm-serve`` gets it:
``patch_tensorrt_llm`` on upstream's proxy module). The engine is built with upstream's own
``GenerationExecutor.create(FakeEngine(...), model_world_size=2)`` on the fake tree ``tree``
(``"main"`` default, or ``"v12"``): real MPI ranks, upstream's PAIR sockets with blocking sends,
``threading._register_atexit(pre_shutdown)`` and ``atexit(shutdown)``.

``kill``: two requests stream, then rank ``rank`` is SIGKILLed (through a verified pidfd); a
thread plays trtllm-serve's ``/health`` on main without PR #19029 (SIGINT when ``_fatal_error and
not doing_shutdown``) every 5 ms. Emits ``{"published": ..., "failed": ...}`` once the error is
published and the requests failed, and writes every SIGINT to stderr (``SIGINT #n``); the first
one makes the main thread return (what uvicorn does) after ``{"sigints": n}``, so the exit status
is the guard's.
``wait`` chooses how the main thread waits for it: ``"event"`` (``threading.Event.wait``, a lock
wait that only a signal delivered to the main thread interrupts) or ``"wakeup"`` (a wakeup fd and
``select``, as an asyncio server such as uvicorn waits: any thread's delivery wakes it).
``clean_exit``: one request completes, then the script ends without ``shutdown()``; the fatal
state seen at the very end of the interpreter exit goes to stderr as JSON.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import select
import signal
import sys
import threading
import time
from typing import Any

from tests.support.ref_engine import emit
from tests.support.upstream_fakes import kill_rank, use_tree


def build(tree: str, **engine: Any) -> Any:
    """Upstream's ``create()`` on the fake ``tree`` with the extension installed as the import hook does."""
    use_tree(tree)
    from trtllm_liveness.demo._mpi_env import configure_mpi_env

    configure_mpi_env()
    import importlib

    from trtllm_liveness.integrations.trtllm import patch_tensorrt_llm

    proxy_module = importlib.import_module("tensorrt_llm.executor.proxy")
    patch_tensorrt_llm(proxy_module)
    executor_cls = importlib.import_module("tensorrt_llm.executor.executor").GenerationExecutor
    fake_engine = importlib.import_module("_trtllm_fake_common").FakeEngine
    return executor_cls.create(fake_engine(**engine), model_world_size=2)


class Outcome:
    """What ``result()`` of one request ended with, from a thread of its own (bounded)."""

    def __init__(self, result: Any, timeout: float) -> None:
        self.error: str | None = None
        self.done = threading.Event()
        threading.Thread(target=self._wait, args=(result, timeout), daemon=True).start()

    def _wait(self, result: Any, timeout: float) -> None:
        try:
            result.result(timeout=timeout)
        except BaseException as exc:  # queue.Empty past the timeout, or the engine's error
            self.error = f"{type(exc).__name__}: {exc}"
        self.done.set()


def main(options: dict[str, Any]) -> int:
    holder: list[Any] = []

    def last_word() -> None:  # registered first, so atexit runs it last
        executor = holder[0] if holder else None
        fatal = getattr(executor, "liveness_fatal_error", None)
        state = getattr(executor, "liveness_state", None)
        sys.stderr.write(json.dumps({"atexit_fatal": None if fatal is None else str(fatal),
                                     "pre_shutdown_entries": getattr(state, "pre_shutdown_entries", None)})
                         + "\n")
        sys.stderr.flush()

    atexit.register(last_word)
    executor = build(str(options.get("tree", "main")), token_delay_s=0.01)
    holder.append(executor)
    if options.get("scenario") == "clean_exit":
        tokens = executor.generate_async([1, 2, 3], max_tokens=4).result(timeout=30).token_ids
        emit({"ready": True, "tokens": len(tokens)})
        return 0  # no shutdown(): upstream's atexit hooks run
    interrupted = threading.Event()
    sigints = 0
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    os.set_blocking(read_fd, False)

    def on_sigint(signum: int, frame: Any) -> None:
        nonlocal sigints
        sigints += 1
        sys.stderr.write(f"SIGINT #{sigints} (handler in {threading.current_thread().name})\n")
        interrupted.set()

    signal.signal(signal.SIGINT, on_sigint)
    if options.get("wait") == "wakeup":
        signal.set_wakeup_fd(write_fd)
    results = [executor.generate_async([rank] * 4, max_tokens=100000) for rank in range(2)]
    outcomes = [Outcome(result, 20.0) for result in results]

    def health() -> None:
        while not interrupted.is_set():
            if getattr(executor, "_fatal_error", None) and not executor.doing_shutdown:
                signal.raise_signal(signal.SIGINT)
            time.sleep(0.005)

    threading.Thread(target=health, name="health", daemon=True).start()
    time.sleep(0.2)  # the requests are streaming
    kill_rank(executor, int(options.get("rank", 0)))
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if executor._fatal_error is not None and all(outcome.done.is_set() for outcome in outcomes):
            break
        time.sleep(0.005)
    emit({"published": executor._fatal_error is not None and str(executor._fatal_error),
          "failed": sum(1 for outcome in outcomes if outcome.error is not None and "rank" in outcome.error),
          "errors": [outcome.error for outcome in outcomes]})
    if options.get("wait") == "wakeup":
        deadline = time.monotonic() + 30
        while not interrupted.is_set() and time.monotonic() < deadline:
            select.select([read_fd], [], [], max(0.0, deadline - time.monotonic()))
            while True:
                try:
                    if not os.read(read_fd, 512):
                        break
                except (BlockingIOError, InterruptedError):
                    break
    else:
        interrupted.wait(30)
    emit({"sigints": sigints})
    return 0  # as uvicorn after a graceful stop: the guard turns it into exit_code


if __name__ == "__main__":  # mpi4py's workers import this module as __worker__: nothing may run then
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(threadName)s %(levelname)s %(name)s: %(message)s")
    sys.exit(main(json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}))
