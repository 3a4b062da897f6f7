"""Where the upstream-shaped fake ``tensorrt_llm`` trees are, for child programs and their tests.

ONE constant names the folder (the fakes have moved once; a move is a one-line change here).
A child program calls :func:`use_tree` before anything imports ``tensorrt_llm``; ranks spawned by
the fake's ``MpiPoolSession`` get the parent's ``sys.path`` (as upstream passes ``path=sys.path``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

FAKES_ROOT = Path(__file__).resolve().parents[1] / "fakes"
TREES = ("v12", "main")
# The fakes' engine factory, for the scenario option ``engine`` (``ScenarioOptions``) of a scenario on
# upstream's API: importable in a process once a fake tree's ``tensorrt_llm`` has been imported.
FAKE_ENGINE = "_trtllm_fake_common:FakeEngine"


def tree(version: str) -> Path:
    """The folder holding ``version``'s fake ``tensorrt_llm`` package. Raises ``ValueError``."""
    if version not in TREES:
        raise ValueError(f"unknown fake tree {version!r}; one of {', '.join(TREES)}")
    return FAKES_ROOT / f"trtllm_{version}"


def use_tree(version: str) -> Path:
    """Put ``version``'s tree first on ``sys.path`` (before ``tensorrt_llm`` is imported)."""
    if "tensorrt_llm" in sys.modules:
        raise RuntimeError("tensorrt_llm is already imported; use_tree() must come first")
    path = tree(version)
    sys.path.insert(0, str(path))
    return path


def kill_rank(executor: Any, rank: int) -> None:
    """SIGKILL rank ``rank`` of a liveness executor, through a pidfd verified against its start time."""
    import os
    import signal

    from trtllm_liveness.process import _pidfd

    victim = next(identity for identity in executor.liveness_monitor.identities if identity.rank == rank)
    fd = _pidfd.open_verified_pidfd(victim.pid, victim.start_time)  # never a recycled pid
    try:
        _pidfd.send_signal(fd, signal.SIGKILL)
    finally:
        os.close(fd)
