"""A process serving Prometheus metrics the way trtllm-serve mounts ``/prometheus/metrics``.

Usage: python -m tests.programs.metrics_serve_child {early|late} PID [PID ...]

Upstream (``OpenAIServer.mount_metrics``) builds a fresh ``CollectorRegistry``, adds a
``MultiProcessCollector`` to it and mounts ``make_asgi_app(registry)`` at ``/prometheus/metrics``.
This child does the same and serves that ASGI app over real HTTP with a minimal asyncio server
standing in for uvicorn. It watches the given pids with a monitor and a ``LivenessMetrics``.

``early``: ``PROMETHEUS_MULTIPROC_DIR`` (from the environment) is set before prometheus_client's
first import (what a user sets for trtllm-serve). ``late``: prometheus_client is imported with the
variable removed, then the variable is restored (something imported prometheus_client first).

Prints one JSON line ``{"port": N, "multiprocess": bool}``, then serves until stdin says ``quit``
or closes (at most 120 s). A line ``expect`` calls ``monitor.mark_expected_exits()`` (answer:
``expecting``), a transition no event reports.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys

MODE = sys.argv[1]
if MODE == "late":
    saved = os.environ.pop("PROMETHEUS_MULTIPROC_DIR")
    import prometheus_client  # noqa: F401  (imported before the variable exists)

    os.environ["PROMETHEUS_MULTIPROC_DIR"] = saved

from prometheus_client import CollectorRegistry, make_asgi_app, multiprocess  # noqa: E402

from tests.support.asgi_serve import handle  # noqa: E402
from tests.support.stdin_control import serve_stdin_until_quit  # noqa: E402
from trtllm_liveness.integrations.prometheus import LivenessMetrics  # noqa: E402
from trtllm_liveness.monitor import WorkerProcessMonitor  # noqa: E402
from trtllm_liveness.process import capture_identity  # noqa: E402


async def main(pids: list[int]) -> int:
    monitor = WorkerProcessMonitor()
    monitor.register([capture_identity(rank, pid) for rank, pid in enumerate(pids)])
    monitor.start()
    metrics = LivenessMetrics(monitor, refresh_interval_s=0.1)
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    app = make_asgi_app(registry=registry)
    server = await asyncio.start_server(lambda r, w: handle(app, r, w), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    sys.stdout.write(json.dumps({"port": port, "multiprocess": metrics.multiprocess}) + "\n")
    sys.stdout.flush()

    def expect() -> str:  # a shutdown began: exits from now on change no counter
        monitor.mark_expected_exits()
        return "expecting"

    try:
        await serve_stdin_until_quit(120, {"expect": expect})
    finally:
        server.close()
        await server.wait_closed()
        metrics.close()
        monitor.close()
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    sys.exit(asyncio.run(main([int(arg) for arg in sys.argv[2:]])))
