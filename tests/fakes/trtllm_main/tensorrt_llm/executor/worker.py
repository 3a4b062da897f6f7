"""Fake ``tensorrt_llm.executor.worker`` (main): identities allgathered and sent before the build."""

from __future__ import annotations

from typing import Any

from _trtllm_fake_common import RouteStandIn, worker_main_impl

from .executor import GenerationExecutor
from .ipc import IpcQueue
from .worker_process_monitor import capture_worker_process_identity


class GenerationExecutorWorker(RouteStandIn, GenerationExecutor):
    """The single-process route's executor: a stand-in that runs no engine (README)."""


def worker_main(engine: Any = None, worker_queues: Any = None, ready_signal: bytes = b"READY",
                worker_process_identities_signal: bytes | None = None, **kwargs: Any) -> None:
    worker_main_impl(engine=engine, worker_queues=worker_queues, ready_signal=ready_signal, queue_cls=IpcQueue,
                     identities_signal=worker_process_identities_signal,
                     capture_identity=capture_worker_process_identity, **kwargs)
