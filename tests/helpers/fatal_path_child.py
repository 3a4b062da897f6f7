"""Child process: the fatal path and the interpreter exit against tests/helpers/upstream_shaped.py.

Usage: ``python -m tests.helpers.fatal_path_child '{"scenario": "kill" | "clean_exit", ...}'``
with ``TRTLLM_WORKER_LIVENESS`` configuring the extension. ``module`` (option) names the
integration module to load (default ``trtllm_liveness.integrations.trtllm``), so the same child
can be pointed at a copy of an older integration to show a test fails there.

``kill``: two pending requests, then rank ``rank`` is SIGKILLed; a thread plays trtllm-serve's
``/health`` (main without PR #19029: SIGINT when ``_fatal_error and not doing_shutdown``) every
5 ms. Emits ``{"published": ..., "failed": ...}`` once the error is published and the requests
failed, and counts every SIGINT on stderr (``SIGINT #n``); the first SIGINT makes the main thread
return (what uvicorn does), so the exit status is the guard's. ``clean_exit``: the script ends
without ``shutdown()``; emits the fatal state seen by the atexit path on stderr.
"""

from __future__ import annotations

import atexit
import importlib
import json
import logging
import signal
import sys
import threading
import time
from typing import Any

from tests.helpers.ref_engine import emit
from tests.helpers.upstream_shaped import UpstreamMainShaped


def main(options: dict[str, Any]) -> int:
    integ = importlib.import_module(str(options.get("module", "trtllm_liveness.integrations.trtllm")))
    cls = integ.liveness_proxy_class(UpstreamMainShaped, default_enabled=True)
    holder: list[Any] = []

    def last_word() -> None:  # registered first, so atexit runs it last
        fatal = holder[0].liveness_fatal_error if holder else None
        sys.stderr.write(json.dumps({"atexit_fatal": None if fatal is None else str(fatal),
                                     "pre_shutdown_entries": UpstreamMainShaped.pre_shutdown_entries}) + "\n")
        sys.stderr.flush()

    atexit.register(last_word)
    proxy = cls({"llm_args": None}, model_world_size=2)
    holder.append(proxy)
    interrupted = threading.Event()
    sigints = 0

    def on_sigint(signum: int, frame: Any) -> None:
        nonlocal sigints
        sigints += 1
        sys.stderr.write(f"SIGINT #{sigints}\n")
        interrupted.set()

    signal.signal(signal.SIGINT, on_sigint)
    try:
        if options.get("scenario") == "clean_exit":
            emit({"ready": True})
            return 0  # no shutdown(): upstream's atexit hooks run
        results = proxy.add_pending(2)

        def health() -> None:
            while not interrupted.is_set():
                if getattr(proxy, "_fatal_error", None) and not proxy.doing_shutdown:
                    signal.raise_signal(signal.SIGINT)
                time.sleep(0.005)

        threading.Thread(target=health, daemon=True).start()
        proxy.kill_worker(int(options.get("rank", 0)))
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            failed = sum(1 for r in results if not r.queue.empty())
            if proxy._fatal_error is not None and failed == len(results):
                break
            time.sleep(0.005)
        emit({"published": proxy._fatal_error is not None and str(proxy._fatal_error),
              "failed": sum(1 for r in results if not r.queue.empty())})
        interrupted.wait(30)
        return 0  # as uvicorn after a graceful stop: the guard turns it into exit_code
    finally:
        if options.get("scenario") != "clean_exit":
            proxy.reap_workers()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sys.exit(main(json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}))
