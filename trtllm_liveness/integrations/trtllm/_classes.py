"""Building and installing the liveness classes.

- :func:`liveness_proxy_class`: ``(LivenessProxyMixin, upstream proxy)``, built once per
  (base, default, configuration).
- :func:`liveness_executor_class`: a ``GenerationExecutor`` subclass for
  ``LLM(..., executor_cls=...)``. Upstream's ``create`` routes to
  ``GenerationExecutor._create_ipc_executor`` *by name*, so a subclass's override is never called;
  instead that one static method is wrapped once (process-wide, but deciding per call): a
  thread-local set by the liveness class's ``create`` says which proxy class this call asked
  for, and every other call, in any thread, runs upstream's method unchanged. No module
  attribute is swapped, so an engine built meanwhile by another thread gets what it asked for,
  and concurrent builds do not serialise. If no class defines ``_create_ipc_executor``, nothing
  can be wrapped: one WARNING per process says that this route gets no liveness.
- :func:`patch_tensorrt_llm`: the import hook's entry (``TRTLLM_WORKER_LIVENESS``): replaces
  ``tensorrt_llm.executor.proxy.GenerationExecutorProxy`` for the whole process, which is what
  that switch means; liveness still follows the configuration (default off).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from ..._config import LivenessConfig
from ._features import route_of, warn_once, warn_route
from ._mixin import LivenessProxyMixin

logger = logging.getLogger(__name__.rpartition(".")[0])

_CLASS_LOCK = threading.Lock()
_PROXY_CLASSES: dict[tuple[type, bool, LivenessConfig | None], type] = {}
_REQUEST = threading.local()  # .proxy_cls: the liveness proxy this thread's create() asked for
_HOOK_LOCK = threading.Lock()
_ORIGINAL_ATTR = "_trtllm_liveness_original"


def liveness_proxy_class(proxy_cls: type, *, default_enabled: bool = False,
                         config: LivenessConfig | None = None) -> type:
    """The subclass ``(LivenessProxyMixin, proxy_cls)``; built once per key. Thread-safe.

    ``default_enabled``: whether liveness is on when nothing configures it (True for
    ``executor_cls`` users, who asked for it). ``config``: this class's configuration, which the
    environment variable and ``env_overrides`` then refine key by key (see ``_config``).
    """
    base = getattr(proxy_cls, "_liveness_base", proxy_cls)
    key = (base, default_enabled, config)
    with _CLASS_LOCK:
        cls = _PROXY_CLASSES.get(key)
        if cls is None:
            cls = type(f"Liveness{base.__name__}", (LivenessProxyMixin, base), {
                "_liveness_base": base,
                "_liveness_default_enabled": default_enabled,
                "_liveness_config": config,
                "__module__": __name__.rpartition(".")[0],
                "__doc__": f"{base.__qualname__} with worker liveness (see trtllm_liveness.integrations.trtllm).",
            })
            _PROXY_CLASSES[key] = cls
        return cls


@contextlib.contextmanager
def _requested(proxy_cls: type) -> Iterator[None]:
    previous = getattr(_REQUEST, "proxy_cls", None)
    _REQUEST.proxy_cls = proxy_cls
    try:
        yield
    finally:
        _REQUEST.proxy_cls = previous


def _routing_class(executor_cls: type) -> type | None:
    """The class whose ``_create_ipc_executor`` upstream's ``create`` reaches: it calls the method
    by name on ``GenerationExecutor``, so this is the first class in the MRO from the first class
    named ``GenerationExecutor`` on (``executor_cls``'s own MRO if none is) that defines it;
    upstream defines it on ``GenerationExecutor`` itself, a layout may define it on a base. None
    when no class defines it (then nothing can be hooked: see :func:`_install_create_hook`)."""
    mro = executor_cls.__mro__
    start = next((index for index, klass in enumerate(mro) if klass.__name__ == "GenerationExecutor"), 0)
    return next((klass for klass in mro[start:] if "_create_ipc_executor" in vars(klass)), None)


CREATE_HOOK_MISSING = ("the executor_cls route (LLM(executor_cls=liveness_executor_class())): its engines get "
                       "upstream's proxy without liveness (the TRTLLM_WORKER_LIVENESS import hook still attaches)")


def _install_create_hook(executor_cls: type) -> None:
    """Wrap ``_create_ipc_executor`` of ``executor_cls``'s :func:`_routing_class` once (see the module
    docstring). No such class: one WARNING per process naming what is lost."""
    owner = _routing_class(executor_cls)
    if owner is None:
        subject = f"{executor_cls.__module__}.{executor_cls.__qualname__}"
        warn_once("_create_ipc_executor", subject, "liveness: no class in the MRO of %s defines _create_ipc_executor: "
                  "%s is not covered", subject, CREATE_HOOK_MISSING)
        return
    with _HOOK_LOCK:
        current = vars(owner).get("_create_ipc_executor")
        if current is None or hasattr(getattr(current, "__func__", current), _ORIGINAL_ATTR):
            return
        original: Callable[..., Any] = getattr(current, "__func__", current)

        def _create_ipc_executor(worker_kwargs: Any, model_world_size: int = 1, mpi_session: Any = None,
                                 postproc_worker_config: Any = None, is_llm_executor: Any = None,
                                 use_worker: bool = False, **extra: Any) -> Any:
            proxy_cls = getattr(_REQUEST, "proxy_cls", None)
            if proxy_cls is None or use_worker:
                if proxy_cls is not None:
                    warn_route("single-process")
                return original(worker_kwargs, model_world_size, mpi_session, postproc_worker_config,
                                is_llm_executor, use_worker=use_worker, **extra)
            _REQUEST.proxy_cls = None  # one proxy per create(): nested builds get upstream's
            return proxy_cls(worker_kwargs, model_world_size=model_world_size, mpi_session=mpi_session,
                             postproc_worker_config=postproc_worker_config, is_llm_executor=is_llm_executor,
                             **extra)  # what a newer upstream passes on to its proxy

        setattr(_create_ipc_executor, _ORIGINAL_ATTR, original)
        _create_ipc_executor.__doc__ = original.__doc__
        owner._create_ipc_executor = staticmethod(_create_ipc_executor)  # type: ignore[attr-defined]


def liveness_executor_class(executor_cls: type | None = None, proxy_cls: type | None = None, *,
                            config: LivenessConfig | None = None) -> type:
    """A ``GenerationExecutor`` subclass for ``LLM(..., executor_cls=...)`` whose MPI proxy has
    liveness on (unless the configuration says ``enabled=0``); see the module docstring.

    Defaults to ``tensorrt_llm.executor.executor.GenerationExecutor`` and
    ``tensorrt_llm.executor.proxy.GenerationExecutorProxy`` (imported now). Raises
    ``ImportError`` without TensorRT-LLM. The rpc, ray and single-process routes of ``create``
    get no liveness: each logs one WARNING naming the route (so does a layout where no class
    defines ``_create_ipc_executor``: then no route gets liveness through this class).
    """
    if executor_cls is None:
        executor_cls = importlib.import_module("tensorrt_llm.executor.executor").GenerationExecutor
    if proxy_cls is None:
        proxy_cls = importlib.import_module(
            executor_cls.__module__.rpartition(".")[0] + ".proxy").GenerationExecutorProxy
    base_executor: type = executor_cls
    liveness_proxy = liveness_proxy_class(proxy_cls, default_enabled=True, config=config)
    _install_create_hook(base_executor)

    def _create_ipc_executor(*args: Any, **kwargs: Any) -> Any:
        with _requested(liveness_proxy):
            return base_executor._create_ipc_executor(*args, **kwargs)  # type: ignore[attr-defined]

    def create(*args: Any, **kwargs: Any) -> Any:
        warn_route(route_of(kwargs))
        with _requested(liveness_proxy):
            return base_executor.create(*args, **kwargs)  # type: ignore[attr-defined]

    return type(f"Liveness{base_executor.__name__}", (base_executor,), {
        "__module__": __name__.rpartition(".")[0],
        "__doc__": "GenerationExecutor whose MPI proxy has worker liveness on (executor_cls=...).",
        "_create_ipc_executor": staticmethod(_create_ipc_executor),
        "create": staticmethod(create),
    })


def patch_tensorrt_llm(proxy_module: Any = None) -> bool:
    """Replace ``tensorrt_llm.executor.proxy.GenerationExecutorProxy`` with the liveness class.

    The worker entry needs no patch: the liveness proxy wraps whatever ``worker_main`` upstream
    submits. Idempotent; returns True when it patched. Liveness still follows
    ``TRTLLM_WORKER_LIVENESS`` / ``env_overrides`` (default off).
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
