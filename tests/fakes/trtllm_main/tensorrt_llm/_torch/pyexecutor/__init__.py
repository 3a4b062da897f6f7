"""Fake ``tensorrt_llm._torch.pyexecutor`` (main): only ``hang_detector``."""
