"""Fake ``tensorrt_llm.executor`` (1.2.x): re-exports as upstream's package does."""

from .executor import GenerationExecutor
from .proxy import GenerationExecutorProxy
from .request import CancellingRequest, GenerationRequest
from .result import GenerationResult
from .utils import ErrorResponse, RequestError

__all__ = ["CancellingRequest", "ErrorResponse", "GenerationExecutor", "GenerationExecutorProxy",
           "GenerationRequest", "GenerationResult", "RequestError"]
