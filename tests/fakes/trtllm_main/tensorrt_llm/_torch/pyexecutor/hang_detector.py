"""Fake ``tensorrt_llm._torch.pyexecutor.hang_detector`` (main).

Upstream's ``HangDetector`` (read: store id 58966253298, commit 06c5e532): the executor loop calls
``checkpoint()`` at the top of every iteration (``py_executor.py``, store id 3542389387), which
re-arms a ``timeout`` (default 300 s) watchdog on an asyncio loop thread; when it fires it dumps the
stacks and hard-kills the rank (``MPI_Abort(137)`` or self-SIGKILL). Differences here: no watchdog
thread and no kill (the fake engine never runs 300 s); ``checkpoint()`` only records the time.
The method names and the per-iteration call are upstream's: that is what the extension counts.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


class HangDetector:
    def __init__(self, timeout: int | None = None, on_detected: Callable[[], None] | None = None) -> None:
        self.timeout = timeout if timeout is not None else 300
        assert self.timeout > 0, "timeout must be greater than 0"
        self.on_detected = on_detected or (lambda: None)
        self.lock = threading.Lock()
        self.active = False
        self._detected = False
        self.last_checkpoint: float | None = None

    def start(self) -> None:
        self.active = True

    def detected(self) -> bool:
        with self.lock:
            return self._detected

    def checkpoint(self) -> None:
        self.last_checkpoint = time.monotonic()

    def cancel_task(self) -> None:
        pass

    @contextmanager
    def pause(self) -> Iterator[None]:
        try:
            yield
        finally:
            self.checkpoint()

    def stop(self) -> None:
        self.active = False

    def __enter__(self) -> HangDetector:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> bool:
        self.stop()
        return False
