"""The engine factory ``trtllm-liveness drill --engine tests.support.drill_engine:fake_engine`` takes in
the tests: the upstream-shaped fakes' ``LLM`` takes a ``FakeEngine`` where upstream's takes a model
(tests/fakes/README.md), so the drill is given one instead of its MODEL.

Importable once a fake ``tensorrt_llm`` is (its ``__init__`` puts ``_trtllm_fake_common`` on the path).
"""

from __future__ import annotations

from typing import Any

TOKEN_DELAY_S = 0.02  # 1024 tokens take ~20 s: the requests still stream when the fault comes


def fake_engine(model: str) -> Any:
    """A ``FakeEngine`` standing for ``model`` (whose name only shows in the drill's output)."""
    del model
    from _trtllm_fake_common import FakeEngine  # type: ignore[import-not-found]

    return FakeEngine(token_delay_s=TOKEN_DELAY_S)
