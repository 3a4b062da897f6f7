"""Fake tensorrt_llm.executor.utils (1.2.x: no EngineDeadError)."""

from trtllm_liveness.reference._protocol import ErrorResponse

__all__ = ["ErrorResponse"]
