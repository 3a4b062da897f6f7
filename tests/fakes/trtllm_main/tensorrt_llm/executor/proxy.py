"""Fake ``tensorrt_llm.executor.proxy`` (main): ProxyCore plus main's liveness work.

main adds: the early identities message (``WORKER_PROCESS_IDENTITIES_SIGNAL``) registered once, after
its ACK, gated by session kind; ``check_health``; the ``proxy_error_monitor`` thread (5 s);
``_worker_process_monitor``; a sticky ``_engine_dead`` with an idempotent ``_mark_engine_dead`` that
keeps ``_results`` and calls ``mpi_session.release_exit_joins()``; ``pre_shutdown`` closing the
monitor and sending the sentinel if ``not futures or any(not f.done())``; a bounded ``shutdown``
once dead (one 5 s grace for the futures, 5 s join, ``abandon()`` only if ``_owns_mpi_session``); a
dispatch loop that drops a response whose id is no longer in ``_results`` (1.2.x indexes the table).
"""

from __future__ import annotations

import threading
from concurrent.futures import wait as futures_wait
from typing import Any

from _trtllm_fake_common import ProxyCore, Response, logger

from ..llmapi.mpi_session import MpiCommSession, MpiPoolSession, RemoteMpiCommSessionClient
from .executor import GenerationExecutor
from .ipc import IpcQueue
from .request import CancellingRequest, GenerationRequest
from .result import GenerationResult
from .utils import EngineDeadError, ErrorResponse, RequestError
from .worker import worker_main
from .worker_process_monitor import WorkerProcessMonitor

__all__ = ["GenerationExecutorProxy"]
_IMPORTED = (CancellingRequest, GenerationResult, IpcQueue, MpiPoolSession, worker_main)  # looked up at call time

ERROR_MONITOR_INTERVAL_S = 5.0  # upstream's literal ``_shutdown_event.wait(5)``
DEAD_SHUTDOWN_GRACE_S = 5.0


