"""Child process: upstream's LLM API with ``executor_cls=liveness_executor_class()`` on a fake tree.

Usage: ``python -m tests.programs.executor_cls_child '{"tree": "main" | "v12"}'``. Builds
``LLM(FakeEngine(), executor_cls=liveness_executor_class(), tensor_parallel_size=2)`` (real MPI
ranks through the fake's ``MpiPoolSession``), emits what was built::

    {"built": class name, "liveness": bool, "proxy_pid": pid, "ranks": [{"rank", "pid", "state"}...]}

(the ranks once both are registered with the liveness monitor, or after a 20 s bound, whatever is
there then), shuts the engine down and emits ``{"done": true}``.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from typing import Any

from tests.support.ref_engine import emit
from tests.support.upstream_fakes import use_tree

_REGISTERED_WITHIN_S = 20.0


def _ranks(executor: Any) -> list[dict[str, Any]]:
    monitor = getattr(executor, "liveness_monitor", None)
    if monitor is None:
        return []
    return [{"rank": s.identity.rank, "pid": s.identity.pid, "state": s.state.value} for s in monitor.statuses()]


def main() -> None:
    options = json.loads(sys.argv[1])
    use_tree(options["tree"])
    from trtllm_liveness.demo._mpi_env import configure_mpi_env

    configure_mpi_env()
    from tensorrt_llm import LLM  # type: ignore[import-not-found]  # the fake, put first on sys.path

    from trtllm_liveness.integrations.trtllm import LivenessProxyMixin, liveness_executor_class

    fake_engine = importlib.import_module("_trtllm_fake_common").FakeEngine
    llm = LLM(fake_engine(), executor_cls=liveness_executor_class(), tensor_parallel_size=2)
    try:
        executor = llm._executor
        deadline = time.monotonic() + _REGISTERED_WITHIN_S
        ranks = _ranks(executor)
        while len(ranks) < 2 and isinstance(executor, LivenessProxyMixin) and time.monotonic() < deadline:
            time.sleep(0.05)
            ranks = _ranks(executor)
        emit({"built": type(executor).__name__, "liveness": isinstance(executor, LivenessProxyMixin),
              "proxy_pid": os.getpid(), "ranks": ranks})
    finally:
        llm.shutdown()
    emit({"done": True})


if __name__ == "__main__":
    main()
