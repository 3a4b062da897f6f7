"""A stock Dynamo TRT-LLM worker over the reference executor: the REAL ``TrtllmEngineMonitor``.

Usage: ``python -m tests.programs.dynamo_stock_worker '{"mode": "1.2", "liveness": true}'`` from
the repository root, in a new session (it starts MPI). Builds the reference executor (with or
without the liveness extension), wraps it like Dynamo does (``FakeLLM`` in a
``DynamoShapedEngine``), starts ``dynamo.trtllm.engine_monitor.TrtllmEngineMonitor`` from the
installed ai-dynamo wheel with its default poll settings, puts requests in flight and prints one
JSON line with the ranks' identities. Nothing of this package's Dynamo module is used: the exit,
if any, is Dynamo's own ``exit_worker_on_fatal_error`` -> ``os._exit(1)``.

If nothing ends it within ``max_life_s``, it stops its workers and exits with status 3.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import sys
import tempfile
from typing import Any

from tests.support.ref_engine import DynamoShapedEngine, FakeLLM, build_executor, emit, read_identities
from trtllm_liveness.demo._mpi_env import configure_mpi_env

NOT_ENDED = 3


async def main(options: dict[str, Any]) -> int:
    from dynamo.trtllm.engine_monitor import TrtllmEngineMonitor

    mode = options.get("mode", "1.2")
    workers = int(options.get("workers", 2))
    announce = tempfile.mkdtemp(prefix="trtllm-stock-dynamo-")
    try:
        executor = await asyncio.to_thread(
            build_executor, mode, announce, workers=workers, liveness=bool(options.get("liveness", True)))
        identities = read_identities(announce, workers)
    finally:
        shutil.rmtree(announce, ignore_errors=True)
    # 1.2.x's LLM has _check_health (not is_shutdown()); for main, Dynamo falls back to
    # llm._executor.check_health.
    llm = FakeLLM(executor, "is_shutdown" if mode == "1.2" else None)
    engine = DynamoShapedEngine(llm)
    monitor = TrtllmEngineMonitor(engine, runtime=None, shutdown_event=asyncio.Event(),
                                  interval=options.get("interval"))
    results = [executor.generate_async([rank] * 2000) for rank in range(3)]
    emit({"ready": True, "mode": mode, "supports_health_check": engine.supports_health_check(),
          "identities": [list(identity) for identity in identities]})
    await asyncio.sleep(float(options.get("max_life_s", 60)))
    # Still alive: the monitor never acted (the baseline without the extension, 1.2.x).
    await monitor.stop()
    emit({"ended": "max_life_s", "pending": sum(1 for r in results if not r.done)})
    from trtllm_liveness.stop._bounded_stop import stop_processes

    stop_processes(identities, grace_s=0.0, kill_s=2.0)
    return NOT_ENDED


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    configure_mpi_env()
    code = asyncio.run(main(json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}))
    logging.shutdown()
    sys.stdout.flush()
    os._exit(code)  # no MPI/atexit join may hang a dead world
