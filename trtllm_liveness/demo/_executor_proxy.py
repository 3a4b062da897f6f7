"""The reference executor: upstream TensorRT-LLM's proxy/worker protocol over real MPI workers.

Data flow (as upstream)::

    generate_async -> submit -> request_queue (PUSH) ------------> leader rank: serve loop
                                                                      |  per step: every rank acks
    dispatch thread <- result_queue (PULL) <------------------------ + TokenResponse per token
         |-> result.queue.put(response)
    worker_init_status_queue (ROUTER) <- leader's DEALER: [identities,] READY -> "ACK"

Two flavours, selected by class, so that feature detection (``hasattr``) sees what it would see
upstream:

- :class:`GenerationExecutorProxy` behaves like the **1.2.x** release: a 2-tuple READY, no
  ``check_health`` (health is ``not is_shutdown()``), no fatal-error machinery. A worker killed
  under Open MPI with ``OMPI_MCA_mpi_ft_enable=1`` leaves every request pending forever.
- :class:`MainGenerationExecutorProxy` behaves like **main** (Aug-Sep 2026): the early identities
  message and a 3-tuple READY, ``_fatal_error``/``_set_fatal_error`` (first wins), the poll-based
  ``_worker_process_monitor`` (``find_dead_worker`` is only called from ``check_health`` and the
  ``proxy_error_monitor`` loop, every 5 s), ``_engine_dead``/``EngineDeadError``.

Departures from upstream (besides the fake generation): no HMAC on IPC (private 0700 socket
directory instead), no separate request-error queue, no stats/KV-event threads, the request
queue has a 0.5 s send timeout (upstream's PAIR socket blocks forever once the leader is gone), no
error status at start (a rank that fails ends its future instead), and waits upstream leaves
unbounded are capped by ``upstream_wait_s`` (default one hour) so nothing in this package waits
forever.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import pickle
import queue
import shutil
import tempfile
import threading
import time
from concurrent.futures import Future
from typing import Any

from ..monitor._monitor import WorkerProcessMonitor
from ..process._identity import ProcessIdentity
from ._executor_protocol import (
    ACK,
    WORKER_PROCESS_IDENTITIES_SIGNAL,
    EngineDeadError,
    ErrorResponse,
    GenerationRequest,
    GenerationResult,
    RequestError,
    TokenResponse,
)
from ._executor_worker import worker_main as _reference_worker_main
from ._mpi_pool_session import MpiPoolSession

logger = logging.getLogger(__name__)

_SEND_TIMEOUT_MS = 500


class GenerationExecutorProxy:
    """The 1.2.x-like proxy. Construction blocks until the leader reports READY (no timeout,
    as upstream, up to ``upstream_wait_s``); raises ``RuntimeError`` if a worker future ends first.

    Holds what upstream's ``GenerationExecutor`` base holds: ``_results`` (client id ->
    :class:`GenerationResult`) and ``_error_queue`` (background errors that
    ``_handle_background_error`` re-raises in the caller's thread).

    Not thread-safe except ``submit``/``generate_async`` from one thread alongside the dispatch
    thread, as upstream.
    """

    _error_response_cls = ErrorResponse
    _protocol_mode = "1.2"  # the protocol its workers speak
    upstream_wait_s = 3600.0
    _shutdown_join_s = upstream_wait_s  # how long shutdown() waits for the worker futures

    def __init__(
        self,
        worker_kwargs: dict[str, Any],
        model_world_size: int = 1,
        mpi_session: Any = None,
        *,
        worker_cls: Any = None,
        postproc_worker_config: Any = None,
        is_llm_executor: bool | None = None,
    ) -> None:
        del worker_cls, postproc_worker_config, is_llm_executor
        self._error_queue: queue.Queue[Any] = queue.Queue()
        self.doing_shutdown = False
        self._results: dict[int, GenerationResult] = {}
        self._id_counter = itertools.count(1)
        self.workers_started = False
        self.doing_pre_shutdown = False
        self.pre_shutdown_runs = 0
        self.model_world_size = model_world_size
        self.mpi_session = mpi_session if mpi_session is not None else MpiPoolSession(model_world_size)
        self.mpi_futures: list[Future[Any]] = []
        self.dispatch_result_thread: threading.Thread | None = None
        self._dispatch_stop = threading.Event()
        # ZMQ sockets are not thread-safe: submit() runs in callers' threads while pre_shutdown()
        # may run in the error monitor or liveness thread; concurrent sends abort inside libzmq.
        self._request_send_lock = threading.Lock()
        kwargs = dict(worker_kwargs)
        kwargs["mode"] = self._protocol_mode
        kwargs["worker_queues"] = self._setup_queues()
        try:
            self._start_executor_workers(kwargs)
        except BaseException:
            self._close_queues()  # departure: upstream leaves its sockets to the garbage collector
            raise

    def is_shutdown(self) -> bool:
        return self.doing_shutdown

    def _get_next_client_id(self) -> int:
        return next(self._id_counter)

    def _handle_background_error(self, error: Any = None) -> None:
        """Re-raise the first engine-level background error, as upstream does in user calls."""
        if error is not None:
            self._error_queue.put_nowait(error)
        item = self._pop_background_error()
        if item is not None:
            raise item

    def _pop_background_error(self) -> BaseException | None:
        """The next engine-level error of ``_error_queue``; per-request errors are dropped."""
        while True:
            try:
                item = self._error_queue.get_nowait()
            except queue.Empty:
                return None
            if isinstance(item, (str, RequestError)):
                continue
            if isinstance(item, BaseException):
                return item

    def generate_async(self, prompt_token_ids: list[int]) -> GenerationResult:
        """Submit one fake generation (non-blocking apart from a bounded socket send)."""
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        return self.submit(GenerationRequest(list(prompt_token_ids)))

    def _setup_queues(self) -> dict[str, str]:
        import zmq

        self._ipc_dir = tempfile.mkdtemp(prefix="trtllm-ref-")  # mode 0700
        self._zmq = zmq.Context()
        addrs = {name: f"ipc://{os.path.join(self._ipc_dir, name)}" for name in ("status", "request", "result")}
        self.worker_init_status_queue = self._zmq.socket(zmq.ROUTER)
        self.request_queue = self._zmq.socket(zmq.PUSH)
        self.request_queue.setsockopt(zmq.SNDTIMEO, _SEND_TIMEOUT_MS)
        self.result_queue = self._zmq.socket(zmq.PULL)
        for sock, name in ((self.worker_init_status_queue, "status"), (self.request_queue, "request"),
                           (self.result_queue, "result")):
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(addrs[name])
        self._result_addr = addrs["result"]
        return addrs

    def _ack(self, peer: bytes) -> None:
        self.worker_init_status_queue.send_multipart([peer, pickle.dumps(ACK)])

    def _start_executor_workers(self, worker_kwargs: dict[str, Any]) -> None:
        def mpi_done_callback(future: Future[Any]) -> None:
            exc = None if future.cancelled() else future.exception()
            if exc is not None:
                self._error_queue.put_nowait(exc)

        self.mpi_futures = self.mpi_session.submit(_reference_worker_main, **worker_kwargs)
        for future in self.mpi_futures:
            future.add_done_callback(mpi_done_callback)
        self.workers_started = True
        deadline = time.monotonic() + self.upstream_wait_s
        while True:
            if self.worker_init_status_queue.poll(1000):
                peer, payload = self.worker_init_status_queue.recv_multipart()
                if self._take_status(peer, pickle.loads(payload)):
                    return
                continue
            self._check_init_workers()
            if time.monotonic() > deadline:
                raise RuntimeError("Executor workers did not become ready")
            self._handle_background_error()

    def _take_status(self, peer: bytes, status: Any) -> bool:
        """Whether one status message is the ready status (then acknowledged). The reference's
        workers never send upstream's error status: a rank that fails ends its future instead."""
        _ready_signal, _error_trace = status  # 1.2.x unpacks exactly two fields
        self._ack(peer)
        return True

    def _check_init_workers(self) -> None:
        """Raise ``RuntimeError`` if a worker ended while the workers start."""
        if any(f.done() for f in self.mpi_futures):
            logger.error("Executor worker died during initialization.")
            raise RuntimeError("Executor worker died during initialization")

    def _start_dispatch_threads(self) -> None:
        if self.dispatch_result_thread is None:
            self.dispatch_result_thread = threading.Thread(
                target=self._dispatch_loop, name="proxy_dispatch_result_thread", daemon=True
            )
            self.dispatch_result_thread.start()
        self._handle_background_error()

    def _dispatch_loop(self) -> None:
        try:
            while self.dispatch_result_task():
                pass
        except Exception as exc:  # the socket was closed under us at shutdown, or a bug
            if not self._dispatch_stop.is_set():
                self._error_queue.put_nowait(exc)

    def dispatch_result_task(self) -> bool:
        """Upstream's name and contract: a blocking receive of one response, dispatched, True;
        False at the ``None`` end marker (the leader's, or ``shutdown()``'s)."""
        if self._dispatch_stop.is_set():
            return False
        response = self.result_queue.recv_pyobj()
        if response is None:
            return False
        self.dispatch_response(response)
        return True

    def _send_end_marker(self) -> None:
        """Wake the dispatch thread's receive with the end marker (the result socket is a PULL:
        any number of peers)."""
        import zmq

        marker = self._zmq.socket(zmq.PUSH)
        try:
            marker.setsockopt(zmq.LINGER, 100)
            marker.connect(self._result_addr)
            with contextlib.suppress(zmq.Again):
                marker.send_pyobj(None, zmq.NOBLOCK)
        finally:
            marker.close()

    def dispatch_response(self, response: TokenResponse | ErrorResponse) -> None:
        result = self._results.get(response.client_id)
        if result is None:
            return
        result.queue.put(response)
        if isinstance(response, ErrorResponse) or response.is_final:
            self._results.pop(response.client_id, None)

    def submit(self, request: GenerationRequest) -> GenerationResult:
        """Send one request to the leader. Raises what ``_handle_background_error`` finds, or
        ``RuntimeError`` when the request queue does not take it within 0.5 s."""
        import zmq

        self._start_dispatch_threads()
        request.set_id(self._get_next_client_id())
        result = GenerationResult(request.id)
        self._results[request.id] = result
        try:
            with self._request_send_lock:
                self.request_queue.send_pyobj(request)
        except zmq.Again:
            self._results.pop(request.id, None)
            raise RuntimeError("request queue did not accept the request (no live leader)") from None
        self._handle_background_error()
        return result

    def _should_send_sentinel(self) -> bool:
        return all(not f.done() for f in self.mpi_futures)  # 1.2.x's condition

    def pre_shutdown(self) -> None:
        """Abort every request and tell the workers to stop. Idempotent; blocks at most 0.5 s."""
        if not self.workers_started or self.doing_pre_shutdown:
            return
        self.doing_pre_shutdown = True
        self.doing_shutdown = True
        self.pre_shutdown_runs += 1
        for result in list(self._results.values()):
            result.abort()
        if self._should_send_sentinel():
            import zmq

            try:
                with self._request_send_lock:
                    self.request_queue.send_pyobj(None)
            except (zmq.Again, zmq.ZMQError):
                logger.warning("could not send the stop sentinel to the leader rank")

    def shutdown(self) -> None:
        """Upstream 1.2.x shutdown: waits for every worker future (forever upstream; here up to
        ``upstream_wait_s``), joins the dispatch thread, closes the queues and the session."""
        if not self.workers_started:
            return
        if not self.doing_pre_shutdown:
            self.pre_shutdown()
        deadline = time.monotonic() + self._shutdown_join_s
        for future in self.mpi_futures:
            with contextlib.suppress(Exception):
                future.result(timeout=max(0.0, deadline - time.monotonic()))
        self._dispatch_stop.set()
        if self.dispatch_result_thread is not None:
            if self.dispatch_result_thread.is_alive():
                self._send_end_marker()
            self.dispatch_result_thread.join(max(0.5, deadline - time.monotonic()))  # the marker's way
        self.workers_started = False
        self._close_queues()
        self.mpi_session.shutdown()

    def _close_queues(self) -> None:
        # A socket must not be closed while another thread uses it (libzmq asserts and aborts),
        # and Context.term() waits for every socket: if the dispatch thread is still inside the
        # result socket (its join timed out), leave that socket and the context to the process
        # exit rather than crash or block.
        dispatch = self.dispatch_result_thread
        dispatch_alive = dispatch is not None and dispatch.is_alive()
        with self._request_send_lock:
            for sock in (self.worker_init_status_queue, self.request_queue):
                with contextlib.suppress(Exception):
                    sock.close(0)
        if not dispatch_alive:
            with contextlib.suppress(Exception):
                self.result_queue.close(0)
            with contextlib.suppress(Exception):
                self._zmq.term()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)


