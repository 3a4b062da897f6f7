"""TensorRT-LLM integration: worker identities, event-driven death/wedge handling, bounded shutdown.

Works with the released 1.2.x and with main (Aug-Sep 2026); every upstream symbol is looked up
lazily and feature-detected (see UPSTREAM.md's table). ``tensorrt_llm`` is never imported at
module import time.

**Worker side.** The proxy mixin wraps ``mpi_session.submit`` while it starts the workers, so
every rank runs :func:`liveness_worker_entry`, which allgathers the ranks' identities, has the
leader send them to the proxy over a private side channel (JSON over a ZMQ socket in a 0700
directory, with a random token), and then calls the real ``worker_main`` unchanged. That happens
before the model is built, so a death during initialization is caught, and it leaves upstream's
status queue and 1.2.x's 2-field READY handshake untouched. The workers need no import hook:
the wrapper travels by reference to this module. On main, upstream's own early identities message
is reused instead: the mixin hands upstream a shim as its ``_worker_process_monitor``, so
upstream's ``register()`` lands in this package's monitor (once; no side channel).

**Proxy side.** :class:`LivenessProxyMixin` registers the identities (validated with
:func:`~trtllm_liveness.parse_identities`; a bad payload is logged and rejected, never a crash)
with a :class:`~trtllm_liveness.WorkerProcessMonitor` whose watcher thread reports a death within
milliseconds and a ``D``-state wedge after ``d_state_timeout_s``. On the first event it records
ONE fatal error (:class:`~trtllm_liveness.WorkerFailedError` naming rank, pid and host) with
upstream's ``_set_fatal_error`` where present and in ``_fatal_error`` in any case (Dynamo reads
that attribute), makes ``check_health()`` False (adding it on 1.2.x), fails every pending request
(upstream's ``_mark_engine_dead`` where present, an ``ErrorResponse`` per request otherwise) and
every new one, and calls ``pre_shutdown()`` once, from a helper thread started by the watcher,
never ``shutdown()``. ``shutdown()`` is bounded: upstream's shutdown runs in a daemon thread, the
workers still alive after ``shutdown_grace_s`` are stopped with
:func:`trtllm_liveness._shutdown.stop_processes` (SIGTERM, SIGKILL, deadlines), and unkillable
ranks are reported in :attr:`LivenessProxyMixin.liveness_shutdown_report`.

**Exit on fatal** (``exit_on_fatal``, off by default, for servers such as ``trtllm-serve`` whose
``/health`` never restarts them after a killed rank, TensorRT-LLM #18663): ``exit_delay_s`` after
the fatal error a :class:`~trtllm_liveness._exit_guard.FatalExitGuard` sends SIGINT to the process
once (its graceful shutdown), turns a clean exit into ``exit_code``, and, if the process still
runs ``exit_timeout_s`` later, stops the workers (bounded) and ``os._exit(exit_code)``.

**Activation.**

- ``LLM(..., executor_cls=liveness_executor_class())`` (or the lazily built module attribute
  ``LivenessGenerationExecutor``): liveness on unless the configuration says ``enabled=0``.
- ``TRTLLM_WORKER_LIVENESS=1`` (or ``key=value,...``) plus the import hook of
  :mod:`trtllm_liveness.integrations.trtllm_autoload`, for ``trtllm-serve`` and Dynamo, where no
  class can be passed: ``python -m trtllm_liveness.integrations.trtllm_autoload trtllm-serve ...``,
  or a ``.pth`` file with ``import trtllm_liveness.integrations.trtllm_autoload`` in site-packages.
- ``llm_args.worker_liveness`` (True/False or a mapping of :class:`~trtllm_liveness._config.LivenessConfig`
  keys), e.g. from ``--extra_llm_api_options``; it overrides the environment variable.

Limits: the side channel covers ``MpiPoolSession`` (spawned workers) and
``mpi4py.MPI.COMM_WORLD``; a rank that dies before the identity exchange is only seen by
upstream's own checks; ranks on other hosts are reported unmonitored, not dead.
"""

from __future__ import annotations

import contextlib
import functools
import hmac
import importlib
import json
import logging
import os
import secrets
import shutil
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, ClassVar

from .._config import LivenessConfig
from .._errors import LivenessError
from .._events import RankStatus, WorkerEvent, WorkerFailedError
from .._exit_guard import FatalExitGuard
from .._identity import ProcessIdentity, capture_identity, parse_identities
from .._monitor import WorkerProcessMonitor
from .._pidfd import verify_start_time
from ._futures import fail_pending, mirror_future
from ._pool_manager_watch import PoolManagerDiedError, PoolManagerWatch

