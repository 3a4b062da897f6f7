"""Fake ``tensorrt_llm.llmapi.utils``."""

from _trtllm_fake_common import ManagedThread

__all__ = ["ManagedThread"]
