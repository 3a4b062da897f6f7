"""Child process: an engine's fatal path and the process's ending, with ``exit_on_fatal`` on.

Usage: ``python -m tests.programs.process_ending_child '{"config": {...}, "ranks": [[rank, pid], ...],
"scenario": "shutdown" | "watchdog"}'``. The engine is a liveness proxy over the smallest upstream
shape (no MPI): its ranks are the given real processes, registered with the monitor as upstream's
identities message would. The parent makes the fault (kills a rank) after ``{"ready": ...}``.

``shutdown``: once ``check_health()`` says False, the engine's ``shutdown()`` runs (as a server's
SIGINT handler would), then ``{"after_shutdown": [names of the extension's threads still alive]}``;
then the main program returns: the interpreter's exit, whose status the exit guard decides.
``watchdog``: the main thread ignores the guard's SIGINT and waits: the guard's watchdog ends the
process (``exit_timeout_s``), stopping the ranks first.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from typing import Any

from tests.support.bare_proxy import BareUpstreamProxy
from tests.support.ref_engine import emit
from trtllm_liveness import LivenessConfig
from trtllm_liveness.integrations.trtllm import liveness_proxy_class
from trtllm_liveness.process._identity import capture_identity

WAIT_S = 60.0


def extension_threads() -> list[str]:
    return sorted(thread.name for thread in threading.enumerate()
                  if thread.is_alive() and thread.name.startswith("trtllm-liveness-"))


def main(options: dict[str, Any]) -> int:
    sigints: list[int] = []
    signal.signal(signal.SIGINT, lambda *_: sigints.append(1))  # the guard's graceful shutdown: noted only
    config = LivenessConfig(**{"enabled": True, "exit_on_fatal": True, **options["config"]})
    proxy = liveness_proxy_class(BareUpstreamProxy, config=config)({"llm_args": None})
    proxy.liveness_monitor.register([capture_identity(rank, pid) for rank, pid in options["ranks"]])
    emit({"ready": True})
    deadline = time.monotonic() + WAIT_S
    while proxy.check_health() and time.monotonic() < deadline:
        time.sleep(0.01)
    emit({"fatal": str(proxy.liveness_fatal_error)})
    if options["scenario"] == "shutdown":
        proxy.shutdown()
        emit({"after_shutdown": extension_threads(), "sigints": len(sigints)})
        return 0  # the server's clean return: the exit guard's status decides
    while time.monotonic() < deadline:  # the watchdog ends the process
        time.sleep(0.05)
    emit({"still_running": True})
    return 0


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
