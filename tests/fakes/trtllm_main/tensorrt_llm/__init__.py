"""Fake tensorrt_llm (1.3.0.dev0+main layout) for tests; see tests/fakes/README.md."""

__version__ = "1.3.0.dev0+main"
