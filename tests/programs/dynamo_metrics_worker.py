"""A Dynamo worker for tests whose system ``/metrics`` carries the liveness metrics.

Usage: python -m tests.programs.dynamo_metrics_worker PID [PID ...]   (DYN_SYSTEM_PORT etc. come from the environment)
Watches the pids with a monitor, exposes its metrics with ``expose_metrics_on_dynamo`` on the
endpoint it serves, prints "serving", and shuts the runtime down when stdin says ``quit`` or
closes (at most 120 s). No liveness bridge: a death changes the metrics, not the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from collections.abc import AsyncIterator
from typing import Any

from dynamo.runtime import DistributedRuntime

from tests.support.stdin_control import serve_stdin_until_quit
from trtllm_liveness.integrations.dynamo import expose_metrics_on_dynamo
from trtllm_liveness.monitor import WorkerProcessMonitor
from trtllm_liveness.process import capture_identity


async def main(pids: list[int]) -> int:
    loop = asyncio.get_running_loop()
    runtime = DistributedRuntime(loop, "mem", "tcp")
    monitor = WorkerProcessMonitor()
    monitor.register([capture_identity(rank, pid) for rank, pid in enumerate(pids)])
    monitor.start()
    endpoint = runtime.endpoint("test.worker.generate")
    metrics = expose_metrics_on_dynamo(endpoint, monitor)

    async def generate(request: Any, context: Any = None) -> AsyncIterator[dict[str, Any]]:
        yield {"echo": request}

    serving = asyncio.ensure_future(endpoint.serve_endpoint(generate))
    runtime.set_health_status(True)
    sys.stdout.write("serving\n")
    sys.stdout.flush()
    try:
        await serve_stdin_until_quit(120)
    finally:
        runtime.shutdown()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(serving, 10)
        metrics.close()
        monitor.close()
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    sys.exit(asyncio.run(main([int(arg) for arg in sys.argv[1:]])))
