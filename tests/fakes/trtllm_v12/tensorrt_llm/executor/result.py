"""Fake ``tensorrt_llm.executor.result`` (1.2.x): ``abort()`` -> ``executor.abort_request``."""

from _trtllm_fake_common import GenerationResultBase


class GenerationResult(GenerationResultBase):
    pass


__all__ = ["GenerationResult"]
