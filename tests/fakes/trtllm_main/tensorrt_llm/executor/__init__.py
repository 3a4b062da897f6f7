"""Fake tensorrt_llm.executor: re-exports as upstream's package does."""

from .executor import GenerationExecutor
from .proxy import GenerationExecutorProxy

__all__ = ["GenerationExecutor", "GenerationExecutorProxy"]
