"""Fake ``tensorrt_llm.llmapi.llm_args`` (1.2.x): strict (unknown key -> ValueError); no env_overrides."""

from _trtllm_fake_common import BASE_LLM_FIELDS, StrictArgsBase


class BaseLlmArgs(StrictArgsBase):
    model_fields = dict(BASE_LLM_FIELDS)  # noqa: RUF012 - mirrors pydantic model_fields


class TorchLlmArgs(BaseLlmArgs):
    model_fields = dict(BASE_LLM_FIELDS)  # noqa: RUF012 - mirrors pydantic model_fields


__all__ = ["BaseLlmArgs", "TorchLlmArgs"]
