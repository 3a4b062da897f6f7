"""Fake ``tensorrt_llm.executor.utils`` (main: EngineDeadError)."""

from __future__ import annotations

from _trtllm_fake_common import ErrorResponse, RequestError, WorkerCommIpcAddrs


class EngineDeadError(RuntimeError):
    """Put on every pending result by ``_mark_engine_dead``; raised by ``submit`` once dead."""

    def __init__(self, root_cause: BaseException | None = None) -> None:
        self.root_cause = root_cause
        message = "Engine has died" if root_cause is None else f"Engine has died: {root_cause}"
        super().__init__(message)


__all__ = ["EngineDeadError", "ErrorResponse", "RequestError", "WorkerCommIpcAddrs"]
