"""A stand-in for ``trtllm-serve`` over the reference executor: stdlib HTTP, upstream's ``/health``.

Usage: ``python -m tests.programs.serve_worker '{"mode": "main"}'`` from the repository root, in a
new session. The liveness extension is configured only by ``TRTLLM_WORKER_LIVENESS`` (as with
the import hook under ``trtllm-serve``), e.g. ``exit_on_fatal=1,exit_code=3``.

``GET /health`` follows trtllm-serve (main, Aug-Sep 2026) as docs/upstream-contract.md describes it: 200 when
``llm._check_health()``; otherwise, if the executor recorded a fatal error **and not**
``doing_shutdown``, raise SIGINT (the buggy condition of TensorRT-LLM issue #18663: after a killed
rank ``pre_shutdown()`` has already set ``doing_shutdown``, so it never fires), and answer 503.
SIGINT is what uvicorn treats as "shut down gracefully": the first one stops the HTTP server;
``main`` then shuts the executor down (bounded by the extension) and returns 0. Every SIGINT is
logged as ``graceful shutdown requested (SIGINT #n)`` so a test can count them.

``GET /state`` (test instrumentation, not in trtllm-serve) answers ``{"fatal": ..., "doing_shutdown":
...}`` without side effects, so a test can wait for the fatal state to settle without probing
``/health`` (whose SIGINT condition is racy upstream: a probe between the fatal error and
``pre_shutdown()`` would fire it).

Prints ``{"ready": true, "port": ..., "identities": [...]}`` once serving.
"""

from __future__ import annotations

import json
import logging
import shutil
import signal
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tests.support.ref_engine import FakeLLM, build_executor, emit, read_identities
from trtllm_liveness.demo._mpi_env import configure_mpi_env

logger = logging.getLogger("serve_worker")


def make_handler(llm: FakeLLM) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/state":  # test instrumentation, not trtllm-serve: read-only, never signals
                executor = llm._executor
                state = {"fatal": getattr(executor, "_fatal_error", None) is not None,
                         "doing_shutdown": bool(getattr(executor, "doing_shutdown", False))}
                self._answer(200, json.dumps(state).encode())
                return
            if self.path != "/health":
                self._answer(404, b"not found")
                return
            if llm._check_health():
                self._answer(200, b"")
                return
            executor = llm._executor
            if getattr(executor, "_fatal_error", None) and not executor.doing_shutdown:
                signal.raise_signal(signal.SIGINT)
            self._answer(503, b"LLM is unavailable. Please check the server logs for more details.")

        def _answer(self, status: int, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            del format, args

    return Handler


def main(options: dict[str, Any]) -> int:
    mode = options.get("mode", "main")
    announce = tempfile.mkdtemp(prefix="trtllm-serve-")
    try:
        executor = build_executor(mode, announce, liveness=None)
        identities = read_identities(announce, 2)
    finally:
        shutil.rmtree(announce, ignore_errors=True)
    llm = FakeLLM(executor, "executor")
    server = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(llm))
    server.daemon_threads = True
    sigints = 0

    def on_sigint(signum: int, frame: Any) -> None:
        nonlocal sigints
        sigints += 1
        logger.warning("graceful shutdown requested (SIGINT #%d)", sigints)
        if sigints == 1:
            threading.Thread(target=server.shutdown, name="serve-shutdown", daemon=True).start()

    signal.signal(signal.SIGINT, on_sigint)
    in_flight = [executor.generate_async([rank] * 2000) for rank in range(2)]
    emit({"ready": True, "port": server.server_address[1], "in_flight": len(in_flight),
          "exit_guard": getattr(getattr(executor, "liveness_state", None), "exit_guard", None) is not None,
          "identities": [list(identity) for identity in identities]})
    server.serve_forever(poll_interval=0.05)
    server.server_close()
    logger.warning("HTTP server stopped; shutting the executor down")
    executor.shutdown()
    logger.warning("graceful shutdown finished")
    return 0  # what uvicorn returns after a graceful shutdown; the exit guard makes it non-zero


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    configure_mpi_env()
    sys.exit(main(json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}))
