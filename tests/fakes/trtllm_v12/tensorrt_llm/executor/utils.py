"""Fake ``tensorrt_llm.executor.utils`` (1.2.x: no EngineDeadError)."""

from _trtllm_fake_common import ErrorResponse, RequestError, WorkerCommIpcAddrs

__all__ = ["ErrorResponse", "RequestError", "WorkerCommIpcAddrs"]
