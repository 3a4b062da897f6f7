"""Fake ``tensorrt_llm.llmapi``."""
