"""Fake ``tensorrt_llm._torch`` (main): only the hang detector's module; see tests/fakes/README.md."""
