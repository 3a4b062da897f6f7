"""A Dynamo worker for tests: serves an endpoint, watches the pids given in argv with liveness.

Usage: python dynamo_worker.py PID [PID ...]   (DYN_SYSTEM_PORT etc. come from the environment)
Prints "serving" once the endpoint is up. Exits through the liveness bridge after a death.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import AsyncIterator
from typing import Any

from dynamo.runtime import DistributedRuntime

from trtllm_liveness.integrations.dynamo import DynamoLivenessBridge
from trtllm_liveness.monitor import WorkerProcessMonitor
from trtllm_liveness.process import capture_identity


async def main(pids: list[int]) -> int:
    loop = asyncio.get_running_loop()
    runtime = DistributedRuntime(loop, "mem", "tcp")
    monitor = WorkerProcessMonitor()
    monitor.register([capture_identity(rank, pid) for rank, pid in enumerate(pids)])
    monitor.start()
    bridge = DynamoLivenessBridge(runtime, monitor, shutdown_timeout_s=5.0)
    bridge.attach()

    async def generate(request: Any, context: Any = None) -> AsyncIterator[dict[str, Any]]:
        yield {"echo": request}

    serving = asyncio.ensure_future(runtime.endpoint("test.worker.generate").serve_endpoint(generate))
    runtime.set_health_status(True)
    sys.stdout.write("serving\n")
    sys.stdout.flush()
    await serving  # ends when the bridge shuts the runtime down
    return 0  # the bridge's exit guard turns this into a non-zero status after a death


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    sys.exit(asyncio.run(main([int(arg) for arg in sys.argv[1:]])))
