"""Fake ``tensorrt_llm.executor.rpc_proxy``: a route stand-in (runs no workers; README)."""

from _trtllm_fake_common import RouteStandIn

from .executor import GenerationExecutor


class GenerationExecutorRpcProxy(RouteStandIn, GenerationExecutor):
    pass
