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


def sigkill_and_time_exit(pidfd: int, bound_s: float) -> tuple[float, float | None]:
    """SIGKILL the process behind ``pidfd`` (opened and verified by the caller, who closes it) and
    wait at most ``bound_s`` for its exit: ``(when the signal was sent, when the pidfd said the
    process exited or None)``, both ``time.monotonic()``."""
    import select
    import signal

    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    sent = time.monotonic()
    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    return sent, time.monotonic() if poller.poll(int(bound_s * 1000)) else None