__all__ = [
    "LIVENESS_IDENTITIES_SIGNAL",
    "LivenessProxyMixin",
    "PoolManagerDiedError",
    "UpstreamFeatures",
    "detect_features",
    "liveness_executor_class",
    "liveness_proxy_class",
    "liveness_worker_entry",
    "patch_tensorrt_llm",
]

logger = logging.getLogger(__name__)

LIVENESS_IDENTITIES_SIGNAL = b"TRTLLM_LIVENESS_IDENTITIES"
_FN_KWARG = "_trtllm_liveness_fn"
_CHANNEL_KWARG = "_trtllm_liveness_channel"
_MAX_MESSAGE_BYTES = 4 << 20
_SEND_TIMEOUT_MS = 5000
_PRE_SHUTDOWN_WAIT_S = 0.5
_UPSTREAM_SHUTDOWN_AFTER_STOP_S = 1.0


# --------------------------------------------------------------------------- feature detection


@dataclass(frozen=True)
class UpstreamFeatures:
    """What a proxy class offers, per UPSTREAM.md's table (``hasattr`` on the class)."""

    check_health: bool
    fatal_error: bool
    set_fatal_error: bool
    error_monitor_loop: bool
    mark_engine_dead: bool
    identities_signal: bool

    @property
    def flavour(self) -> str:
        """``"main"`` when upstream sends identities itself, ``"1.2"`` otherwise."""
        return "main" if self.identities_signal else "1.2"


@functools.lru_cache(maxsize=32)
def detect_features(proxy_cls: type) -> UpstreamFeatures:
    """Probe ``proxy_cls`` (the upstream class, not a liveness subclass) once; cached."""
    base = getattr(proxy_cls, "_liveness_base", proxy_cls)
    features = UpstreamFeatures(
        check_health=hasattr(base, "check_health"),
        fatal_error=hasattr(base, "_fatal_error"),
        set_fatal_error=hasattr(base, "_set_fatal_error"),
        error_monitor_loop=hasattr(base, "_error_monitor_loop"),
        mark_engine_dead=hasattr(base, "_mark_engine_dead"),
        identities_signal=hasattr(base, "WORKER_PROCESS_IDENTITIES_SIGNAL"),
    )
    logger.debug("liveness: %s.%s looks like TensorRT-LLM %s: %s",
                 base.__module__, base.__qualname__, features.flavour, features)
    return features


def _find_symbol(names: Sequence[str], modules: Sequence[str]) -> Any:
    for module_name in modules:
        module = sys.modules.get(module_name)
        if module is None:
            try:
                module = importlib.import_module(module_name)
            except Exception:  # ImportError, or a GPU library missing at import
                continue
        for name in names:
            value = getattr(module, name, None)
            if value is not None:
                return value
    return None


# --------------------------------------------------------------------------- worker side


def liveness_worker_entry(*args: Any, **kwargs: Any) -> Any:
    """Every rank's entry when liveness is on: announce identities, then run the real entry.

    Pops its own two keyword arguments and calls the wrapped ``worker_main`` with the rest, so
    upstream sees exactly the call it made. Announcing never raises: a failure is logged and the
    worker runs unmonitored rather than not at all.
    """
    target = kwargs.pop(_FN_KWARG)
    channel = kwargs.pop(_CHANNEL_KWARG, None)
    if channel is not None:
        try:
            _announce_identities(channel)
        except Exception:
            logger.warning("liveness: could not announce worker identities", exc_info=True)
    return target(*args, **kwargs)


def _announce_identities(channel: Mapping[str, str]) -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    try:
        mine: list[Any] | None = list(capture_identity(rank))
    except Exception:
        logger.warning("liveness: rank %d could not capture its identity", rank, exc_info=True)
        mine = None
    # Every rank must take part in the collective, even one whose capture failed.
    gathered = comm.allgather(mine)
    if rank != 0:
        return
    import zmq

    payload = json.dumps({"token": channel["token"], "identities": [g for g in gathered if g is not None]})
    context: Any = zmq.Context.instance()
    sock = context.socket(zmq.PUSH)
    try:
        sock.setsockopt(zmq.LINGER, _SEND_TIMEOUT_MS)
        sock.setsockopt(zmq.SNDTIMEO, _SEND_TIMEOUT_MS)
        sock.connect(channel["address"])
        sock.send(payload.encode())
    finally:
        sock.close()


