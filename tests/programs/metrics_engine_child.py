"""An engine on the main fake with liveness on and ``return_perf_metrics``, its metrics served the
way trtllm-serve serves ``/prometheus/metrics`` (a fresh registry holding only a
``MultiProcessCollector``; see tests/programs/metrics_serve_child.py for the serving part).

Usage: ``python -m tests.programs.metrics_engine_child`` with the fake on ``PYTHONPATH``,
``TRTLLM_WORKER_LIVENESS`` set and (or not) ``PROMETHEUS_MULTIPROC_DIR``. Nothing here creates
``LivenessMetrics``: the extension must do it when the engine starts. Prints one JSON line
``{"port": N | null, "ranks": {rank: pid}, "prometheus_imported": bool}``, then serves until stdin
says ``quit`` or closes (at most 120 s); ``port`` is null without the variable (no page).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys

from tests.support.asgi_serve import handle
from tests.support.stdin_control import serve_stdin_until_quit
from trtllm_liveness.demo._mpi_env import configure_mpi_env


async def main() -> int:
    configure_mpi_env()
    import tensorrt_llm  # the fake (PYTHONPATH)
    from _trtllm_fake_common import FakeEngine  # on sys.path once the fake is imported

    from trtllm_liveness.integrations.trtllm import liveness_executor_class

    llm = tensorrt_llm.LLM(FakeEngine(), executor_cls=liveness_executor_class(), tensor_parallel_size=2,
                           return_perf_metrics=True)
    try:
        monitor = llm._executor.liveness_state.monitor
        ranks = {identity.rank: identity.pid for identity in monitor.identities}
        imported = "prometheus_client" in sys.modules  # before this child serves anything
        port = None
        server = None
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            from prometheus_client import CollectorRegistry, make_asgi_app, multiprocess

            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
            app = make_asgi_app(registry=registry)
            server = await asyncio.start_server(lambda r, w: handle(app, r, w), "127.0.0.1", 0)
            port = server.sockets[0].getsockname()[1]
        sys.stdout.write(json.dumps({"port": port, "ranks": ranks, "prometheus_imported": imported}) + "\n")
        sys.stdout.flush()
        try:
            await serve_stdin_until_quit(120, {})
        finally:
            if server is not None:
                server.close()
                await server.wait_closed()
    finally:
        llm.shutdown()
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    sys.exit(asyncio.run(main()))
