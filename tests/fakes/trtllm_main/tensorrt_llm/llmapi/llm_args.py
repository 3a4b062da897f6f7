"""Fake ``tensorrt_llm.llmapi.llm_args`` (main): strict, plus ``env_overrides`` (prototype upstream)."""

from _trtllm_fake_common import BASE_LLM_FIELDS, StrictArgsBase

_FIELDS = {**BASE_LLM_FIELDS, "env_overrides": None}


class BaseLlmArgs(StrictArgsBase):
    model_fields = dict(_FIELDS)  # noqa: RUF012 - mirrors pydantic model_fields


class TorchLlmArgs(BaseLlmArgs):
    model_fields = dict(_FIELDS)  # noqa: RUF012 - mirrors pydantic model_fields


__all__ = ["BaseLlmArgs", "TorchLlmArgs"]