class _IdentityChannel:
    """The proxy's end of the side channel: one listener thread, ends at the first valid payload,
    at ``close()`` or after ``timeout_s``. Payloads are JSON (never unpickled) and token-checked."""

    def __init__(self, on_identities: Callable[[list[ProcessIdentity]], None], timeout_s: float) -> None:
        import zmq

        self._dir = tempfile.mkdtemp(prefix="trtllm-liveness-")  # mode 0700: only we can connect
        self.token = secrets.token_hex(16)
        self.address = f"ipc://{os.path.join(self._dir, 'identities')}"
        self._context = zmq.Context()
        self._sock = self._context.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, _MAX_MESSAGE_BYTES)
        self._sock.bind(self.address)
        self._stop = threading.Event()
        self._on_identities = on_identities
        self._deadline = time.monotonic() + timeout_s
        self._thread = threading.Thread(target=self._run, name="trtllm-liveness-identities", daemon=True)
        self._thread.start()

    @property
    def spec(self) -> dict[str, str]:
        return {"address": self.address, "token": self.token}

    def _run(self) -> None:
        try:
            while not self._stop.is_set() and time.monotonic() < self._deadline:
                if not self._sock.poll(100):
                    continue
                raw = self._sock.recv()
                identities = self._parse(raw)
                if identities is not None:
                    self._on_identities(identities)
                    return
            if not self._stop.is_set():
                logger.error("liveness: no worker identities within the timeout; workers are unmonitored")
        except Exception:
            logger.exception("liveness: identity listener failed; workers are unmonitored")
        finally:
            self._release()

    def _parse(self, raw: bytes) -> list[ProcessIdentity] | None:
        try:
            message = json.loads(raw)
            token = message.get("token") if isinstance(message, dict) else None
            if not isinstance(token, str) or not hmac.compare_digest(token, self.token):
                raise ValueError("bad or missing token")
            return parse_identities(message.get("identities"))
        except (ValueError, TypeError, AttributeError, RecursionError) as exc:
            # InvalidIdentityError, JSON errors, JSON nested too deep: reject it, keep listening.
            logger.error("liveness: rejected a worker identities payload: %s", exc)
            return None

    def _release(self) -> None:
        with contextlib.suppress(Exception):
            self._sock.close(0)
        with contextlib.suppress(Exception):
            self._context.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    def close(self, timeout: float = 1.0) -> None:
        """Stop listening; joins the listener for at most ``timeout`` seconds. Idempotent."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)


def _as_tuple(item: Any) -> Any:
    """Upstream's identity may be a NamedTuple, a dataclass or a dict; parse_identities judges it."""
    if isinstance(item, (tuple, list, dict)):
        return item
    fields = ProcessIdentity._fields
    if all(hasattr(item, name) for name in fields):
        return tuple(getattr(item, name) for name in fields)
    return item


def _validated(payload: Any) -> list[ProcessIdentity] | None:
    try:
        items = [_as_tuple(item) for item in payload] if isinstance(payload, (list, tuple)) else payload
        return parse_identities(items)
    except (ValueError, TypeError) as exc:
        logger.error("liveness: rejected worker identities from upstream: %s", exc)
        return None


class _MonitorShim:
    """What upstream main sees as ``_worker_process_monitor``: registrations and checks land in
    the liveness monitor (validated), ``close()`` is left to the mixin, which owns the monitor."""

    def __init__(self, monitor: WorkerProcessMonitor) -> None:
        self._monitor = monitor

    def register(self, identities: Any) -> None:
        validated = _validated(identities)
        if validated is None:
            return
        try:
            self._monitor.register(validated)
        except RuntimeError:  # closed meanwhile (shutdown or an aborted start): nothing to watch
            logger.warning("liveness: worker identities arrived after the monitor was closed; ignored")

    def find_dead_worker(self) -> ProcessIdentity | None:
        return self._monitor.find_dead_worker()

    def close(self, *args: Any, **kwargs: Any) -> None:
        del args, kwargs

    def __getattr__(self, name: str) -> Any:
        return getattr(self._monitor, name)


# --------------------------------------------------------------------------- proxy side


def _subscriber(ref: weakref.ReferenceType[LivenessProxyMixin]) -> Callable[[WorkerEvent], None]:
    # Holds the proxy by weakref: a monitor must not keep a dropped engine alive.
    def on_event(event: WorkerEvent) -> None:
        proxy = ref()
        if proxy is not None:
            proxy._liveness_on_event(event)

    return on_event


