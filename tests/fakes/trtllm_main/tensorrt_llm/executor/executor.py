"""Fake ``tensorrt_llm.executor.executor`` (main): ``create`` routes; base ``check_health`` and the fatal error."""

from __future__ import annotations

import threading
from typing import Any

from _trtllm_fake_common import GenerationExecutorRoutes


class GenerationExecutor(GenerationExecutorRoutes):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._fatal_error: BaseException | None = None
        self._fatal_error_lock = threading.Lock()

    def _set_fatal_error(self, error: BaseException) -> None:
        """The first error wins."""
        with self._fatal_error_lock:
            if self._fatal_error is None:
                self._fatal_error = error

    def check_health(self) -> bool:
        """Base version (what the rpc proxy and Ray have): shutdown or a fatal error -> False."""
        return not self.doing_shutdown and self._fatal_error is None
