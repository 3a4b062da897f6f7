"""Fake ``tensorrt_llm.executor.executor`` (1.2.x): ``create`` routes; no ``check_health``."""

from __future__ import annotations

from _trtllm_fake_common import GenerationExecutorRoutes


class GenerationExecutor(GenerationExecutorRoutes):
    """Routes and ``create()`` come from the shared fake code; nothing version-specific here."""
