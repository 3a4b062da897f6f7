"""Child process: every entry point a user calls, with liveness switched off by the environment.

Options (JSON argv[1]): ``tree`` (``v12`` or ``main``). Run with ``TRTLLM_WORKER_LIVENESS`` set to
an off value by the test. In order, as a Dynamo worker written from the docs would call them:
the autoload (``import trtllm_liveness.integrations.trtllm_autoload``), the README's in-code form
``LLM(FakeEngine(), executor_cls=liveness_executor_class(config=LivenessConfig(enabled=True,
stall_timeout_s=120)), tensor_parallel_size=2)`` on real MPI ranks, one request, then
``attach_to_dynamo(llm, runtime)`` and ``expose_metrics_on_dynamo(endpoint, llm)`` with a runtime
and an endpoint that record every call. Prints one JSON line (``emit``) with what it saw, then
``{"done": true}`` after ``llm.shutdown()``. Every log record of the package goes to stderr.
"""

from __future__ import annotations

import importlib
import json
import logging
import sys
import threading
from typing import Any

from tests.support.ref_engine import emit
from tests.support.upstream_fakes import use_tree


class RecordingRuntime:
    """The part of Dynamo's ``DistributedRuntime`` the bridge uses; records every call."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def set_health_status(self, ready: bool) -> None:
        self.calls.append(f"set_health_status({ready})")

    def register_engine_route(self, route_name: str, callback: Any) -> None:
        self.calls.append(f"register_engine_route({route_name})")

    def shutdown(self) -> None:
        self.calls.append("shutdown()")


class RecordingEndpoint:
    """A Dynamo ``Endpoint``'s ``metrics.register_prometheus_expfmt_callback``; records each call."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.metrics = self

    def register_prometheus_expfmt_callback(self, callback: Any) -> None:
        self.calls.append("register_prometheus_expfmt_callback")


def main() -> None:
    options = json.loads(sys.argv[1])
    logging.basicConfig(stream=sys.stderr, level=logging.DEBUG, format="LOG %(levelname)s %(name)s: %(message)s")
    for noisy in ("asyncio",):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    use_tree(options["tree"])
    from trtllm_liveness.demo._mpi_env import configure_mpi_env

    configure_mpi_env()
    import trtllm_liveness.integrations.trtllm_autoload  # noqa: F401  # what the .pth line would do

    hooked = getattr(sys.meta_path[0], "_target", None) == "tensorrt_llm.executor.proxy"
    from tensorrt_llm import LLM  # type: ignore[import-not-found]  # the fake, put first on sys.path

    from trtllm_liveness import LivenessConfig
    from trtllm_liveness.integrations.dynamo import attach_to_dynamo, expose_metrics_on_dynamo
    from trtllm_liveness.integrations.trtllm import LivenessProxyMixin, liveness_executor_class

    fake_engine = importlib.import_module("_trtllm_fake_common").FakeEngine
    llm = LLM(fake_engine(), executor_cls=liveness_executor_class(config=LivenessConfig(enabled=True,
                                                                                          stall_timeout_s=120)),
              tensor_parallel_size=2)
    try:
        executor = llm._executor
        tokens = len(llm.generate_async([1, 2, 3], max_tokens=4).result(timeout=60).token_ids)
        runtime, endpoint = RecordingRuntime(), RecordingEndpoint()
        bridge = attach_to_dynamo(llm, runtime)
        metrics = expose_metrics_on_dynamo(endpoint, llm)
        emit({"hooked": hooked, "executor": type(executor).__name__,
              "liveness_class": isinstance(executor, LivenessProxyMixin),
              "monitor": getattr(executor, "liveness_monitor", None) is not None, "tokens": tokens,
              "bridge_active": bridge.active, "bridge_guard": bridge.guard is not None,
              "bridge_status": bridge.status(),
              "runtime_calls": runtime.calls, "metrics": metrics is not None, "endpoint_calls": endpoint.calls,
              "liveness_threads": sorted(thread.name for thread in threading.enumerate()
                                         if thread.name.startswith("trtllm-liveness"))})
    finally:
        llm.shutdown()
    emit({"done": True})


if __name__ == "__main__":
    main()
