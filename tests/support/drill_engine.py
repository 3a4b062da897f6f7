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


def comm_session() -> Any:
    """``--session`` across hosts (tests/programs/fake_llmapi_launch.py): an ``MpiCommSession`` over
    ``COMM_WORLD``, whose other ranks serve its tasks, as the ranks of upstream's
    ``trtllm-llmapi-launch`` serve the session its ``LLM`` opens."""
    import tensorrt_llm.executor  # type: ignore[import-not-found]  # noqa: F401  # before llmapi: a cycle
    from mpi4py import MPI
    from tensorrt_llm.llmapi.mpi_session import MpiCommSession  # type: ignore[import-not-found]

    return MpiCommSession(MPI.COMM_WORLD, n_workers=MPI.COMM_WORLD.Get_size())


def fake_tp_engine(model: str) -> Any:
    """:func:`fake_engine` whose leader waits, every step, for every rank's acknowledgement, as a
    tensor-parallel collective waits for every rank (``step_acks``): a stopped rank of another host
    stops the tokens (a broadcast alone may leave over TCP without the stopped rank's part)."""
    del model
    from _trtllm_fake_common import FakeEngine

    return FakeEngine(token_delay_s=TOKEN_DELAY_S, step_acks=True)
