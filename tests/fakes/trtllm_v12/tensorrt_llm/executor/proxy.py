"""Fake GenerationExecutorProxy (1.2.1 behaviour, from the reference executor)."""

from __future__ import annotations

from typing import Any

from trtllm_liveness.reference._proxy import GenerationExecutorProxy as _ReferenceProxy

from . import worker as _worker
from .executor import GenerationExecutor
from .utils import *  # noqa: F403  (ErrorResponse, and EngineDeadError on main, as upstream imports them)


class GenerationExecutorProxy(_ReferenceProxy, GenerationExecutor):
    def _resolve_worker_main(self) -> Any:
        return _worker.worker_main  # looked up at call time, like upstream's module global
