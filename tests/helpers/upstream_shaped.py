"""An in-process proxy with upstream main's shapes that the fatal path and the exit path touch.

No MPI: the "ranks" are plain child processes (``sleep``) whose identities the proxy registers
through ``_worker_process_monitor`` as upstream main does. What it keeps of upstream (read from
NVIDIA/TensorRT-LLM main, ``tensorrt_llm/executor/proxy.py`` and ``ipc.py``; see
docs/upstream-contract.md): the request queue is a ZMQ PAIR socket whose ``put`` blocks without
timeout (so ``abort_request()`` -> ``CancellingRequest`` to a dead leader never returns);
``_mark_engine_dead`` keeps ``_results``; ``pre_shutdown()`` sets ``doing_shutdown``, aborts every
pending result and closes the monitor; ``threading._register_atexit(pre_shutdown)`` and
``atexit.register(shutdown)`` at the end of the constructor. ``pre_shutdown_entries`` counts
every call into upstream's ``pre_shutdown`` (before its own once-flag). The stop sentinel is
stood in for by terminating the "ranks" (and waiting for them, as mpi4py's exit join does).
"""

from __future__ import annotations

import atexit
import os
import queue
import shutil
import subprocess
import tempfile
import threading
from typing import Any

from trtllm_liveness import capture_identity


class EngineDeadError(RuntimeError):
    pass


class Result:
    def __init__(self, client_id: int) -> None:
        self.id = client_id
        self.request_id = client_id
        self.queue: queue.Queue[Any] = queue.Queue()


class UpstreamMainShaped:
    WORKER_PROCESS_IDENTITIES_SIGNAL = b"WORKER_PROCESS_IDENTITIES"
    pre_shutdown_entries = 0

    def __init__(self, worker_kwargs: dict[str, Any], model_world_size: int = 2, mpi_session: Any = None,
                 **_unused: Any) -> None:
        import zmq

        self._fatal_error: BaseException | None = None
        self._engine_dead = False
        self.doing_shutdown = False
        self.doing_pre_shutdown = False
        self.workers_started = False
        self.mpi_session = mpi_session
        self.mpi_futures: list[Any] = []
        self._dir = tempfile.mkdtemp(prefix="upstream-shaped-")
        self._zmq = zmq.Context()
        self.request_queue = self._zmq.socket(zmq.PAIR)  # upstream's IpcQueue: PAIR, no timeout
        self.request_queue.setsockopt(zmq.LINGER, 0)
        self.request_queue.bind(f"ipc://{os.path.join(self._dir, 'request')}")
        self._results: dict[int, Result] = {}
        self._worker_process_monitor: Any = None
        # In the caller's session: the harness that ends the session ends them too. In-process
        # tests pass their own (started by the procs fixture) as worker_kwargs["workers"].
        self.workers: list[Any] = list(worker_kwargs.get("workers") or
                                       [subprocess.Popen(["sleep", "600"]) for _ in range(model_world_size)])
        self._start_executor_workers(worker_kwargs)
        if worker_kwargs.get("atexit", True):
            threading._register_atexit(self.pre_shutdown)  # type: ignore[attr-defined]
            atexit.register(self.shutdown)

    def _start_executor_workers(self, worker_kwargs: dict[str, Any]) -> None:
        self.workers_started = True
        monitor = self._worker_process_monitor
        if monitor is not None:  # upstream's early identities message, before the model is built
            monitor.register([capture_identity(rank, w.pid) for rank, w in enumerate(self.workers)])
        during_startup = worker_kwargs.get("during_startup")
        if during_startup is not None:  # the model load
            during_startup(self)

    def add_pending(self, count: int) -> list[Result]:
        results = [Result(i) for i in range(1, count + 1)]
        for result in results:
            self._results[result.id] = result
        return results

    def _set_fatal_error(self, error: BaseException) -> None:
        if self._fatal_error is None:
            self._fatal_error = error

    def _mark_engine_dead(self, error: BaseException) -> None:
        self._engine_dead = True
        for result in list(self._results.values()):  # upstream keeps _results
            result.queue.put(EngineDeadError(error))

    in_send = False
    overlapping_sends = 0

    def submit(self, request: Any) -> Result:
        """Upstream's order: register the result, then a blocking send (a hook stands in for it)."""
        result = Result(len(self._results) + 100)
        self._results[result.id] = result
        UpstreamMainShaped.in_send = True
        try:
            hook = getattr(request, "during_send", None)
            if hook is not None:
                hook(self)
        finally:
            UpstreamMainShaped.in_send = False
        return result

    def abort_request(self, request_id: int) -> None:
        self.request_queue.send_pyobj(("cancel", request_id))  # blocks: PAIR, no peer, no timeout

    def _abort_all_requests(self) -> None:
        for result in list(self._results.values()):
            self.abort_request(result.id)

    def pre_shutdown(self) -> None:
        UpstreamMainShaped.pre_shutdown_entries += 1
        if UpstreamMainShaped.in_send:
            UpstreamMainShaped.overlapping_sends += 1  # a second thread on the unlocked request socket
        if not self.workers_started or self.doing_pre_shutdown:
            return
        self.doing_pre_shutdown = True
        self.doing_shutdown = True
        self._abort_all_requests()
        monitor = self._worker_process_monitor
        if monitor is not None:
            monitor.close()
        self._send_stop_sentinel()

    def _send_stop_sentinel(self) -> None:
        # Stand-in for the None sentinel: the ranks exit now, and mpi4py's exit join waits for them.
        for worker in self.workers:
            if worker.poll() is None:
                worker.terminate()
        for worker in self.workers:
            worker.wait(5)

    def check_health(self) -> bool:
        return not self.doing_shutdown and self._fatal_error is None

    def is_shutdown(self) -> bool:
        return self.doing_shutdown

    def shutdown(self) -> None:
        if not self.workers_started:
            return
        if not self.doing_pre_shutdown:
            self.pre_shutdown()
        self.workers_started = False
        shutil.rmtree(self._dir, ignore_errors=True)

    def kill_worker(self, rank: int) -> None:
        self.workers[rank].kill()

    def reap_workers(self) -> None:
        for worker in self.workers:
            if worker.poll() is None:
                worker.kill()
            worker.wait(5)
