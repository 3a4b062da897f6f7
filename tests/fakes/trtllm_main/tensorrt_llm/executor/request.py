"""Fake ``tensorrt_llm.executor.request``."""

from _trtllm_fake_common import CancellingRequest, GenerationRequest

__all__ = ["CancellingRequest", "GenerationRequest"]
