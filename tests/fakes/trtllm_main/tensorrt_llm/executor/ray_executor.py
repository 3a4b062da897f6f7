"""Fake ``tensorrt_llm.executor.ray_executor``: a route stand-in (runs no workers; README)."""

from _trtllm_fake_common import RouteStandIn

from .executor import GenerationExecutor


class RayExecutor(RouteStandIn, GenerationExecutor):
    pass
