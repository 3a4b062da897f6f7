"""A Dynamo worker serving the reference executor, with the liveness bridge (``attach_to_dynamo``).

Usage: ``python -m tests.programs.dynamo_engine_worker '<json options>'`` from the repository
root, in a new session, with ``DYN_SYSTEM_PORT``, ``DYN_SYSTEM_HOST=127.0.0.1`` and
``DYN_TCP_RPC_HOST=127.0.0.1`` in the environment. The real ``DistributedRuntime`` (``mem``
discovery, ``tcp`` request plane) serves ``test.worker.generate``, whose handler submits each
request to the reference executor and streams its tokens. Before reporting ready, the worker
calls its own endpoint through a Dynamo client (one round trip through the request plane).

Options: ``mode`` (``1.2``/``main``), ``iterations`` (default 1), ``shutdown_delay_s``,
``shutdown_timeout_s``, ``liveness`` (more of the executor's liveness configuration, e.g.
``stall_timeout_s``). Per iteration it prints ``{"ready": ..., "identities": ...}``; every
iteration but the last is a rehearsal for the benchmark: the bridge is real except that
``runtime.shutdown()`` and the process exit are withheld; after the parent has seen the 503 it
writes a line on stdin, and the worker stops that executor, sets the health back to ready and
starts the next one. The last iteration is the real thing: the bridge shuts the runtime down and
the process exits non-zero.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import sys
import tempfile
from collections.abc import AsyncIterator
from typing import Any

from tests.support.ref_engine import build_executor, emit, read_identities
from trtllm_liveness.demo._mpi_env import configure_mpi_env
from trtllm_liveness.integrations.dynamo import DynamoLivenessBridge, attach_to_dynamo, liveness_monitor_of

ENDPOINT = "test.worker.generate"


class _RehearsalRuntime:
    """The runtime for a rehearsal bridge: health and routes are real, shutdown is withheld."""

    def __init__(self, runtime: Any) -> None:
        self._runtime = runtime

    def set_health_status(self, ready: bool) -> None:
        self._runtime.set_health_status(ready)

    def register_engine_route(self, route_name: str, callback: Any) -> None:
        self._runtime.register_engine_route(route_name, callback)

    def shutdown(self) -> None:
        logging.getLogger(__name__).info("rehearsal: runtime shutdown withheld")


async def main(options: dict[str, Any]) -> int:
    from dynamo.runtime import DistributedRuntime

    mode = options.get("mode", "main")
    iterations = int(options.get("iterations", 1))
    loop = asyncio.get_running_loop()
    runtime = DistributedRuntime(loop, "mem", "tcp")
    current: dict[str, Any] = {}

    async def generate(request: Any, context: Any = None) -> AsyncIterator[dict[str, Any]]:
        result = current["executor"].generate_async(list(request["tokens"]))
        sent = 0
        while True:
            done = result.done
            tokens = list(result.tokens)
            if len(tokens) > sent:
                yield {"tokens": tokens[sent:]}
                sent = len(tokens)
            if done:
                break
            await asyncio.sleep(0.005)
        if result.error is not None:
            yield {"error": str(result.error)}

    serving: Any = None
    for iteration in range(iterations):
        final = iteration == iterations - 1
        announce = tempfile.mkdtemp(prefix="trtllm-dynamo-engine-")
        try:
            executor = await asyncio.to_thread(build_executor, mode, announce,
                                               options={"shutdown_grace_s": 2.0, **options.get("liveness", {})})
            identities = read_identities(announce, 2)
        finally:
            shutil.rmtree(announce, ignore_errors=True)
        current["executor"] = executor
        if final:
            bridge = attach_to_dynamo(executor, runtime,
                                      shutdown_timeout_s=float(options.get("shutdown_timeout_s", 10)),
                                      shutdown_delay_s=float(options.get("shutdown_delay_s", 0)))
        else:
            bridge = DynamoLivenessBridge(_RehearsalRuntime(runtime), liveness_monitor_of(executor), route=None,
                                          exit_fn=lambda code: None)
            bridge.attach()
        if serving is None:
            serving = asyncio.ensure_future(runtime.endpoint(ENDPOINT).serve_endpoint(generate))
        runtime.set_health_status(True)
        client = await runtime.endpoint(ENDPOINT).client()
        await asyncio.wait_for(client.wait_for_instances(), 20)
        streamed: list[int] = []
        stream = await asyncio.wait_for(client.round_robin({"tokens": [7, 8, 9]}), 20)
        async for item in stream:
            data = item.data() if hasattr(item, "data") else item
            streamed.extend(data.get("tokens", []))
        in_flight = [executor.generate_async([rank] * 2000) for rank in range(2)]
        emit({"ready": True, "iteration": iteration, "final": final, "streamed": streamed,
              "in_flight": len(in_flight), "identities": [list(identity) for identity in identities]})
        if not final:
            line = await asyncio.to_thread(sys.stdin.readline)
            if not line:
                return 4
            await asyncio.to_thread(executor.shutdown)
            bridge.guard.disarm()
            continue
        await serving  # ends when the bridge shuts the runtime down
        await asyncio.to_thread(executor.shutdown)  # bounded: stops the surviving rank
        emit({"served_until_shutdown": True, "triggered": bridge.guard.triggered})
    return 0  # the bridge's exit guard turns this into a non-zero status after an engine death


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    configure_mpi_env()
    # A plain exit, not os._exit: the bridge's atexit hook must get to turn it into its status.
    sys.exit(asyncio.run(main(json.loads(sys.argv[1]) if len(sys.argv) > 1 else {})))
