"""Bounded waits for tests: :func:`wait_until` and the scale of every test's waits.

``TRTLLM_LIVENESS_TEST_WAIT_SCALE`` stretches bounded waits on slow or loaded machines (CI); it is
never used for timed assertions (speed is proven by the benchmarks under ``scripts/``).
"""

from __future__ import annotations

import os
import time

WAIT_SCALE = float(os.environ.get("TRTLLM_LIVENESS_TEST_WAIT_SCALE", "1"))


def wait_until(predicate: object, timeout: float, interval: float = 0.005) -> bool:
    """Poll ``predicate()`` until true or ``timeout`` (scaled) passes; return its last value."""
    deadline = time.monotonic() + timeout * WAIT_SCALE
    while True:
        if predicate():  # type: ignore[operator]
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)
