"""Fake tensorrt_llm.executor.utils (main: EngineDeadError exists)."""

from trtllm_liveness.reference._protocol import EngineDeadError, ErrorResponse

__all__ = ["EngineDeadError", "ErrorResponse"]
