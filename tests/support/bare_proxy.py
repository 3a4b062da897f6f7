"""The smallest upstream proxy shape, for tests that drive an engine's liveness without MPI.

Its constructor starts the workers (none: the test registers real processes with the engine's
monitor itself, as upstream's identities message would); health is ``not is_shutdown()``, as on
TensorRT-LLM 1.2.x. Wrap it with ``liveness_proxy_class(BareUpstreamProxy, config=...)``.
"""

from __future__ import annotations

from typing import Any


class BareUpstreamProxy:
    """Upstream's hooks that the extension overrides, each doing nothing."""

    def __init__(self, worker_kwargs: Any, *args: Any, **kwargs: Any) -> None:
        self._start_executor_workers(worker_kwargs)

    def _start_executor_workers(self, worker_kwargs: Any) -> None:
        pass

    def pre_shutdown(self) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def is_shutdown(self) -> bool:
        return False
