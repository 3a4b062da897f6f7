"""Fake ``tensorrt_llm.executor`` (main): re-exports as upstream's package does (with EngineDeadError)."""

from .executor import GenerationExecutor
from .proxy import GenerationExecutorProxy
from .request import CancellingRequest, GenerationRequest
from .result import GenerationResult
from .utils import EngineDeadError, ErrorResponse, RequestError

__all__ = ["CancellingRequest", "EngineDeadError", "ErrorResponse", "GenerationExecutor",
           "GenerationExecutorProxy", "GenerationRequest", "GenerationResult", "RequestError"]