class MainGenerationExecutorProxy(GenerationExecutorProxy):
    """The main-branch-like proxy (see the module docstring for what it adds)."""

    WORKER_PROCESS_IDENTITIES_SIGNAL = WORKER_PROCESS_IDENTITIES_SIGNAL
    _protocol_mode = "main"
    error_monitor_interval_s = 5.0
    _shutdown_join_s = 5.0  # bounded 5 s joins (upstream #16312)

    def __init__(self, worker_kwargs: dict[str, Any], model_world_size: int = 1, mpi_session: Any = None,
                 **kwargs: Any) -> None:
        self._fatal_error: BaseException | None = None
        self._fatal_lock = threading.Lock()
        self._engine_dead: BaseException | None = None
        self._shutdown_event = threading.Event()
        self._error_monitor_thread: threading.Thread | None = None
        self._worker_process_monitor = WorkerProcessMonitor()  # poll-based: no watcher started
        super().__init__(worker_kwargs, model_world_size, mpi_session, **kwargs)

    def _take_status(self, peer: bytes, status: Any) -> bool:
        if status[0] == self.WORKER_PROCESS_IDENTITIES_SIGNAL:
            self._register_worker_identities(status[2])
            return False
        self._ack(peer)
        if len(status) > 2:
            self._register_worker_identities(status[2])
        return True

    def _check_init_workers(self) -> None:
        dead = self._worker_process_monitor.find_dead_worker()
        if dead is not None:
            raise RuntimeError(
                f"MPI worker rank {dead.rank} (pid {dead.pid}) exited unexpectedly during initialization"
            )
        if any(f.done() for f in self.mpi_futures):
            raise RuntimeError("Executor worker died during initialization")

    def _start_executor_workers(self, worker_kwargs: dict[str, Any]) -> None:
        super()._start_executor_workers(worker_kwargs)
        self._error_monitor_thread = threading.Thread(
            target=self._error_monitor_loop, name="proxy_error_monitor", daemon=True
        )
        self._error_monitor_thread.start()

    def _register_worker_identities(self, identities: Any) -> None:
        try:
            self._worker_process_monitor.register(
                [item if isinstance(item, ProcessIdentity) else ProcessIdentity(*item) for item in identities]
            )
        except Exception:
            logger.exception("could not register worker identities")

    def _set_fatal_error(self, error: BaseException) -> bool:
        """Record the engine's fatal error; the first one wins. Thread-safe."""
        with self._fatal_lock:
            if self._fatal_error is not None:
                return False
            self._fatal_error = error
        logger.error("fatal executor error: %s", error)
        return True

    def _mark_engine_dead(self, error: BaseException) -> None:
        """Fail every pending request with ``EngineDeadError`` and reject new ones."""
        self._engine_dead = error
        for client_id, result in list(self._results.items()):
            result.queue.put(EngineDeadError(error))
            self._results.pop(client_id, None)

    def _check_workers(self) -> BaseException | None:
        dead = self._worker_process_monitor.find_dead_worker()
        if dead is not None:
            return RuntimeError(f"MPI worker rank {dead.rank} (pid {dead.pid}) exited unexpectedly")
        for rank, future in enumerate(self.mpi_futures):
            if future.done():
                return RuntimeError(f"MPI worker future {rank} finished unexpectedly")
        return None

    def _on_fatal(self, error: BaseException) -> None:
        self._set_fatal_error(error)
        self._mark_engine_dead(self._fatal_error or error)
        self.pre_shutdown()

    def check_health(self) -> bool:
        """False once shut down or a fatal error is known; polls the monitor and the futures."""
        if self.doing_shutdown or self._fatal_error is not None:
            return False
        item = self._pop_background_error()
        error = item if item is not None else self._check_workers()
        if error is not None:
            self._on_fatal(error)
            return False
        return True

    def _error_monitor_loop(self) -> None:
        while not self._shutdown_event.wait(self.error_monitor_interval_s):
            if self.doing_shutdown:
                return
            error = self._check_workers()
            if error is not None:
                self._on_fatal(error)
                return

    def submit(self, request: GenerationRequest) -> GenerationResult:
        if self._engine_dead is not None:
            raise EngineDeadError(self._engine_dead)
        return super().submit(request)

    def _should_send_sentinel(self) -> bool:
        return not self.mpi_futures or any(not f.done() for f in self.mpi_futures)

    def shutdown(self) -> None:
        self._shutdown_event.set()
        super().shutdown()
        with contextlib.suppress(Exception):
            self._worker_process_monitor.close()


PROXY_CLASSES: dict[str, type[GenerationExecutorProxy]] = {
    "1.2": GenerationExecutorProxy,
    "main": MainGenerationExecutorProxy,
}