class LivenessProxyMixin:
    """Mix into an upstream ``GenerationExecutorProxy`` (first in the MRO); see the module docstring.

    The configuration is resolved in ``__init__`` from ``worker_kwargs["llm_args"]`` and the
    environment; an invalid one raises ``ValueError`` before any worker starts. When disabled,
    every override delegates straight to upstream.

    Thread-safety: the event handler runs in the monitor's watcher thread (or in the thread that
    called ``check_health``) and takes a private lock; ``shutdown()`` is idempotent and may be
    called from any thread but the watcher.
    """

    _liveness_base: ClassVar[type]
    _liveness_default_enabled: ClassVar[bool] = False

    def __init__(self, worker_kwargs: Any, *args: Any, **kwargs: Any) -> None:
        llm_args = worker_kwargs.get("llm_args") if isinstance(worker_kwargs, Mapping) else None
        config = LivenessConfig.resolve(llm_args, default_enabled=type(self)._liveness_default_enabled)
        self.__dict__["_liveness_config"] = config
        if config.enabled:
            self._liveness_init_state(config)
        super().__init__(worker_kwargs, *args, **kwargs)  # type: ignore[call-arg]

    def _liveness_init_state(self, config: LivenessConfig) -> None:
        self._liveness_lock = threading.Lock()
        # Serializes pre_shutdown(): the fatal path, upstream's own health/monitor paths and
        # shutdown() may call it at once, and upstream's "already done" flag is not atomic.
        self._liveness_pre_shutdown_lock = threading.RLock()
        self._liveness_fatal: WorkerFailedError | None = None
        self._liveness_events: list[WorkerEvent] = []
        self._liveness_pre_shutdown_calls = 0
        self._liveness_fatal_done = threading.Event()
        self._liveness_shutdown_report: Any = None
        self._liveness_shutdown_started = False
        self._liveness_channel: _IdentityChannel | None = None
        if not detect_features(type(self)._liveness_base).fatal_error:
            self._fatal_error: BaseException | None = None  # Dynamo reads it on every version
        monitor = WorkerProcessMonitor(
            d_state_timeout_s=config.d_state_timeout_s or None, scan_interval_s=config.scan_interval_s
        )
        monitor.subscribe(_subscriber(weakref.ref(self)))
        self._liveness_exit_guard: FatalExitGuard | None = None
        if config.exit_on_fatal:
            self._liveness_exit_guard = FatalExitGuard(
                timeout_s=config.exit_timeout_s, exit_code=config.exit_code, exit_fn=_exit_stopping(weakref.ref(self))
            )
        monitor.start()
        self._liveness_monitor = monitor
        self.__dict__["_liveness_shim"] = _MonitorShim(monitor)

    # -- public view ---------------------------------------------------------------------

    @property
    def liveness_config(self) -> LivenessConfig:
        """The resolved configuration."""
        config: LivenessConfig = self.__dict__["_liveness_config"]
        return config

    @property
    def liveness_monitor(self) -> WorkerProcessMonitor | None:
        """The monitor watching this executor's ranks (None when disabled); what
        :func:`trtllm_liveness.integrations.dynamo.attach_to_dynamo` subscribes to."""
        return self._liveness_monitor if self.liveness_config.enabled else None

    @property
    def liveness_exit_guard(self) -> FatalExitGuard | None:
        """The exit guard when ``exit_on_fatal`` is on (``guard.triggered`` after a fatal event)."""
        return self._liveness_exit_guard if self.liveness_config.enabled else None

    @property
    def liveness_fatal_error(self) -> WorkerFailedError | None:
        """The one fatal error the extension recorded, or None."""
        return self._liveness_fatal if self.liveness_config.enabled else None

    @property
    def liveness_events(self) -> list[WorkerEvent]:
        """Every event seen (the first one is the fatal error's)."""
        if not self.liveness_config.enabled:
            return []
        with self._liveness_lock:
            return list(self._liveness_events)

    @property
    def liveness_shutdown_report(self) -> Any:
        """The :class:`~trtllm_liveness._shutdown.StopReport` of ``shutdown()``, once it ran."""
        return self._liveness_shutdown_report if self.liveness_config.enabled else None

    @property
    def liveness_pre_shutdown_calls(self) -> int:
        """How many times the watcher path called ``pre_shutdown()`` (0 or 1)."""
        return self._liveness_pre_shutdown_calls if self.liveness_config.enabled else 0

    def liveness_statuses(self) -> list[RankStatus]:
        """Per-rank status snapshot (empty when disabled)."""
        return self._liveness_monitor.statuses() if self.liveness_config.enabled else []

    def liveness_identities(self) -> list[ProcessIdentity]:
        """The registered worker identities (empty when disabled or not known yet)."""
        return self._liveness_monitor.identities if self.liveness_config.enabled else []

    # -- the worker futures -----------------------------------------------------------------

    @property
    def mpi_futures(self) -> Any:
        try:
            return self.__dict__["_liveness_mpi_futures"]
        except KeyError:
            raise AttributeError("mpi_futures") from None

    @mpi_futures.setter
    def mpi_futures(self, futures: Any) -> None:
        # With liveness on, upstream holds mirrors of mpi4py's futures (see _futures.py).
        config = self.__dict__.get("_liveness_config")
        if config is not None and config.enabled and isinstance(futures, list):
            self.__dict__["_liveness_real_mpi_futures"] = list(futures)
            futures = [mirror_future(f) if isinstance(f, Future) else f for f in futures]
        self.__dict__["_liveness_mpi_futures"] = futures

    # -- upstream main's monitor attribute ------------------------------------------------

    @property
    def _worker_process_monitor(self) -> Any:
        shim = self.__dict__.get("_liveness_shim")
        if shim is not None:
            return shim
        try:
            return self.__dict__["_liveness_upstream_monitor"]
        except KeyError:
            raise AttributeError("_worker_process_monitor") from None

    @_worker_process_monitor.setter
    def _worker_process_monitor(self, value: Any) -> None:
        # Upstream main assigns its own monitor; with liveness on it is replaced by the shim (one
        # registration, one set of pidfds) and closed.
        if self.__dict__.get("_liveness_shim") is not None and value is not self.__dict__["_liveness_shim"]:
            close = getattr(value, "close", None)
            if callable(close):
                with contextlib.suppress(Exception):
                    close()
        self.__dict__["_liveness_upstream_monitor"] = value

    # -- start ---------------------------------------------------------------------------

    def _start_executor_workers(self, worker_kwargs: Any) -> None:
        if not self.liveness_config.enabled:
            super()._start_executor_workers(worker_kwargs)  # type: ignore[misc]
            return
        restore = None
        if not detect_features(type(self)._liveness_base).identities_signal:
            restore = self._liveness_wrap_session()
        # A failed MPI_Comm_spawn leaves the futures pending and upstream's loop waiting forever.
        pool_watch = PoolManagerWatch(getattr(self, "mpi_session", None),
                                      lambda: getattr(self, "mpi_futures", None)).start()
        try:
            super()._start_executor_workers(worker_kwargs)  # type: ignore[misc]
        except BaseException as exc:
            fatal = self._liveness_fatal or pool_watch.error
            self._liveness_abort_start()
            if fatal is not None and fatal is not exc:
                raise fatal from exc
            raise
        finally:
            pool_watch.disarm()
            if restore is not None:
                restore()

    def _liveness_wrap_session(self) -> Callable[[], None] | None:
        session = getattr(self, "mpi_session", None)
        submit = getattr(session, "submit", None)
        if session is None or submit is None:
            logger.warning("liveness: no mpi_session.submit to wrap; worker identities unknown")
            return None
        ref = weakref.ref(self)

        def on_identities(identities: list[ProcessIdentity]) -> None:
            proxy = ref()
            if proxy is not None and proxy._liveness_register(identities):
                logger.info("liveness: watching %d worker ranks", len(identities))

        channel = _IdentityChannel(on_identities, self.liveness_config.identities_timeout_s)
        self._liveness_channel = channel

        def wrapped_submit(task: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            kwargs[_FN_KWARG] = task
            kwargs[_CHANNEL_KWARG] = channel.spec
            return submit(liveness_worker_entry, *args, **kwargs)

        session.submit = wrapped_submit

        def restore() -> None:
            with contextlib.suppress(AttributeError):
                del session.submit  # back to the class's method

        return restore

    def _liveness_register(self, identities: list[ProcessIdentity]) -> bool:
        try:
            self._liveness_monitor.register(identities)
        except RuntimeError:  # closed meanwhile
            return False
        return True

    def _liveness_abort_start(self) -> None:
        # The constructor fails, so nobody will call shutdown(): stop what was started, bounded.
        with contextlib.suppress(Exception):
            self._liveness_stop_workers()
        self._liveness_release()

    # -- events --------------------------------------------------------------------------

    def _liveness_on_event(self, event: WorkerEvent) -> None:
        with self._liveness_lock:
            # The same event may arrive twice: from the watcher and from a synchronous check.
            if not any(seen is event for seen in self._liveness_events):
                self._liveness_events.append(event)
            if self._liveness_fatal is not None or self._liveness_shutdown_started:
                return
            error = WorkerFailedError(event)
            self._liveness_fatal = error
        logger.error("liveness: fatal: %s", error)
        self._liveness_fail_pending(error)
        if self._liveness_exit_guard is None:
            # Publish at once (Dynamo's watchdog reads _fatal_error), and run pre_shutdown() in a
            # helper thread: it may block up to 0.5 s on a send to a dead leader, and the other
            # subscribers (the Dynamo bridge's 503) must not wait for it.
            self._liveness_publish_fatal(error)
            threading.Thread(target=self._liveness_pre_shutdown_once, args=(error,),
                             name="trtllm-liveness-fatal", daemon=True).start()
            return
        # The exit guard owns the exit. trtllm-serve's /health raises SIGINT when it sees
        # `_fatal_error and not doing_shutdown`; publishing the error before pre_shutdown() has set
        # doing_shutdown would let a probe in that window start a second shutdown racing the
        # guard's. So here pre_shutdown() runs first, in this thread (bounded: a 0.5 s send).
        self._liveness_pre_shutdown_once(error)
        self._liveness_publish_fatal(error)
        threading.Thread(target=self._liveness_trigger_exit_guard, args=(error,),
                         name="trtllm-liveness-exit", daemon=True).start()

    def _liveness_publish_fatal(self, error: WorkerFailedError) -> None:
        setter = getattr(self, "_set_fatal_error", None)
        if callable(setter):
            with contextlib.suppress(Exception):
                setter(error)
        if getattr(self, "_fatal_error", None) is None:
            self._fatal_error = error

    def _liveness_fail_pending(self, error: WorkerFailedError) -> None:
        mark_dead = getattr(self, "_mark_engine_dead", None)
        if callable(mark_dead):
            try:
                mark_dead(error)
                return
            except Exception:
                logger.exception("liveness: upstream _mark_engine_dead failed; failing requests directly")
        response_cls = getattr(self, "_error_response_cls", None) or _find_symbol(
            ["ErrorResponse"], ["tensorrt_llm.executor.utils"])
        results: dict[Any, Any] = getattr(self, "_results", {})
        for client_id, result in list(results.items()):
            try:
                item: Any = error
                if response_cls is not None:
                    item = response_cls(client_id, str(error), getattr(result, "request_id", client_id))
                result.queue.put(item)
                _notify_async(result.queue)
            except Exception:
                logger.exception("liveness: could not fail request %r", client_id)
            results.pop(client_id, None)

    def _liveness_pre_shutdown_once(self, error: WorkerFailedError) -> None:
        try:
            with self._liveness_lock:
                self._liveness_pre_shutdown_calls += 1
            try:
                self.pre_shutdown()
            except Exception:
                logger.exception("liveness: pre_shutdown() raised after the fatal error")
            # Upstream waits on the worker futures (1.2.x's init loop and shutdown, without a
            # timeout); the dead world will never complete them, so fail them now (after
            # pre_shutdown(): 1.2.x sends its stop sentinel only while every future is pending).
            fail_pending(list(getattr(self, "mpi_futures", []) or []), error)
        finally:
            self._liveness_fatal_done.set()

    def _liveness_trigger_exit_guard(self, error: WorkerFailedError) -> None:
        guard = self._liveness_exit_guard
        if guard is not None:
            # Let health endpoints answer 503 (and logs say why) before the server goes away.
            time.sleep(self.liveness_config.exit_delay_s)
            guard.trigger(error)

    def _liveness_dead_error(self) -> BaseException:
        error = self._liveness_fatal
        assert error is not None
        engine_dead = _find_symbol(["EngineDeadError"], [type(self)._liveness_base.__module__,
                                                         "tensorrt_llm.executor.utils",
                                                         "tensorrt_llm.executor.result"])
        if isinstance(engine_dead, type) and issubclass(engine_dead, BaseException):
            try:
                return engine_dead(error)
            except Exception:
                pass
        return error

    # -- overrides -----------------------------------------------------------------------

    def submit(self, request: Any) -> Any:
        """Upstream's submit; raises the engine-dead error at once after a fatal event."""
        if self.liveness_config.enabled and self._liveness_fatal is not None:
            raise self._liveness_dead_error()
        return super().submit(request)  # type: ignore[misc]

    def pre_shutdown(self) -> None:
        """Upstream's ``pre_shutdown()``, serialized so that concurrent callers run it once.
        Blocks while another thread runs it (upstream's is bounded: a 0.5 s socket send)."""
        if not self.liveness_config.enabled:
            super().pre_shutdown()  # type: ignore[misc]
            return
        with self._liveness_pre_shutdown_lock:
            super().pre_shutdown()  # type: ignore[misc]

    def check_health(self) -> bool:
        """False after a fatal event (checked synchronously too, so a dead watcher loses
        nothing); otherwise upstream's ``check_health`` or, on 1.2.x, ``not is_shutdown()``.
        Non-blocking (one ``poll(0)`` over the pidfds)."""
        if self.liveness_config.enabled:
            if self._liveness_fatal is not None:
                return False
            # Act on the monitor's answer here, in this thread: the watcher may have seen the
            # death and not yet delivered it (or be dead). Otherwise upstream's own check below
            # finds the same death first and the liveness fatal error is never recorded.
            failure = self._liveness_monitor.check()
            if failure is not None:
                self._liveness_on_event(failure)
                return False
        parent = getattr(super(), "check_health", None)
        if parent is not None:
            return bool(parent())
        return not self.is_shutdown()  # type: ignore[attr-defined]

    def shutdown(self) -> None:
        """Bounded shutdown; see the module docstring. Blocks for at most about
        ``shutdown_grace_s + shutdown_term_s + shutdown_kill_s + 5`` seconds; never raises for a
        dead or wedged rank. Idempotent."""
        if not self.liveness_config.enabled:
            super().shutdown()  # type: ignore[misc]
            return
        failure = self._liveness_monitor.check()
        if failure is not None:  # known but maybe not yet delivered: a death, not a clean stop
            self._liveness_on_event(failure)
        with self._liveness_lock:
            if self._liveness_shutdown_started:
                return
            self._liveness_shutdown_started = True
            failed = self._liveness_fatal is not None
        config = self.liveness_config
        if failed:
            self._liveness_fatal_done.wait(_PRE_SHUTDOWN_WAIT_S)
        upstream = threading.Thread(target=self._liveness_upstream_shutdown,
                                    name="trtllm-liveness-upstream-shutdown", daemon=True)
        if not failed:
            # Workers exiting now are expected: stop the watcher so they are not reported dead.
            self._liveness_monitor.stop()
        upstream.start()
        # A healthy engine gets the grace period to stop by itself; a dead world does not.
        if not failed:
            deadline = time.monotonic() + config.shutdown_grace_s
            upstream.join(config.shutdown_grace_s)
            self._liveness_wait_exit(deadline)
        report = self._liveness_stop_workers()
        upstream.join(_UPSTREAM_SHUTDOWN_AFTER_STOP_S)
        if upstream.is_alive():
            logger.warning("liveness: upstream shutdown still blocked after the workers were stopped; abandoned")
            abandon = getattr(getattr(self, "mpi_session", None), "abandon", None)
            if callable(abandon):
                with contextlib.suppress(Exception):
                    abandon()
        self._liveness_release()
        if report is not None and report.unkillable:
            with self._liveness_lock:
                events = report.events()
                if self._liveness_fatal is None and events:
                    self._liveness_fatal = WorkerFailedError(events[0])
                    self._fatal_error = self._fatal_error or self._liveness_fatal

    def _liveness_wait_exit(self, deadline: float) -> None:
        pending = self._liveness_monitor.identities
        while pending and time.monotonic() < deadline:
            pending = [identity for identity in pending if _is_running(identity)]
            if pending:
                time.sleep(0.01)

    def _liveness_upstream_shutdown(self) -> None:
        try:
            super().shutdown()  # type: ignore[misc]
        except Exception:
            logger.warning("liveness: upstream shutdown raised", exc_info=True)

    def _liveness_stop_workers(self) -> Any:
        from .._shutdown import stop_processes

        identities = self._liveness_monitor.identities
        if not identities:
            return None
        config = self.liveness_config
        report = stop_processes(identities, grace_s=config.shutdown_term_s, kill_s=config.shutdown_kill_s)
        self._liveness_shutdown_report = report
        return report

    def _liveness_release(self) -> None:
        channel = self._liveness_channel
        if channel is not None:
            channel.close()
        with contextlib.suppress(Exception):
            self._liveness_monitor.close()


def _exit_stopping(ref: weakref.ReferenceType[LivenessProxyMixin]) -> Callable[[int], None]:
    # The exit guard's last resort: the workers are not our children (prte spawned them), so
    # nobody else reaps them once this process is gone; stop them first, bounded.
    def exit_now(code: int) -> None:
        proxy = ref()
        if proxy is not None:
            with contextlib.suppress(Exception):
                proxy._liveness_stop_workers()
        os._exit(code)

    return exit_now


def _is_running(identity: ProcessIdentity) -> bool:
    try:
        verify_start_time(identity.pid, identity.start_time)
    except LivenessError:
        return False
    except OSError:
        return False
    return True


def _notify_async(item_queue: Any) -> None:
    """Wake an asyncio consumer of upstream's ``_SyncQueue`` (it is woken explicitly upstream)."""
    loop = getattr(item_queue, "loop", None)
    notify = getattr(type(item_queue), "notify_many", None)
    if loop is not None and callable(notify):
        with contextlib.suppress(Exception):
            notify(loop, [item_queue])


# --------------------------------------------------------------------------- class factories

_CLASS_LOCK = threading.Lock()
_PATCH_LOCK = threading.Lock()
_PROXY_CLASSES: dict[tuple[type, bool], type] = {}


def liveness_proxy_class(proxy_cls: type, *, default_enabled: bool = False) -> type:
    """The subclass ``(LivenessProxyMixin, proxy_cls)``; built once per base. Thread-safe.

    ``default_enabled`` is whether liveness is on when neither the environment nor ``llm_args``
    says anything (True for ``executor_cls`` users, who asked for it).
    """
    base = getattr(proxy_cls, "_liveness_base", proxy_cls)
    with _CLASS_LOCK:
        cls = _PROXY_CLASSES.get((base, default_enabled))
        if cls is None:
            cls = type(f"Liveness{base.__name__}", (LivenessProxyMixin, base), {
                "_liveness_base": base,
                "_liveness_default_enabled": default_enabled,
                "__module__": __name__,
                "__doc__": f"{base.__qualname__} with worker liveness (see trtllm_liveness.integrations.trtllm).",
            })
            _PROXY_CLASSES[(base, default_enabled)] = cls
        return cls


def liveness_executor_class(executor_cls: type | None = None, proxy_cls: type | None = None) -> type:
    """A ``GenerationExecutor`` subclass for ``LLM(..., executor_cls=...)``.

    Defaults to ``tensorrt_llm.executor.executor.GenerationExecutor`` and
    ``tensorrt_llm.executor.proxy.GenerationExecutorProxy`` (imported now). Its
    ``_create_ipc_executor`` returns the liveness proxy; its ``create`` (which upstream routes to
    ``GenerationExecutor._create_ipc_executor`` by name) swaps the proxy module's class for the
    duration of the call, under a lock. Raises ``ImportError`` without TensorRT-LLM.
    """
    if executor_cls is None:
        executor_cls = importlib.import_module("tensorrt_llm.executor.executor").GenerationExecutor
    if proxy_cls is None:
        proxy_cls = importlib.import_module(
            executor_cls.__module__.rpartition(".")[0] + ".proxy").GenerationExecutorProxy
    assert executor_cls is not None and proxy_cls is not None
    base_executor: type = executor_cls
    liveness_proxy = liveness_proxy_class(proxy_cls, default_enabled=True)
    proxy_module_name = getattr(proxy_cls, "_liveness_base", proxy_cls).__module__

    def _create_ipc_executor(worker_kwargs: Any, model_world_size: int = 1, mpi_session: Any = None,
                             postproc_worker_config: Any = None, is_llm_executor: Any = None,
                             use_worker: bool = False, **extra: Any) -> Any:
        if use_worker:  # single-process worker: no MPI ranks to watch
            return base_executor._create_ipc_executor(  # type: ignore[attr-defined]
                worker_kwargs, model_world_size, mpi_session, postproc_worker_config, is_llm_executor,
                use_worker=True, **extra)
        return liveness_proxy(worker_kwargs, model_world_size=model_world_size, mpi_session=mpi_session,
                              postproc_worker_config=postproc_worker_config, is_llm_executor=is_llm_executor)

    def create(*args: Any, **kwargs: Any) -> Any:
        module = sys.modules.get(proxy_module_name)
        with _PATCH_LOCK:
            original = getattr(module, "GenerationExecutorProxy", None) if module is not None else None
            if module is not None and original is not None:
                module.GenerationExecutorProxy = liveness_proxy  # type: ignore[attr-defined]
            try:
                return base_executor.create(*args, **kwargs)  # type: ignore[attr-defined]
            finally:
                if module is not None and original is not None:
                    module.GenerationExecutorProxy = original  # type: ignore[attr-defined]

    return type(f"Liveness{base_executor.__name__}", (base_executor,), {
        "__module__": __name__,
        "__doc__": "GenerationExecutor whose MPI proxy has worker liveness on (executor_cls=...).",
        "_create_ipc_executor": staticmethod(_create_ipc_executor),
        "create": staticmethod(create),
    })


def patch_tensorrt_llm(proxy_module: Any = None) -> bool:
    """Replace ``tensorrt_llm.executor.proxy.GenerationExecutorProxy`` with the liveness class.

    The worker entry needs no patch: the liveness proxy wraps whatever ``worker_main`` upstream
    submits (see :func:`liveness_worker_entry`). Idempotent; returns True when it patched.
    Liveness still follows ``TRTLLM_WORKER_LIVENESS`` / ``llm_args`` (default off).
    """
    module: Any = proxy_module if proxy_module is not None else sys.modules.get("tensorrt_llm.executor.proxy")
    original = getattr(module, "GenerationExecutorProxy", None)
    if module is None or not isinstance(original, type) or hasattr(original, "_liveness_base"):
        return False
    patched = liveness_proxy_class(original)
    module.GenerationExecutorProxy = patched
    package = sys.modules.get(module.__name__.rpartition(".")[0])
    if package is not None and getattr(package, "GenerationExecutorProxy", None) is original:
        package.GenerationExecutorProxy = patched  # type: ignore[attr-defined]
    logger.info("liveness: patched %s.GenerationExecutorProxy", module.__name__)
    return True


def __getattr__(name: str) -> Any:
    # PEP 562: ``from trtllm_liveness.integrations.trtllm import LivenessGenerationExecutor``
    # builds the class on first use, importing tensorrt_llm only then.
    if name == "LivenessGenerationExecutor":
        cls = liveness_executor_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
