"""Integrations of the liveness core with the systems around it.

Each module imports its third-party dependency lazily or at its own import, never from the core:
``trtllm`` (TensorRT-LLM proxy and workers), ``dynamo`` (NVIDIA Dynamo runtime), ``prometheus``
(metrics).
"""