class GenerationExecutorProxy(ProxyCore, GenerationExecutor):
    WORKER_PROCESS_IDENTITIES_SIGNAL = b"WORKER_PROCESS_IDENTITIES"

    def _init_version_state(self, mpi_session: Any) -> None:
        self._owns_mpi_session = mpi_session is None
        self._engine_dead = False
        self._worker_process_monitor = WorkerProcessMonitor()
        self._worker_processes_registered = False
        self._shutdown_event = threading.Event()
        self._error_monitor_thread: threading.Thread | None = None

    # ------------------------------------------------------------------ start-up

    def _start_executor_workers(self, worker_kwargs: dict[str, Any]) -> None:
        self._submit_workers(worker_kwargs,
                             worker_process_identities_signal=self.WORKER_PROCESS_IDENTITIES_SIGNAL)
        status = self._wait_for_executor_workers_ready()
        if status[0] != self.READY_SIGNAL:
            logger.error("Executor worker initialization error: %s", status[1])
            self.mpi_session.shutdown_abort(reason=status[0])
            raise RuntimeError("Executor worker returned error") from status[0]
        self._error_monitor_thread = threading.Thread(target=self._error_monitor_loop, name="proxy_error_monitor",
                                                      daemon=True)
        self._error_monitor_thread.start()

    def _wait_for_executor_workers_ready(self) -> tuple[Any, ...]:
        """Poll 1 s at a time. No overall bound (a slow start-up is not killed)."""
        while True:
            if self.worker_init_status_queue.poll(1):
                status = self.worker_init_status_queue.get()
                self.worker_init_status_queue.put("ACK")
                if status[0] == self.WORKER_PROCESS_IDENTITIES_SIGNAL:
                    self._register_worker_processes(status)
                    continue
                if status[0] == self.READY_SIGNAL:
                    self._register_worker_processes(status)
                return tuple(status)
            dead = self._worker_process_monitor.find_dead_worker()
            if dead is not None:
                error = RuntimeError(f"MPI worker rank {dead.rank} (pid {dead.pid}) exited unexpectedly")
                self._set_fatal_error(error)
                self.pre_shutdown()
                raise error
            if self._check_remote_worker_death():
                assert self._fatal_error is not None
                raise self._fatal_error
            if any(fut.done() for fut in self.mpi_futures):
                logger.error("Executor worker died during initialization.")
                raise RuntimeError("Executor worker died during initialization")
            self._handle_background_error()

    def _register_worker_processes(self, status: Any) -> None:
        """Once; not for sessions whose ranks the proxy did not spawn (comm / remote sessions)."""
        if getattr(self, "_worker_processes_registered", False):
            return
        if len(status) < 3 or status[2] is None:
            return
        self._worker_processes_registered = True
        if isinstance(self.mpi_session, (MpiCommSession, RemoteMpiCommSessionClient)):
            return
        self._worker_process_monitor.register(status[2])

    # ------------------------------------------------------------------ death

    def _mpi_done_callback_factory(self) -> Any:
        import weakref

        self_ref = weakref.ref(self)

        def mpi_done_callback(future: Any) -> None:
            if future.exception() is not None and (self_ := self_ref()) is not None:
                self_._handle_worker_death(future.exception())

        return mpi_done_callback

    def _handle_worker_death(self, error: BaseException) -> None:
        """Event-driven: mark dead (pending results fail), record for the monitor loop (-> pre_shutdown)."""
        self._mark_engine_dead(error)
        self._error_queue.put_nowait(error)

    def _mark_engine_dead(self, error: BaseException) -> None:
        if self._engine_dead:
            return
        self._engine_dead = True
        dead = EngineDeadError(error)
        for result in list(self._results.values()):  # _results is kept, not cleared
            result.queue.put(dead)
        release = getattr(getattr(self, "mpi_session", None), "release_exit_joins", None)
        if release is not None:
            release()

    def _check_remote_worker_death(self) -> bool:
        check = getattr(self.mpi_session, "check_worker_error", None)
        if check is None:
            return False
        error = check()
        if error is None:
            return False
        self._set_fatal_error(error)
        self._mark_engine_dead(error)
        self._error_queue.put_nowait(error)
        self.pre_shutdown()
        return True

    def _fatal(self, error: BaseException) -> bool:
        self._set_fatal_error(error)
        self._mark_engine_dead(error)
        self.pre_shutdown()  # never shutdown() here: it joins threads and blocks on futures
        return False

    def check_health(self) -> bool:
        if self.doing_shutdown or self._fatal_error is not None:
            return False
        while not self._error_queue.empty():
            error = self._error_queue.get_nowait()
            if isinstance(error, (str, RequestError)):
                continue  # per-request errors are not fatal
            return self._fatal(error)
        dead = self._worker_process_monitor.find_dead_worker()
        if dead is not None:
            return self._fatal(RuntimeError(f"MPI worker rank {dead.rank} (pid {dead.pid}) exited unexpectedly"))
        if self._check_remote_worker_death():
            return False
        for rank, fut in enumerate(self.mpi_futures):
            if fut.done():
                return self._fatal(RuntimeError(f"MPI worker rank {rank} exited unexpectedly"))
        return True

    def _error_monitor_loop(self) -> None:
        while not self._shutdown_event.wait(ERROR_MONITOR_INTERVAL_S):
            if self.doing_shutdown or not self.check_health():
                return

    # ------------------------------------------------------------------ results

    def dispatch_result_task(self) -> bool:
        """main: a response for an id no longer in ``_results`` is dropped (``.get()``), not a KeyError."""
        if (res := self.result_queue.get()) is None:
            return False
        for item in res if isinstance(res, list) else [res]:
            if item is None:
                return False
            result = self._results.get(item.client_id)
            if result is None:
                continue
            result.queue.put(item)
            if isinstance(item, ErrorResponse) or (isinstance(item, Response) and item.is_final):
                self._results.pop(item.client_id, None)
        return True

    # ------------------------------------------------------------------ requests

    def submit(self, request: GenerationRequest) -> Any:
        if self._engine_dead:
            raise EngineDeadError(self._fatal_error)
        self._start_dispatch_threads()
        request.set_id(self._get_next_client_id())
        result = self._new_result(request)
        assert request.id is not None
        self._results[request.id] = result
        if self._engine_dead:  # died between the guard and the registration: the sweep missed it
            self._results.pop(request.id, None)
            raise EngineDeadError(self._fatal_error)
        self.request_queue.put(request)
        self._handle_background_error()
        return result

    # ------------------------------------------------------------------ shutdown

    def pre_shutdown(self) -> None:
        if not self.workers_started:
            return
        if self.doing_shutdown:
            return
        self.doing_shutdown = True
        self._fake_pre_shutdown_runs += 1  # instrumentation (ProxyCore)
        self._worker_process_monitor.close()  # expected exits begin
        self._abort_all_requests()
        if not self.mpi_futures or any(not f.done() for f in self.mpi_futures):
            self.request_queue.put_noblock(None, retry=4)

    def shutdown(self) -> None:
        if not self.workers_started:
            return
        if not self.doing_shutdown:
            self.pre_shutdown()
        dead = self._engine_dead
        if dead:
            futures_wait(self.mpi_futures, timeout=DEAD_SHUTDOWN_GRACE_S)  # one shared grace
        else:
            for f in self.mpi_futures:
                try:
                    f.result()
                except BaseException:
                    pass
        thread = self.dispatch_result_thread
        if thread is not None and thread.is_alive():
            thread.stop()
            thread.join(timeout=5.0 if dead else None)
        self._shutdown_event.set()
        monitor = self._error_monitor_thread
        if monitor is not None and monitor is not threading.current_thread():
            monitor.join(timeout=5.0)
        self._close_queues()
        self.workers_started = False
        if self._owns_mpi_session:
            if dead:
                self.mpi_session.abandon()
            else:
                self.mpi_session.shutdown()
        self._handle_background_error()
