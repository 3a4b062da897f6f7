"""Fake ``tensorrt_llm.executor.worker`` (1.2.x): ``worker_main`` sends ``(READY, None)``."""

from __future__ import annotations

from typing import Any

from _trtllm_fake_common import RouteStandIn, worker_main_impl

from .executor import GenerationExecutor
from .ipc import IpcQueue


class GenerationExecutorWorker(RouteStandIn, GenerationExecutor):
    """The single-process route's executor: a stand-in that runs no engine (README)."""


def worker_main(engine: Any = None, worker_queues: Any = None, ready_signal: bytes = b"READY",
                **kwargs: Any) -> None:
    worker_main_impl(engine=engine, worker_queues=worker_queues, ready_signal=ready_signal, queue_cls=IpcQueue,
                     identities_signal=None, capture_identity=None, **kwargs)
