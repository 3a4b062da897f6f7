"""Fake ``tensorrt_llm.llmapi.llm`` (main): ``env_overrides`` applied to ``os.environ`` first."""

from _trtllm_fake_common import BaseLLMImpl

from .llm_args import TorchLlmArgs


class BaseLLM(BaseLLMImpl):
    ARGS_CLS = TorchLlmArgs
    ENV_OVERRIDES = True


class LLM(BaseLLM):
    pass


__all__ = ["LLM", "BaseLLM"]
