"""Fake ``tensorrt_llm.llmapi.llm`` (1.2.x): ``LLM(model, executor_cls=..., **kwargs)``."""

from _trtllm_fake_common import BaseLLMImpl

from .llm_args import TorchLlmArgs


class BaseLLM(BaseLLMImpl):
    ARGS_CLS = TorchLlmArgs


class LLM(BaseLLM):
    pass


__all__ = ["LLM", "BaseLLM"]
