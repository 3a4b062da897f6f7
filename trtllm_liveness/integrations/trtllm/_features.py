"""Feature detection: what the installed TensorRT-LLM offers, probed once, and loud degraded modes.

Every upstream name the extension touches is looked up here or with ``getattr`` at the call site;
docs/upstream-contract.md lists each name, where it exists and what happens when it is missing.
A missing hook that costs coverage is logged as ONE WARNING per hook and class, naming what is
then not covered; a missing hook that the extension replaces itself is logged at debug level.
"""

from __future__ import annotations

import functools
import importlib
import logging
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__.rpartition(".")[0])

# Hooks of the proxy class whose absence costs coverage: name -> what is then not covered.
REQUIRED_HOOKS: Mapping[str, str] = {
    "_start_executor_workers": "worker identities and the proxy-death watch (workers are unmonitored)",
    "pre_shutdown": "the clean-exit marking (a clean exit may be reported as a death)",
    "shutdown": "the bounded shutdown",
    "submit": "rejecting new requests after a fatal error",
}
# Hooks the extension replaces when absent (debug log only): name -> what it does instead.
REPLACED_HOOKS: Mapping[str, str] = {
    "check_health": "the extension adds check_health (1.2.x: health is not is_shutdown())",
    "_set_fatal_error": "the fatal error is stored in _fatal_error directly",
    "_mark_engine_dead": "each pending request is failed with an ErrorResponse",
    "WORKER_PROCESS_IDENTITIES_SIGNAL": "identities come over the extension's side channel",
    "_error_monitor_loop": "nothing: the watcher thread replaces polling",
}

_WARNED: set[tuple[str, str]] = set()
_WARNED_LOCK = threading.Lock()


@dataclass(frozen=True)
class UpstreamFeatures:
    """What a proxy class offers (``hasattr`` on the upstream class)."""

    check_health: bool
    fatal_error: bool
    set_fatal_error: bool
    error_monitor_loop: bool
    mark_engine_dead: bool
    identities_signal: bool
    missing_hooks: tuple[str, ...] = ()

    @property
    def flavour(self) -> str:
        """``"main"`` when upstream sends identities itself, ``"1.2"`` otherwise."""
        return "main" if self.identities_signal else "1.2"


@functools.lru_cache(maxsize=32)
def detect_features(proxy_cls: type) -> UpstreamFeatures:
    """Probe ``proxy_cls`` (the upstream class, or a liveness subclass: its base is probed) once; cached."""
    base = getattr(proxy_cls, "_liveness_base", proxy_cls)
    features = UpstreamFeatures(
        check_health=hasattr(base, "check_health"),
        fatal_error=hasattr(base, "_fatal_error"),
        set_fatal_error=hasattr(base, "_set_fatal_error"),
        error_monitor_loop=hasattr(base, "_error_monitor_loop"),
        mark_engine_dead=hasattr(base, "_mark_engine_dead"),
        identities_signal=hasattr(base, "WORKER_PROCESS_IDENTITIES_SIGNAL"),
        missing_hooks=tuple(name for name in REQUIRED_HOOKS if not hasattr(base, name)),
    )
    logger.debug("liveness: %s.%s looks like TensorRT-LLM %s: %s",
                 base.__module__, base.__qualname__, features.flavour, features)
    return features


def warn_once(key: str, subject: str, message: str, *args: Any) -> bool:
    """Log ``message`` as a WARNING once per ``(key, subject)`` in this process; True if logged."""
    with _WARNED_LOCK:
        if (key, subject) in _WARNED:
            return False
        _WARNED.add((key, subject))
    logger.warning(message, *args)
    return True


def warn_missing_hooks(proxy_cls: type) -> list[str]:
    """One WARNING per hook of ``REQUIRED_HOOKS`` that ``proxy_cls`` lacks; returns their names."""
    base = getattr(proxy_cls, "_liveness_base", proxy_cls)
    features = detect_features(base)
    subject = f"{base.__module__}.{base.__qualname__}"
    for name in features.missing_hooks:
        warn_once(name, subject, "liveness: %s has no %s: %s is not covered", subject, name, REQUIRED_HOOKS[name])
    for name, instead in REPLACED_HOOKS.items():
        if not hasattr(base, name):
            logger.debug("liveness: %s has no %s: %s", subject, name, instead)
    return list(features.missing_hooks)


def warn_session_hooks(session: Any) -> None:
    """One WARNING per missing session hook of upstream main that the extension cannot replace."""
    if session is None:
        return
    subject = type(session).__qualname__
    if not callable(getattr(session, "submit", None)):
        warn_once("submit", subject, "liveness: the MPI session %s has no submit(): worker identities and the "
                  "proxy-death watch are not covered", subject)


# Routes of GenerationExecutor.create that do not build an MPI GenerationExecutorProxy.
UNCOVERED_ROUTES: Mapping[str, str] = {
    "rpc": "the RPC orchestrator (GenerationExecutorRpcProxy): its workers are not watched, deaths are "
           "seen only by upstream's own checks",
    "ray": "the Ray orchestrator (RayExecutor): its actors are not watched; upstream catches a dead actor "
           "only at start-up",
    "single-process": "the single-process worker (return_logits or TLLM_WORKER_USE_SINGLE_PROCESS): the "
                      "worker runs in this process, no MPI ranks to watch",
}


def route_of(kwargs: Mapping[str, Any], environ: Mapping[str, str]) -> str:
    """Which route ``GenerationExecutor.create(**kwargs)`` takes: ``mpi`` or a key of UNCOVERED_ROUTES."""
    llm_args = kwargs.get("llm_args")
    orchestrator = kwargs.get("orchestrator_type", getattr(llm_args, "orchestrator_type", None))
    if orchestrator in ("rpc", "ray"):
        return str(orchestrator)
    if kwargs.get("return_logits") or environ.get("TLLM_WORKER_USE_SINGLE_PROCESS", "0") not in ("", "0"):
        return "single-process"
    return "mpi"


def warn_route(route: str) -> bool:
    """One WARNING per uncovered route in this process (naming it and what is not covered)."""
    if route not in UNCOVERED_ROUTES:
        return False
    return warn_once("route", route, "liveness: GenerationExecutor.create takes the %s route: %s is not covered "
                     "by worker liveness", route, UNCOVERED_ROUTES[route])


def find_symbol(names: Sequence[str], modules: Sequence[str], *, import_missing: bool = True) -> Any:
    """The first attribute of ``names`` found in ``modules`` (imported if needed), else None."""
    for module_name in modules:
        module = sys.modules.get(module_name)
        if module is None:
            if not import_missing:
                continue
            try:
                module = importlib.import_module(module_name)
            except Exception:  # ImportError, or a GPU library missing at import
                continue
        for name in names:
            value = getattr(module, name, None)
            if value is not None:
                return value
    return None
