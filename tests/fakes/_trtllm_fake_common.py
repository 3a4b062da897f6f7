"""Code shared by the two fake ``tensorrt_llm`` trees (``trtllm_v12/`` and ``trtllm_main/``).

Each tree's modules import from here and add their version's own names, so that a tree exposes
exactly the names its upstream version has (the extension feature-detects with ``hasattr``).
Everything here is written from the facts listed in ``tests/fakes/README.md``; no upstream code.

Both trees are importable as ``tensorrt_llm`` (one at a time per interpreter); this module is found
because each tree's ``tensorrt_llm/__init__.py`` puts ``tests/fakes`` on ``sys.path`` (workers
spawned by ``MpiPoolSession`` get the parent's ``sys.path``, as upstream passes ``path=sys.path``).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import pickle  # nosec B403: test fakes, HMAC-signed like upstream
import queue
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

logger = logging.getLogger("tensorrt_llm")

# ----------------------------------------------------------------------------- requests, responses


class GenerationRequest:
    """``executor/request.py``: the id is set by the executor (``set_id``) before it is sent."""

    def __init__(self, prompt_token_ids: list[int], max_tokens: int = 8, streaming: bool = False) -> None:
        self.prompt_token_ids = list(prompt_token_ids)
        self.max_tokens = max_tokens
        self.streaming = streaming
        self.disaggregated_params = None
        self.id: int | None = None

    def set_id(self, request_id: int) -> GenerationRequest:
        self.id = request_id
        return self


class CancellingRequest:
    """``executor/request.py``: sent on the request queue by ``abort_request``."""

    def __init__(self, request_id: int) -> None:
        self.id = request_id


@dataclass(frozen=True)
class Response:
    """Stand-in for ``tllm.Response``: one token of one request (``is_final`` ends it), or, for a
    non-streaming request, its whole output at once in ``tokens`` (its only, final response)."""

    client_id: int
    token: int
    is_final: bool
    cancelled: bool = False
    tokens: tuple[int, ...] = ()


class ErrorResponse(NamedTuple):
    """``executor/utils.py``: a per-request error sent by the worker."""

    client_id: int
    error_msg: str
    request_id: int


class RequestError(RuntimeError):
    """``executor/utils.py``: a per-request error (skipped by main's ``check_health``)."""


class WorkerCommIpcAddrs(NamedTuple):
    """``executor/utils.py`` (stats and kv-cache-event queues left out)."""

    request_queue_addr: tuple[str, bytes | None]
    worker_init_status_queue_addr: tuple[str, bytes | None]
    result_queue_addr: tuple[str, bytes | None]


@dataclass(frozen=True)
class FakeEngine:
    """What the fake passes where upstream passes the engine/model path (picklable, to every rank).

    Fault knobs (each off by default): ``init_delay_s`` (model build time), ``fail_init`` (the
    leader's build raises), ``die_rank`` with ``die_after_tokens`` (that rank SIGKILLs itself once the
    leader produced that many tokens; a subordinate counts the leader's per-token broadcasts) or
    ``die_after_s`` (seconds after READY), ``hang_rank`` (that rank stops in a ``SIGSTOP`` of itself
    after READY).

    Harness knobs (not upstream; for ``trtllm_liveness.demo._scenario_child``, which injects faults
    from outside by verified pid): ``announce_dir`` makes every rank write its identity there before
    the build (``rank<N>.json``, the layout ``reference._worker.read_announced_identities`` reads), so
    a harness knows whom to signal even on 1.2.x, whose protocol carries no identities; ``fault`` is
    the reference worker's in-rank fault hook (``{"kind": "exit0" | "oom" | "fuse", "rank", "trigger",
    "record", "cgroup", "path"}``, see ``reference._worker``), armed before the first barrier. Both
    import the package's reference harness in the rank, and only when set.

    Stall knobs (not upstream): ``step_acks`` makes every step end with each subordinate acknowledging
    it and the leader waiting for every acknowledgement (as a tensor-parallel collective waits for every
    rank: a rank that stops participating stops the leader); ``stall`` (``{"rank", "kind",
    "after_tokens"}``) makes that rank stop making progress after that many steps: ``block`` (the
    rank's step loop waits forever on an event, in user space: the leader's engine thread, a
    subordinate's main thread), ``spin`` (busy loop), ``silent`` (a subordinate that stops answering:
    it sleeps instead of acknowledging, so the leader waits in its MPI receive), ``stop`` (SIGSTOP);
    ``first_step_delay_s`` makes the leader's step loop sleep that long, before its iteration begins,
    whenever a request it has not stepped yet is active (a slow first token: no output, no iteration).
    """

    token_delay_s: float = 0.005
    init_delay_s: float = 0.0
    fail_init: bool = False
    die_rank: int | None = None
    die_after_tokens: int | None = None
    die_after_s: float | None = None
    hang_rank: int | None = None
    announce_dir: str | None = None
    fault: dict[str, Any] | None = None
    step_acks: bool = False
    stall: dict[str, Any] | None = None
    first_step_delay_s: float = 0.0


# ----------------------------------------------------------------------------- llmapi/utils.py ManagedThread


class ManagedThread(threading.Thread):
    """``llmapi/utils.py``: calls ``task()`` until it returns False or ``stop()`` was called.

    An exception of ``task()`` is logged at ERROR with its traceback (``Error in thread <name>:
    <error>``), put on ``error_queue``, and the loop goes on (the thread does not end). At the end
    it logs ``Thread <name> stopped.`` at INFO.
    """

    def __init__(self, task: Callable[[], bool] | weakref.WeakMethod[Callable[[], bool]], error_queue: Any = None,
                 name: str | None = None, **kwargs: Any) -> None:
        super().__init__(name=name, daemon=True)
        self.task = task
        self.error_queue = error_queue
        self.kwargs = kwargs
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.is_set():
            task = self.task
            if isinstance(task, weakref.WeakMethod):
                task = task()  # type: ignore[assignment]
                if task is None:
                    logger.warning("WeakMethod is expired.")
                    break
            try:
                if not task(**self.kwargs):  # type: ignore[operator]
                    break
            except Exception as error:
                logger.error("Error in thread %s: %s\n%s", self.name, error, traceback.format_exc())
                if self.error_queue is not None:
                    self.error_queue.put(error)
        logger.info("Thread %s stopped.", self.name)

    def stop(self) -> None:
        self.stop_event.set()


# ----------------------------------------------------------------------------- executor/ipc.py ZeroMqQueue


class ZeroMqQueueBase:
    """``executor/ipc.py`` ZeroMqQueue: PAIR by default, bound by the server, HMAC-signed pickles.

    No lock around the socket: sends from two threads race, as upstream. ``put`` is a blocking
    ``send``: with the peer gone (a PAIR socket has no pipe then) it never returns. The version
    differences are class attributes: ``SET_HWM_ZERO`` (``socket.set_hwm(0)``: NO limit, not
    "zero messages") and ``THREAD_CHECK`` (``TLLM_LLMAPI_ZMQ_DEBUG`` thread-ownership check).
    """

    SET_HWM_ZERO = False
    THREAD_CHECK = False

    def __init__(self, address: tuple[str, bytes | None] | None = None, *, socket_type: int | None = None,
                 is_server: bool, is_async: bool = False, name: str | None = None,
                 use_hmac_encryption: bool = True) -> None:
        import zmq

        self.socket_type = zmq.PAIR if socket_type is None else socket_type
        self.address_endpoint = address[0] if address is not None else "tcp://127.0.0.1:*"
        self.is_server = is_server
        self.context = zmq.Context()
        self.poller: Any = None
        self._setup_done = False
        self.name = name
        self.socket: Any = self.context.socket(self.socket_type)
        if self.SET_HWM_ZERO:
            self.socket.set_hwm(0)
        self._last_identity: bytes | None = None
        self.hmac_key = address[1] if address is not None else None
        self.use_hmac_encryption = use_hmac_encryption
        self._setup_lock = threading.Lock()
        self._zmq_thread_id: int | None = None
        self._zmq_debug_enabled = self.THREAD_CHECK and os.environ.get("TLLM_LLMAPI_ZMQ_DEBUG", "0") != "0"
        if self.use_hmac_encryption and not self.is_server and self.hmac_key is None:
            raise ValueError("Client must receive HMAC key when encryption is enabled")
        if self._binds():
            self.socket.bind(self.address_endpoint)
            self.address_endpoint = self.socket.getsockopt(zmq.LAST_ENDPOINT).decode()
            if self.use_hmac_encryption and not self.hmac_key:
                self.hmac_key = os.urandom(32)
            self.address = (self.address_endpoint, self.hmac_key)

    def _binds(self) -> bool:
        import zmq

        if self.socket_type == zmq.ROUTER:
            return True
        return self.is_server and self.socket_type in (zmq.PAIR, zmq.PULL, zmq.PUSH)

    def setup_lazily(self) -> None:
        import zmq

        if self._setup_done:
            return
        with self._setup_lock:
            if self._setup_done:
                return
            self._setup_done = True
            if not self.is_server:
                self.socket.connect(self.address_endpoint)
            self.poller = zmq.Poller()
            self.poller.register(self.socket, zmq.POLLIN)

    def _check_thread_safety(self) -> None:
        if not self._zmq_debug_enabled:
            return
        current = threading.get_ident()
        if self._zmq_thread_id is None:
            self._zmq_thread_id = current
        elif self._zmq_thread_id != current:
            raise RuntimeError(
                f"ZMQ thread safety violation detected in [{self.name}]: "
                f"Socket created on thread {self._zmq_thread_id}, but accessed from thread {current}. "
                "ZMQ sockets are not thread-safe!")

    def poll(self, timeout: float) -> bool:
        """``timeout`` in seconds, as upstream."""
        import zmq

        self.setup_lazily()
        self._check_thread_safety()
        events = dict(self.poller.poll(timeout=timeout * 1000))
        return events.get(self.socket) == zmq.POLLIN

    def put(self, obj: Any, routing_id: bytes | None = None) -> None:
        """Blocking send, no timeout (upstream's)."""
        self.setup_lazily()
        self._check_thread_safety()
        self._send_data(self._prepare_data(obj), routing_id=routing_id)

    def put_noblock(self, obj: Any, *, retry: int = 1, wait_time: float = 0.001) -> None:
        """Non-blocking send retried ``retry`` times, ``wait_time`` apart; a failure is only logged."""
        import zmq

        assert 0 <= retry <= 10, "Retry must be between 0 and 10, adjust the wait_time if needed"
        self.setup_lazily()
        self._check_thread_safety()
        data = self._prepare_data(obj)
        try:
            self._send_data(data, flags=zmq.NOBLOCK)
        except zmq.Again:
            if retry > 0:
                time.sleep(wait_time)
                self.put_noblock(obj, retry=retry - 1, wait_time=wait_time)
            else:
                logger.error("Failed to send object: %r", obj)

    def get(self) -> Any:
        """Blocking receive, no timeout (upstream's)."""
        import zmq

        self.setup_lazily()
        self._check_thread_safety()
        if self.socket_type == zmq.ROUTER:
            identity, data = self.socket.recv_multipart()
            self._last_identity = identity
            return self._parse_data(data)
        return self._parse_data(self.socket.recv())

    def notify_with_retry(self, message: Any, max_retries: int = 5, timeout: float = 1) -> bool:
        """DEALER only: send, wait ``timeout`` s for the ACK, resend up to ``max_retries`` times."""
        import zmq

        if self.socket_type != zmq.DEALER:
            raise ValueError("notify_with_retry is only supported for DEALER socket for now")
        for _ in range(max_retries):
            try:
                self.put(message)
                if self.poll(timeout):
                    self.get()
                    return True
            except Exception as error:
                logger.error("Failed to notify with retry: %s", error)
        return False

    def close(self) -> None:
        """``socket.close()`` then ``context.term()`` with the default linger, as upstream."""
        if self.socket is not None:
            self.socket.close()
            self.socket = None
        if self.context is not None:
            self.context.term()
            self.context = None

    def _prepare_data(self, obj: Any) -> bytes:
        data = pickle.dumps(obj)
        if self.use_hmac_encryption:
            assert self.hmac_key is not None
            data += hmac.new(self.hmac_key, data, hashlib.sha256).digest()
        return data

    def _parse_data(self, data: bytes) -> Any:
        if self.use_hmac_encryption:
            assert self.hmac_key is not None
            body, tag = data[:-32], data[-32:]
            if not hmac.compare_digest(hmac.new(self.hmac_key, body, hashlib.sha256).digest(), tag):
                raise RuntimeError("HMAC verification failed")
            return pickle.loads(body)  # nosec B301
        return pickle.loads(data)  # nosec B301

    def _send_data(self, data: bytes, flags: int = 0, routing_id: bytes | None = None) -> None:
        import zmq

        if self.socket_type == zmq.ROUTER:
            identity = routing_id if routing_id is not None else self._last_identity
            if identity is None:
                raise ValueError("ROUTER socket requires identity")
            self.socket.send_multipart([identity, data], flags=flags)
        else:
            self.socket.send(data, flags=flags)


# ----------------------------------------------------------------------------- executor/result.py


class GenerationResultBase:
    """``executor/result.py`` GenerationResult, reduced to token ids.

    ``abort()`` asks the executor (``abort_request``) and completes nothing locally: the result
    finishes only when the worker's final (cancelled) response arrives.
    """

    ENGINE_DEAD_ERROR: type[BaseException] | None = None  # main: EngineDeadError

    def __init__(self, generation_request: GenerationRequest, background_error_handler: Any = None,
                 executor: Any = None, disaggregated_params: Any = None, logprob_params: Any = None) -> None:
        assert generation_request.id is not None
        self.request_id = generation_request.id
        self._executor = weakref.ref(executor) if executor is not None else None
        self._background_error_handler = background_error_handler
        self.queue: queue.Queue[Any] = queue.Queue()
        self.token_ids: list[int] = []
        self._done = False
        self._cancelled = False
        self._terminal_error: BaseException | None = None

    @property
    def finished(self) -> bool:
        return self._done

    def abort(self) -> None:
        executor = self._executor() if self._executor is not None else None
        assert executor is not None, "The executor is not set for this result."
        executor.abort_request(self.request_id)

    def _result_step(self, timeout: float | None = None) -> None:
        item = self.queue.get(timeout=timeout)
        dead = self.ENGINE_DEAD_ERROR
        if dead is not None and isinstance(item, dead):
            self._done = True
            self._terminal_error = item
            raise item
        if isinstance(item, ErrorResponse):
            self._done = True
            raise RequestError(item.error_msg)
        assert isinstance(item, Response)
        if item.tokens:
            self.token_ids.extend(item.tokens)
        else:
            self.token_ids.append(item.token)
        if item.is_final:
            self._done = True
            self._cancelled = item.cancelled

    def result(self, timeout: float | None = None) -> GenerationResultBase:
        """Wait for the final response (``timeout`` per response, ``queue.Empty`` past it)."""
        if self._terminal_error is not None:
            raise self._terminal_error
        while not self._done:
            self._result_step(timeout)
        if self._terminal_error is not None:
            raise self._terminal_error
        return self

    def _exception(self) -> BaseException | None:
        return self._terminal_error


def format_exc() -> str:
    return traceback.format_exc()


# ----------------------------------------------------------------------------- _utils.py: the MPI communicator

_COMM: Any = None


def mpi_comm() -> Any:
    """``_utils.mpi_comm()``: the module's communicator (COMM_WORLD unless ``set_mpi_comm``)."""
    if _COMM is not None:
        return _COMM
    from mpi4py import MPI

    return MPI.COMM_WORLD


def set_mpi_comm(comm: Any) -> None:
    global _COMM
    _COMM = comm


def mpi_rank() -> int:
    return int(mpi_comm().Get_rank())


def mpi_world_size() -> int:
    return int(mpi_comm().Get_size())


# ----------------------------------------------------------------------------- llmapi/mpi_session.py


def _forwarded_env() -> dict[str, str]:
    """``MpiPoolSession._start_mpi_pool``: TRTLLM*/TLLM* variables go to the spawned workers."""
    return {k: v for k, v in os.environ.items() if k.startswith(("TRTLLM", "TLLM"))}


class MpiSessionBase:
    """``llmapi/mpi_session.py`` MpiSession (``submit`` -> one future per rank)."""

    n_workers: int

    def submit(self, task: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        raise NotImplementedError

    def submit_sync(self, task: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        return [f.result() for f in self.submit(task, *args, **kwargs)]

    def shutdown(self, wait: bool = True) -> None:
        raise NotImplementedError

    def abort(self) -> None:
        self.get_comm().Abort(1)

    def get_comm(self) -> Any:
        raise NotImplementedError

    def _abort_on_timeout(self, fut: Any, timeout: float, reason: Any = None) -> None:
        import concurrent.futures

        try:
            fut.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            logger.critical("MpiSession shutdown timeout after %ss; calling MPI_Abort (reason %r)", timeout, reason)
            self.abort()

    def shutdown_abort(self, grace: float = 60, reason: Any = None) -> None:
        """``shutdown()`` with a killer thread that calls ``MPI_Abort`` after ``grace`` seconds."""
        import concurrent.futures
        import sys

        if sys.is_finalizing():
            self.shutdown(wait=False)
            return
        fut: concurrent.futures.Future[None] = concurrent.futures.Future()
        killer = threading.Thread(target=self._abort_on_timeout, name="MpiSessionTimeoutKiller",
                                  args=(fut, grace, reason), daemon=True)
        killer.start()
        self.shutdown()
        fut.set_result(None)
        killer.join(timeout=grace)

    def __reduce__(self) -> Any:
        raise TypeError("cannot pickle MPI session")


class MpiPoolSessionBase(MpiSessionBase):
    """``MpiPoolSession``: a real ``mpi4py.futures.MPIPoolExecutor`` (workers spawned, not children)."""

    def __init__(self, n_workers: int) -> None:
        import sys

        from mpi4py.futures import MPIPoolExecutor

        self.n_workers = n_workers
        self.mpi_pool: Any = MPIPoolExecutor(max_workers=n_workers, path=sys.path, env=_forwarded_env())
        from mpi4py import MPI

        self.comm = MPI.COMM_WORLD

    def get_comm(self) -> Any:
        return self.comm

    def submit(self, task: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        return [self.mpi_pool.submit(task, *args, **kwargs) for _ in range(self.n_workers)]

    def shutdown(self, wait: bool = True) -> None:
        if self.mpi_pool is not None:
            self.mpi_pool.shutdown(wait=wait)
            self.mpi_pool = None


class MpiCommSessionBase(MpiSessionBase):
    """``MpiCommSession``: ranks launched by mpirun; rank 0's task runs in THIS process's thread pool.

    ``comm`` may be a sub-communicator (then a private ``MPICommExecutor`` is made for it); with
    COMM_WORLD one process-wide executor is shared, as upstream (``MPINodeState``).
    """

    _global_comm_executor: Any = None
    _global_mpi_pool: Any = None

    def __init__(self, comm: Any = None, n_workers: int = 1) -> None:
        from concurrent.futures import ThreadPoolExecutor

        from mpi4py import MPI
        from mpi4py.futures import MPICommExecutor

        if n_workers <= 0:
            raise ValueError(f"n_workers must be non-negative, but got {n_workers}")
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        self.n_workers = n_workers
        if self.comm.Get_rank() != 0:
            raise RuntimeError(f"only rank 0 can start multi-node session, got {self.comm.Get_rank()}")
        if self.comm.Get_size() != n_workers:
            raise ValueError(f"n_workers must be equal to the number of processes in MPI, got {n_workers}")
        set_mpi_comm(self.comm)  # the fake's stand-in for upstream's session communicator (README)
        self.thread_pool: Any = ThreadPoolExecutor(max_workers=2)
        if self.comm == MPI.COMM_WORLD:
            if MpiCommSessionBase._global_comm_executor is None:
                MpiCommSessionBase._global_comm_executor = MPICommExecutor(self.comm)
                MpiCommSessionBase._global_mpi_pool = MpiCommSessionBase._global_comm_executor.__enter__()
            self.mpi_pool: Any = MpiCommSessionBase._global_mpi_pool
            self.owns_mpi_pool = False
        else:
            self._comm_executor = MPICommExecutor(self.comm)
            self.mpi_pool = self._comm_executor.__enter__()
            self.owns_mpi_pool = True

    def get_comm(self) -> Any:
        return self.comm

    def submit(self, task: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        assert self.mpi_pool is not None, "MPI session not started"
        worker_futures = [self.mpi_pool.submit(task, *args, **kwargs) for _ in range(self.n_workers - 1)]
        rank0_future = self.thread_pool.submit(task, *args, **kwargs)
        return [rank0_future, *worker_futures]

    def shutdown(self, wait: bool = True) -> None:
        if self.mpi_pool is not None and self.owns_mpi_pool:
            self.mpi_pool.shutdown(wait=wait)
        self.mpi_pool = None
        if self.thread_pool is not None:
            self.thread_pool.shutdown(wait=wait)
            self.thread_pool = None


def serve_comm_workers(comm: Any = None) -> None:
    """Non-leader ranks of an mpirun-launched job: serve ``MpiCommSession`` tasks until rank 0 ends.

    The fake's stand-in for upstream's worker-node entry (README): ``MPICommExecutor.__enter__``
    on a non-root rank runs the task loop and returns None when the root shuts the executor down.
    """
    from mpi4py import MPI
    from mpi4py.futures import MPICommExecutor

    comm = comm if comm is not None else MPI.COMM_WORLD
    set_mpi_comm(comm)
    with MPICommExecutor(comm) as executor:
        assert executor is None, "serve_comm_workers is for ranks other than 0"


class RemoteTask(NamedTuple):
    task: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    sync: bool = False


class RemoteMpiCommSessionClientBase(MpiSessionBase):
    """``RemoteMpiCommSessionClient``: tasks go over a PAIR queue to a server; ``submit`` returns ``[]``."""

    queue_cls: Any = ZeroMqQueueBase

    def __init__(self, addr: str, hmac_key: bytes | None = None) -> None:
        import zmq

        self.addr = addr
        self.n_workers = 0
        self.queue = self.queue_cls((addr, hmac_key), is_server=False, socket_type=zmq.PAIR,
                                    use_hmac_encryption=hmac_key is not None)
        self._is_shutdown = False
        self._pending_responses: list[Any] = []

    def submit(self, task: Callable[..., Any], *args: Any, sync: bool = False, **kwargs: Any) -> list[Any]:
        if self._is_shutdown:
            return []
        self.queue.put(RemoteTask(task, args, kwargs, sync=sync))
        return []

    def shutdown(self, wait: bool = True) -> None:
        self._is_shutdown = True

    def get_comm(self) -> Any:
        raise RuntimeError("a remote session has no local communicator")


# ----------------------------------------------------------------------------- executor/worker.py


class FakeEngineWorker:
    """Stand-in for ``GenerationExecutorWorker`` on the leader: a token generator in a thread.

    Every token step the leader broadcasts to the subordinates (a real MPI collective, as a tensor
    parallel engine would run one), so a dead or stopped rank is felt by the others as upstream's.
    """

    def __init__(self, engine: FakeEngine, result_queue: Any, comm: Any) -> None:
        if engine.init_delay_s:
            time.sleep(engine.init_delay_s)
        if engine.fail_init:
            raise RuntimeError("fake engine build failed (fail_init)")
        self.engine = engine
        self.result_queue = result_queue
        self.comm = comm
        self._active: dict[int, list[int]] = {}  # client id -> [produced, max_tokens, streaming]
        self._cancelled: set[int] = set()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self.tokens = 0
        self.hang_detector = _hang_detector()  # main: checkpoint() per iteration, as upstream's executor loop
        self._thread = threading.Thread(target=self._run, name="fake_engine_loop", daemon=True)
        self._thread.start()

    def submit(self, request: GenerationRequest) -> None:
        assert request.id is not None
        with self._lock:
            self._active[request.id] = [0, request.max_tokens, int(request.streaming)]
        self._wake.set()

    def abort_request(self, request_id: int) -> None:
        with self._lock:
            if request_id in self._active:
                self._cancelled.add(request_id)
        self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait(0.05)
            self._wake.clear()
            with self._lock:
                stop = self._stop
                active = list(self._active.items())
            if stop:
                # The end marker that ends the proxy's dispatch thread, sent by the thread that
                # sent every response: the result socket's only user (main's TLLM_LLMAPI_ZMQ_DEBUG).
                self.result_queue.put(None)
                return
            if not active:
                continue
            if self.engine.first_step_delay_s and any(state[0] == 0 for _id, state in active):
                time.sleep(self.engine.first_step_delay_s)
            if self.hang_detector is not None:
                self.hang_detector.checkpoint()
            time.sleep(self.engine.token_delay_s)
            if self.comm.Get_size() > 1:
                self.comm.bcast(("step", self.tokens), root=0)
                if self.engine.step_acks:
                    _wait_step_acks(self.comm)
            for client_id, state in active:
                with self._lock:
                    cancelled = client_id in self._cancelled
                state[0] += 1
                final = cancelled or state[0] >= state[1]
                if state[2]:
                    self.result_queue.put(Response(client_id, state[0], final, cancelled))
                elif final:  # non-streaming: one response with the whole output, at the end
                    self.result_queue.put(Response(client_id, state[0], final, cancelled,
                                                   tuple(range(1, state[0] + 1))))
                if final:
                    with self._lock:
                        self._active.pop(client_id, None)
                        self._cancelled.discard(client_id)
            self.tokens += 1
            _maybe_fault(self.engine, 0, self.tokens)
            _maybe_stall(self.engine, 0, self.tokens)
            self._wake.set()

    def shutdown(self) -> None:
        with self._lock:
            self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)
        if self.comm.Get_size() > 1:
            self.comm.bcast(("stop", self.tokens), root=0)


def _arm_harness_fault(fault: dict[str, Any]) -> None:
    """``FakeEngine.fault``: the reference worker's hook, so a fault is the same on both engines
    (an OOM victim moves itself into its memory cgroup here, before any identity is taken)."""
    from trtllm_liveness.demo._executor_worker import _arm_fault

    _arm_fault(fault)


def _announce_identity(directory: str, rank: int) -> None:
    """``FakeEngine.announce_dir``: this rank's identity, written atomically (a reader never sees half)."""
    import json

    from trtllm_liveness.process import capture_identity

    path = os.path.join(directory, f"rank{rank}.json")
    with open(path + ".tmp", "w") as handle:
        json.dump(list(capture_identity(rank)), handle)
    os.replace(path + ".tmp", path)


def _maybe_fault(engine: FakeEngine, rank: int, tokens: int) -> None:
    import signal

    if engine.die_rank == rank and engine.die_after_tokens is not None and tokens >= engine.die_after_tokens:
        os.kill(os.getpid(), signal.SIGKILL)


def _hang_detector() -> Any:
    """main's ``HangDetector`` where the tree has it (1.2.x as read: none)."""
    try:
        from tensorrt_llm._torch.pyexecutor.hang_detector import HangDetector
    except ImportError:
        return None
    return HangDetector()


_TAG_STEP_ACK = 21


def _wait_step_acks(comm: Any) -> None:
    """The leader's wait for every subordinate's acknowledgement of a step (``step_acks``):
    non-blocking receives polled with short sleeps (Open MPI's blocking receive spins)."""
    for peer in range(1, comm.Get_size()):
        request = comm.irecv(source=peer, tag=_TAG_STEP_ACK)
        while True:
            done, _message = request.test()
            if done:
                break
            time.sleep(0.001)


def _block_forever() -> None:
    never = threading.Event()  # the injected stall: user space, until the harness ends the rank
    while not never.wait(3600):
        pass


def _spin_forever() -> None:
    while True:
        pass


def _stop_answering() -> None:
    while True:
        time.sleep(3600)


def _maybe_stall(engine: FakeEngine, rank: int, tokens: int) -> None:
    """``FakeEngine.stall``: this rank stops making progress (see the knob)."""
    import signal

    stall = engine.stall
    if stall is None or stall.get("rank") != rank or tokens < int(stall.get("after_tokens", 1)):
        return
    kind = stall.get("kind")
    if kind == "block":
        _block_forever()
    elif kind == "spin":
        _spin_forever()
    elif kind == "silent":
        _stop_answering()
    elif kind == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)


def _subordinate_loop(engine: FakeEngine, comm: Any, rank: int) -> None:
    """Non-leader ranks: follow the leader's per-step broadcasts until it says stop."""
    import signal

    if engine.hang_rank == rank:
        os.kill(os.getpid(), signal.SIGSTOP)
    if engine.die_rank == rank and engine.die_after_s is not None:
        threading.Timer(engine.die_after_s, os.kill, (os.getpid(), signal.SIGKILL)).start()
    hang_detector = _hang_detector()  # every rank's executor loop checkpoints, as upstream's
    while True:
        kind, tokens = comm.bcast(None, root=0)
        if kind == "stop":
            return
        if hang_detector is not None:
            hang_detector.checkpoint()
        _maybe_fault(engine, rank, tokens + 1)
        _maybe_stall(engine, rank, tokens + 1)
        if engine.step_acks:
            comm.send(None, dest=0, tag=_TAG_STEP_ACK)


def worker_main_impl(*, engine: Any, worker_queues: WorkerCommIpcAddrs, ready_signal: bytes,
                     queue_cls: Any, identities_signal: bytes | None, capture_identity: Any,
                     worker_cls: Any = None, **_: Any) -> None:
    """``worker_main``: barrier, the leader opens the queues, (main) identities, build, READY, serve."""
    import signal

    import zmq

    comm = mpi_comm()
    rank = comm.Get_rank()
    spec = engine if isinstance(engine, FakeEngine) else FakeEngine()
    if spec.fault is not None and spec.fault.get("rank") == rank:
        _arm_harness_fault(spec.fault)
    comm.barrier()
    if spec.announce_dir is not None:
        _announce_identity(spec.announce_dir, rank)
    leader = rank == 0
    if leader:
        request_queue = queue_cls(worker_queues.request_queue_addr, is_server=False, name="worker_request_queue")
        init_queue = queue_cls(worker_queues.worker_init_status_queue_addr, is_server=False,
                               socket_type=zmq.DEALER, name="worker_init_status_queue")
        result_queue = queue_cls(worker_queues.result_queue_addr, is_server=False, name="worker_result_queue")
    identities = None
    if capture_identity is not None:  # main: every rank's identity, gathered before the build
        identities = comm.allgather(capture_identity(rank))
    if identities_signal is not None:
        if leader and not init_queue.notify_with_retry((identities_signal, None, identities)):
            raise RuntimeError("Failed to deliver worker process identities to proxy")
    worker: FakeEngineWorker | None = None
    try:
        if leader:
            worker = FakeEngineWorker(spec, result_queue, comm)
        elif spec.init_delay_s:
            time.sleep(spec.init_delay_s)
    except Exception as error:
        if leader:
            status = (error, format_exc()) if identities is None else (error, format_exc(), identities)
            init_queue.notify_with_retry(status)
        return
    if not leader:
        _subordinate_loop(spec, comm, rank)
        return
    assert worker is not None
    ready = (ready_signal, None) if identities is None else (ready_signal, None, identities)
    if not init_queue.notify_with_retry(ready):
        logger.error("worker: READY was not acknowledged")
    if spec.hang_rank == 0:
        os.kill(os.getpid(), signal.SIGSTOP)
    if spec.die_rank == 0 and spec.die_after_s is not None:
        threading.Timer(spec.die_after_s, os.kill, (os.getpid(), signal.SIGKILL)).start()
    while (req := request_queue.get()) is not None:
        if isinstance(req, CancellingRequest):
            worker.abort_request(req.id)
        else:
            worker.submit(req)
    worker.shutdown()  # its engine thread sends the end marker that ends the proxy's dispatch thread
    for q in (request_queue, init_queue, result_queue):
        q.socket.setsockopt(zmq.LINGER, 1000)
        q.close()


# ----------------------------------------------------------------------------- executor/executor.py


class GenerationExecutorBase:
    """``executor/executor.py`` GenerationExecutor: ``atexit.register(self.shutdown)`` in ``__init__``."""

    def __init__(self, num_postprocess_workers: int = 0, postprocess_tokenizer_dir: str | None = None,
                 is_llm_executor: bool | None = None) -> None:
        import atexit

        atexit.register(self.shutdown)
        self._error_queue: queue.Queue[Any] = queue.Queue()
        self.doing_shutdown = False
        self._last_client_id = 1
        self._is_llm_executor = is_llm_executor

    def submit(self, request: GenerationRequest) -> Any:
        raise NotImplementedError

    def abort_request(self, request_id: int) -> None:
        raise NotImplementedError

    def shutdown(self) -> None:
        raise NotImplementedError

    def generate_async(self, prompt_token_ids: list[int], max_tokens: int = 8, streaming: bool = False) -> Any:
        """Upstream takes ``SamplingParams``; the fake takes ``max_tokens`` (README)."""
        return self.submit(GenerationRequest(prompt_token_ids, max_tokens=max_tokens, streaming=streaming))

    def _get_next_client_id(self) -> int:
        self._last_client_id = (self._last_client_id + 1) & ((1 << 64) - 1)
        return self._last_client_id

    def _handle_background_error(self, error: Any = None) -> None:
        """Raise a per-request error as ``RequestError``; any other error shuts down, then raises."""
        if error is not None:
            if isinstance(error, str):
                error = RequestError(error)
            elif not isinstance(error, RequestError):
                if not isinstance(error, BaseException):
                    error = RuntimeError(repr(error))
                self.shutdown()
            raise error
        if not self._error_queue.empty():
            e = self._error_queue.get()
            self._error_queue.task_done()
            self.shutdown()
            raise e

    def is_shutdown(self) -> bool:
        return self.doing_shutdown


class RouteStandIn(GenerationExecutorBase):
    """Base of the fake's rpc / ray / single-process executors: records what ``create`` passed.

    They run no workers; a test only needs to see which route ``create`` took (README).
    """

    def __init__(self, worker_kwargs: dict[str, Any], **kwargs: Any) -> None:
        super().__init__(is_llm_executor=kwargs.get("is_llm_executor"))
        self.worker_kwargs = worker_kwargs
        self.create_kwargs = kwargs

    def submit(self, request: GenerationRequest) -> Any:
        raise NotImplementedError(f"{type(self).__name__} is a route stand-in of the fake")

    def abort_request(self, request_id: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} is a route stand-in of the fake")

    def shutdown(self) -> None:
        self.doing_shutdown = True


class GenerationExecutorRoutes(GenerationExecutorBase):
    """``create()`` and its routes, the same in both trees (each tree is ``tensorrt_llm`` when loaded,
    so the absolute imports below reach the loaded tree's modules, at call time as upstream)."""

    @staticmethod
    def _create_ray_executor(worker_kwargs: dict[str, Any], model_world_size: int, postproc_worker_config: Any,
                             is_llm_executor: Any, tp_size: int) -> Any:
        from tensorrt_llm.executor.ray_executor import RayExecutor

        return RayExecutor(worker_kwargs, model_world_size=model_world_size,
                           postproc_worker_config=postproc_worker_config, is_llm_executor=is_llm_executor,
                           tp_size=tp_size)

    @staticmethod
    def _create_rpc_executor(worker_kwargs: dict[str, Any], model_world_size: int, mpi_session: Any,
                             postproc_worker_config: Any, is_llm_executor: Any) -> Any:
        from tensorrt_llm.executor.rpc_proxy import GenerationExecutorRpcProxy

        return GenerationExecutorRpcProxy(worker_kwargs, model_world_size=model_world_size, mpi_session=mpi_session,
                                          postproc_worker_config=postproc_worker_config,
                                          is_llm_executor=is_llm_executor)

    @staticmethod
    def _create_ipc_executor(worker_kwargs: dict[str, Any], model_world_size: int, mpi_session: Any,
                             postproc_worker_config: Any, is_llm_executor: Any, use_worker: bool = False) -> Any:
        if use_worker:
            from tensorrt_llm.executor.worker import GenerationExecutorWorker

            return GenerationExecutorWorker(worker_kwargs, is_llm_executor=is_llm_executor)
        from tensorrt_llm.executor.proxy import GenerationExecutorProxy  # at call time, as upstream

        return GenerationExecutorProxy(worker_kwargs, model_world_size=model_world_size, mpi_session=mpi_session,
                                       postproc_worker_config=postproc_worker_config,
                                       is_llm_executor=is_llm_executor)

    @staticmethod
    def create(engine: Any = None, **kwargs: Any) -> Any:
        from tensorrt_llm.executor.executor import GenerationExecutor

        return create_executor(GenerationExecutor, engine, **kwargs)


def create_executor(cls: Any, engine: Any, *, executor_config: Any = None, batched_logits_processor: Any = None,
                    model_world_size: int = 1, world_size: int = 0, mpi_session: Any = None,
                    reuse_mpi_comm: bool = False, return_logits: bool = False, postproc_worker_config: Any = None,
                    is_llm_executor: bool | None = None, hf_model_dir: Any = None, tokenizer: Any = None,
                    llm_args: Any = None, **args: Any) -> Any:
    """``GenerationExecutor.create``'s routing: ray, rpc, single process, else the IPC proxy.

    Every route goes through ``cls``'s static ``_create_*_executor`` so a subclass (the extension)
    can override one, as upstream. The mpirun / spawn distinction is reduced to "a session was
    passed or not" (README).
    """
    worker_kwargs = {"engine": engine, "executor_config": executor_config,
                     "batched_logits_processor": batched_logits_processor, "hf_model_dir": hf_model_dir,
                     "tokenizer": tokenizer, "llm_args": llm_args}
    orchestrator_type = getattr(llm_args, "orchestrator_type", None)
    if orchestrator_type == "ray":
        return cls._create_ray_executor(worker_kwargs, model_world_size, postproc_worker_config,
                                        is_llm_executor=is_llm_executor, tp_size=args.get("tp_size", 1))
    if orchestrator_type is not None and orchestrator_type != "rpc":
        raise ValueError(f"Unsupported orchestrator_type: {orchestrator_type}")
    rpc = orchestrator_type == "rpc"
    single = return_logits or os.environ.get("TLLM_WORKER_USE_SINGLE_PROCESS", "0") == "1"
    if rpc:
        return cls._create_rpc_executor(worker_kwargs, model_world_size=model_world_size, mpi_session=mpi_session,
                                        postproc_worker_config=postproc_worker_config,
                                        is_llm_executor=is_llm_executor)
    if single and model_world_size <= 1 and mpi_session is None:
        logger.warning("Using single process worker for TP1, this may hurt streaming generation performance.")
        return cls._create_ipc_executor(worker_kwargs, model_world_size=model_world_size, mpi_session=mpi_session,
                                        postproc_worker_config=postproc_worker_config,
                                        is_llm_executor=is_llm_executor, use_worker=True)
    return cls._create_ipc_executor(worker_kwargs, model_world_size=model_world_size, mpi_session=mpi_session,
                                    postproc_worker_config=postproc_worker_config, is_llm_executor=is_llm_executor,
                                    use_worker=False)


# ----------------------------------------------------------------------------- executor/proxy.py (1.2.x shape)


def proxy_module() -> Any:
    """The running tree's ``tensorrt_llm.executor.proxy`` (its globals are looked up at call time)."""
    import importlib

    return importlib.import_module("tensorrt_llm.executor.proxy")


class ProxyCore(GenerationExecutorBase):
    """``GenerationExecutorProxy`` as in 1.2.x; main's tree overrides what changed (README).

    Queues: request (PAIR, proxy binds), worker_init_status (ROUTER, proxy binds; the leader's
    DEALER waits for "ACK"), result (PAIR). Threads: ``proxy_dispatch_result_thread`` (blocking
    ``get``). At construction the proxy registers ``pre_shutdown`` with
    ``threading._register_atexit`` (before the interpreter joins threads, so before mpi4py's
    join of its manager threads) and, in ``GenerationExecutor.__init__``, ``atexit`` ``shutdown``.
    """

    READY_SIGNAL = b"READY"

    def __init__(self, worker_kwargs: dict[str, Any], model_world_size: int = 1, mpi_session: Any = None, *,
                 worker_cls: Any = None, postproc_worker_config: Any = None,
                 is_llm_executor: bool | None = None) -> None:
        import atexit

        super().__init__(is_llm_executor=is_llm_executor)
        # Instrumentation, not upstream: how many times pre_shutdown() did its work (got past its
        # guards); the scenario harness reports it. main's tree counts the same in its override.
        self._fake_pre_shutdown_runs = 0
        self.workers_started = False
        self.worker_cls = worker_cls
        module = proxy_module()
        if mpi_session is None:
            self.mpi_session = module.MpiPoolSession(n_workers=model_world_size)
        else:
            self.mpi_session = mpi_session
        self._results: dict[int, Any] = {}
        self.model_world_size = model_world_size
        self._init_version_state(mpi_session)
        worker_kwargs = dict(**worker_kwargs, worker_queues=self._setup_queues(),
                             postproc_worker_config=postproc_worker_config, is_llm_executor=False)
        self.dispatch_result_thread: ManagedThread | None = None
        self._start_executor_workers(worker_kwargs)
        try:
            threading._register_atexit(self.pre_shutdown)  # type: ignore[attr-defined]
        except AttributeError:
            atexit.register(self.pre_shutdown)

    def _init_version_state(self, mpi_session: Any) -> None:
        """main's tree sets its extra state here (before the workers start)."""

    def _queue_cls(self) -> Any:
        return proxy_module().IpcQueue

    def _setup_queues(self) -> WorkerCommIpcAddrs:
        import zmq

        ipc = self._queue_cls()
        self.request_queue = ipc(is_server=True, name="proxy_request_queue")
        self.worker_init_status_queue = ipc(is_server=True, socket_type=zmq.ROUTER, name="worker_init_status_queue")
        self.result_queue = ipc(is_server=True, name="proxy_result_queue")
        return WorkerCommIpcAddrs(request_queue_addr=self.request_queue.address,
                                  worker_init_status_queue_addr=self.worker_init_status_queue.address,
                                  result_queue_addr=self.result_queue.address)

    def abort_request(self, request_id: int) -> None:
        """Blocking ``put`` of a ``CancellingRequest`` (no timeout, no lock), as upstream."""
        self.request_queue.put(CancellingRequest(request_id))

    def _result_error_types(self) -> tuple[type, ...]:
        return (ErrorResponse,)

    def dispatch_result_task(self) -> bool:
        """1.2.x: each response's result is looked up as ``self._results[client_id]``: a response for
        an id no longer in the table raises ``KeyError`` in the dispatch thread (``ManagedThread``
        logs it at ERROR and puts it on ``_error_queue``). main's tree uses ``.get()``."""
        if (res := self.result_queue.get()) is None:
            return False
        for item in res if isinstance(res, list) else [res]:
            if item is None:
                return False
            result = self._results[item.client_id]
            result.queue.put(item)
            if isinstance(item, ErrorResponse) or (isinstance(item, Response) and item.is_final):
                self._results.pop(item.client_id)
        return True

    def _start_dispatch_threads(self) -> None:
        if self.dispatch_result_thread is None:
            self.dispatch_result_thread = ManagedThread(weakref.WeakMethod(self.dispatch_result_task),
                                                        error_queue=self._error_queue,
                                                        name="proxy_dispatch_result_thread")
            self.dispatch_result_thread.start()
        self._handle_background_error()

    def _mpi_done_callback_factory(self) -> Callable[[Any], None]:
        self_ref = weakref.ref(self)

        def mpi_done_callback(future: Any) -> None:
            if future.exception() is not None:
                if (self_ := self_ref()) is not None:
                    self_._error_queue.put_nowait(future.exception())

        return mpi_done_callback

    def _submit_workers(self, worker_kwargs: dict[str, Any], **extra: Any) -> None:
        module = proxy_module()
        self.mpi_futures = self.mpi_session.submit(module.worker_main, **worker_kwargs, worker_cls=self.worker_cls,
                                                   ready_signal=self.READY_SIGNAL, **extra)
        callback = self._mpi_done_callback_factory()
        for fut in self.mpi_futures:
            fut.add_done_callback(callback)
        self.workers_started = True

    def _start_executor_workers(self, worker_kwargs: dict[str, Any]) -> None:
        """Submit to every rank, then poll 1 s at a time: READY, an error, or a done future. No bound."""
        self._submit_workers(worker_kwargs)
        while True:
            if self.worker_init_status_queue.poll(1):
                ready_signal, error_trace = self.worker_init_status_queue.get()
                self.worker_init_status_queue.put("ACK")
                break
            if any(fut.done() for fut in self.mpi_futures):
                logger.error("Executor worker died during initialization.")
                raise RuntimeError("Executor worker died during initialization")
            self._handle_background_error()
        if ready_signal != self.READY_SIGNAL:
            logger.error("Executor worker initialization error: %s", error_trace)
            self.mpi_session.shutdown_abort(reason=ready_signal)
            raise RuntimeError("Executor worker returned error") from ready_signal

    def _abort_all_requests(self) -> None:
        for result in list(self._results.values()):
            result.abort()

    def pre_shutdown(self) -> None:
        """1.2.x: abort every pending request, then the stop sentinel only if NO future is done."""
        if not self.workers_started:
            return
        if self.doing_shutdown:
            return
        self.doing_shutdown = True
        self._fake_pre_shutdown_runs += 1
        self._abort_all_requests()
        if all(not f.done() for f in self.mpi_futures):
            self.request_queue.put_noblock(None, retry=4)

    def _close_queues(self) -> None:
        self.request_queue.close()
        self.worker_init_status_queue.close()
        self.result_queue.close()

    def shutdown(self) -> None:
        """1.2.x: unbounded ``f.result()`` per future and ``join()`` of the dispatch thread."""
        if not self.workers_started:
            return
        if not self.doing_shutdown:
            self.pre_shutdown()
        for f in self.mpi_futures:
            try:
                f.result()
            except BaseException:
                pass
        if self.dispatch_result_thread is not None and self.dispatch_result_thread.is_alive():
            self.dispatch_result_thread.stop()
            self.dispatch_result_thread.join()
        self._close_queues()
        self.workers_started = False
        self.mpi_session.shutdown()
        self._handle_background_error()

    def _new_result(self, request: GenerationRequest) -> Any:
        return proxy_module().GenerationResult(request, background_error_handler=self._handle_background_error,
                                               executor=self,
                                               disaggregated_params=request.disaggregated_params)

    def submit(self, request: GenerationRequest) -> Any:
        self._start_dispatch_threads()
        request.set_id(self._get_next_client_id())
        result = self._new_result(request)
        assert request.id is not None
        self._results[request.id] = result
        self.request_queue.put(request)
        self._handle_background_error()
        return result

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: Any) -> bool:
        self.shutdown()
        return False


# ----------------------------------------------------------------------------- llmapi/llm_args.py, llm.py


class StrictArgsBase:
    """``BaseLlmArgs``: a pydantic ``StrictBaseModel`` (``extra="forbid"``), emulated without pydantic.

    ``model_fields`` maps each field to its default; an unknown keyword raises ``ValueError``
    (pydantic's ``ValidationError`` is a ``ValueError``).
    """

    model_fields: ClassVar[dict[str, Any]] = {}

    def __init__(self, **kwargs: Any) -> None:
        unknown = [k for k in kwargs if k not in self.model_fields]
        if unknown:
            raise ValueError(f"1 validation error for {type(self).__name__}\n{unknown[0]}\n"
                             "  Extra inputs are not permitted [type=extra_forbidden]")
        for name, default in self.model_fields.items():
            setattr(self, name, kwargs.get(name, default))

    @property
    def world_size(self) -> int:
        return int(getattr(self, "tensor_parallel_size", 1))


BASE_LLM_FIELDS: dict[str, Any] = {
    "model": None, "tokenizer": None, "tokenizer_mode": "auto", "skip_tokenizer_init": False,
    "trust_remote_code": False, "tensor_parallel_size": 1, "dtype": "auto", "revision": None,
    "tokenizer_revision": None, "mpi_session": None, "backend": None, "orchestrator_type": None,
    "return_perf_metrics": False,  # trtllm-serve mounts /prometheus/metrics when it is set
}


class BaseLLMImpl:
    """``llmapi/llm.py`` BaseLLM, reduced: strict keyword check, then the executor is built.

    ``executor_cls`` (popped from ``kwargs``) defaults to ``GenerationExecutor``; the executor is
    made with ``executor_cls.create(...)``. ``model`` may be a ``FakeEngine`` (README).
    """

    ARGS_CLS: Any = None
    ENV_OVERRIDES = False  # main: the ``env_overrides`` keyword

    def __init__(self, model: Any, tokenizer: Any = None, tokenizer_mode: str = "auto",
                 skip_tokenizer_init: bool = False, trust_remote_code: bool = False, tensor_parallel_size: int = 1,
                 dtype: str = "auto", revision: str | None = None, tokenizer_revision: str | None = None,
                 **kwargs: Any) -> None:
        import importlib

        default_cls = importlib.import_module("tensorrt_llm.executor.executor").GenerationExecutor
        self._executor_cls = kwargs.pop("executor_cls", default_cls)
        self._executor: Any = None
        if self.ENV_OVERRIDES:
            self._process_env_overrides(kwargs.get("env_overrides"))
        valid_keys = set(self.ARGS_CLS.model_fields) | {"_mpi_session", "backend"}
        for key in kwargs:
            if key not in valid_keys:
                raise ValueError(f"{self.__class__.__name__} got invalid argument: {key}")
        if "_mpi_session" in kwargs:
            kwargs["mpi_session"] = kwargs.pop("_mpi_session")
        self.args = self.ARGS_CLS(model=model, tokenizer=tokenizer, tokenizer_mode=tokenizer_mode,
                                  skip_tokenizer_init=skip_tokenizer_init, trust_remote_code=trust_remote_code,
                                  tensor_parallel_size=tensor_parallel_size, dtype=dtype, revision=revision,
                                  tokenizer_revision=tokenizer_revision, **kwargs)
        self.mpi_session = self.args.mpi_session
        self.args.mpi_session = None
        self._owns_mpi_session = self.mpi_session is None
        self._build_model()

    def _process_env_overrides(self, env_overrides: dict[str, Any] | None) -> None:
        """main: each pair is written to THIS process's ``os.environ`` (before the args are parsed)."""
        if env_overrides is None:
            return
        for key, value in env_overrides.items():
            os.environ[key] = str(value)

    def _build_model(self) -> None:
        engine = self.args.model if isinstance(self.args.model, FakeEngine) else FakeEngine()
        self._executor = self._executor_cls.create(engine, model_world_size=self.args.world_size,
                                                   mpi_session=self.mpi_session, is_llm_executor=True,
                                                   llm_args=self.args)

    def generate_async(self, prompt_token_ids: list[int], max_tokens: int = 8, streaming: bool = False) -> Any:
        """``max_tokens`` where upstream takes ``sampling_params``; ``streaming`` as upstream's."""
        return self._executor.generate_async(prompt_token_ids, max_tokens=max_tokens, streaming=streaming)

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown()
            self._executor = None
        if self.mpi_session is not None and self._owns_mpi_session:
            self.mpi_session.shutdown()
            self.mpi_session = None
