"""Fake ``tensorrt_llm`` (1.2.1 shapes) for tests; see tests/fakes/README.md."""

import os as _os
import sys as _sys

# The code both fake trees share lives in tests/fakes/_trtllm_fake_common.py.
_FAKES_DIR = _os.path.dirname(_os.path.dirname(_os.path.dirname(_os.path.abspath(__file__))))
if _FAKES_DIR not in _sys.path:
    _sys.path.append(_FAKES_DIR)

__version__ = "1.2.1"


def __getattr__(name: str) -> object:
    # ``from tensorrt_llm import LLM`` as upstream, without importing the LLM API for every worker.
    if name == "LLM":
        from .llmapi.llm import LLM

        return LLM
    raise AttributeError(name)
