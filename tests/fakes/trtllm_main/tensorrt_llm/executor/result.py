"""Fake ``tensorrt_llm.executor.result`` (main): an EngineDeadError on the queue is terminal."""

from _trtllm_fake_common import GenerationResultBase

from .utils import EngineDeadError


class GenerationResult(GenerationResultBase):
    ENGINE_DEAD_ERROR = EngineDeadError


__all__ = ["GenerationResult"]
