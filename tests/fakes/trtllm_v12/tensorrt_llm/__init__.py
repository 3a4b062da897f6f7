"""Fake tensorrt_llm (1.2.1 layout) for tests; see tests/fakes/README.md."""

__version__ = "1.2.1"
