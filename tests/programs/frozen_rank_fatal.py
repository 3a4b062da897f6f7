"""A wedged (frozen) rank makes the extension fail the worker futures while the leader is healthy.

Usage: ``python -m tests.programs.frozen_rank_fatal '{"mode": "main"}'`` as root with the cgroup v1
freezer, in a new session. Builds the reference executor with liveness (0.5 s D-state timeout),
freezes rank 1, waits for the fatal error and for mpi4py to complete the leader's own future (the
leader returns its task after the stop sentinel), then prints one JSON line: ``{"fatal": ...,
"leader_returned": bool, "thread_exceptions": [...]}``. Always thaws and
removes its cgroup; stops its workers (bounded) and ends with ``os._exit``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import threading
import time
from typing import Any

from tests.support.ref_engine import build_executor, emit, read_identities
from trtllm_liveness.demo._cgroup_faults import FreezerGroup
from trtllm_liveness.stop._bounded_stop import stop_processes

SETTLE_S = 0.5


def wait(future: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not future.done() and time.monotonic() < deadline:
        time.sleep(0.01)
    return bool(future.done())


def main(options: dict[str, Any]) -> None:
    exceptions: list[str] = []
    previous = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        exceptions.append(f"{args.exc_type.__name__}: {args.exc_value}")
        previous(args)

    threading.excepthook = hook
    announce = tempfile.mkdtemp(prefix="trtllm-frozen-rank-")
    freezer = FreezerGroup("trtllm-liveness-test-frozen-rank")
    identities = []
    try:
        proxy = build_executor(str(options.get("mode", "main")), announce,
                               options={"d_state_timeout_s": 0.5, "scan_interval_s": 0.05})
        identities = read_identities(announce, 2)
        freezer.freeze([identities[1].pid])
        deadline = time.monotonic() + 30
        while proxy.liveness_fatal_error is None and time.monotonic() < deadline:
            time.sleep(0.01)
        leader_future = proxy.liveness_state.real_mpi_futures[0]  # mpi4py's, not the mirror
        leader_returned = wait(leader_future, 30)
        time.sleep(SETTLE_S)  # a late exception in the manager thread would land now
        emit({"fatal": None if proxy.liveness_fatal_error is None else str(proxy.liveness_fatal_error),
              "leader_returned": leader_returned, "thread_exceptions": exceptions})
    finally:
        freezer.remove()
        stop_processes(identities, grace_s=0.0, kill_s=5.0)
        shutil.rmtree(announce, ignore_errors=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]) if len(sys.argv) > 1 else {})
    sys.stdout.flush()
    os._exit(0)
