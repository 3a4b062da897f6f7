"""Feature detection: what the installed TensorRT-LLM offers, probed once, and loud degraded modes.

Every upstream name the extension touches is looked up here or with ``getattr`` at the call site;
docs/upstream-contract.md lists each name, where it exists and what happens when it is missing.
A missing hook that costs coverage is logged as ONE WARNING per hook and class, naming what is
then not covered; a missing hook that the extension replaces itself is logged at debug level.
"""

from __future__ import annotations

import functools
import importlib
import inspect
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
    "dispatch_result_task": "output as progress for stall detection (only executor iterations count)",
}
# Hooks the extension replaces when absent (debug log only): name -> what it does instead.
REPLACED_HOOKS: Mapping[str, str] = {
    "check_health": "the extension adds check_health (1.2.x: health is not is_shutdown())",
    "_fatal_error": "the extension creates it (None) before upstream's constructor",
    "_set_fatal_error": "the fatal error is stored in _fatal_error directly",
    "_mark_engine_dead": "each pending request is failed with an ErrorResponse",
    "_engine_dead": "treated as False (upstream has no death path of its own)",
    "_owns_mpi_session": "the extension's own record: the proxy owns its session if none was passed in",
    "WORKER_PROCESS_IDENTITIES_SIGNAL": "identities come over the extension's side channel",
    "_error_monitor_loop": "nothing: the watcher thread replaces polling",
}

_WARNED: set[tuple[str, str]] = set()
_WARNED_LOCK = threading.Lock()


@dataclass(frozen=True)
class UpstreamFeatures:
    """What a proxy class offers: a class attribute (``hasattr``), or for the instance attributes
    ``_fatal_error``, ``_engine_dead`` and ``_owns_mpi_session`` one that its constructor assigns
    (see :func:`has_attribute`)."""

    check_health: bool
    fatal_error: bool
    set_fatal_error: bool
    error_monitor_loop: bool
    mark_engine_dead: bool
    identities_signal: bool
    missing_hooks: tuple[str, ...] = ()
    engine_dead: bool = False
    owns_mpi_session: bool = False

    @property
    def flavour(self) -> str:
        """``"main"`` when upstream sends identities itself, ``"1.2"`` otherwise."""
        return "main" if self.identities_signal else "1.2"

    def has(self, name: str) -> bool:
        """Whether the hook ``name`` (a key of REQUIRED_HOOKS or REPLACED_HOOKS) was found."""
        if name in REQUIRED_HOOKS:
            return name not in self.missing_hooks
        # A REPLACED_HOOKS name's field is the name without its underscores, the signal's aside.
        field = "identities_signal" if name == "WORKER_PROCESS_IDENTITIES_SIGNAL" else name.strip("_")
        return bool(getattr(self, field))


def _attribute_names(function: Any, opnames: frozenset[str]) -> set[str]:
    import dis  # only when probing: nothing on the import path of the autoload hook

    # A decorated constructor (functools.wraps) is read through to the function it wraps.
    code = getattr(inspect.unwrap(function), "__code__", None)
    if code is None:
        return set()
    return {str(instr.argval) for instr in dis.get_instructions(code) if instr.opname in opnames}


_STORES = frozenset({"STORE_ATTR"})
_LOADS = frozenset({"LOAD_ATTR", "LOAD_METHOD"})


def has_attribute(cls: type, name: str) -> bool:
    """Whether instances of ``cls`` have ``name`` from construction on: a class attribute, or one
    that a constructor in the MRO assigns (``self.name = ...``), directly or in a method of the
    class it calls (one level: main's proxy sets its state in such helpers). Read from the
    bytecode, so it works without source files; never raises (False when it cannot tell)."""
    if hasattr(cls, name):
        return True
    try:
        for klass in cls.__mro__:
            init = vars(klass).get("__init__")
            if init is None or klass is object:
                continue
            if name in _attribute_names(init, _STORES):
                return True
            for called in _attribute_names(init, _LOADS):
                method = inspect.getattr_static(cls, called, None)
                if inspect.isfunction(method) and name in _attribute_names(method, _STORES):
                    return True
    except Exception:  # an unusual class layout: say "not found", the extension then creates it
        logger.debug("liveness: could not probe %s for %s", cls, name, exc_info=True)
    return False


@functools.lru_cache(maxsize=32)
def detect_features(proxy_cls: type) -> UpstreamFeatures:
    """Probe ``proxy_cls`` (the upstream class, or a liveness subclass: its base is probed) once; cached."""
    base = getattr(proxy_cls, "_liveness_base", proxy_cls)
    features = UpstreamFeatures(
        check_health=hasattr(base, "check_health"),
        # main sets _fatal_error in GenerationExecutor.__init__: an instance attribute, not a class one.
        fatal_error=has_attribute(base, "_fatal_error"),
        set_fatal_error=hasattr(base, "_set_fatal_error"),
        error_monitor_loop=hasattr(base, "_error_monitor_loop"),
        mark_engine_dead=hasattr(base, "_mark_engine_dead"),
        identities_signal=hasattr(base, "WORKER_PROCESS_IDENTITIES_SIGNAL"),
        missing_hooks=tuple(name for name in REQUIRED_HOOKS if not hasattr(base, name)),
        engine_dead=has_attribute(base, "_engine_dead"),
        owns_mpi_session=has_attribute(base, "_owns_mpi_session"),
    )
    logger.debug("liveness: %s.%s looks like TensorRT-LLM %s: %s",
                 base.__module__, base.__qualname__, features.flavour, features)
    return features


def warn_once(key: str, subject: str, message: str, *args: Any, exc_info: bool = False) -> None:
    """Log ``message`` as a WARNING once per ``(key, subject)`` in this process."""
    log_once(logging.WARNING, key, subject, message, *args, exc_info=exc_info)


def log_once(level: int, key: str, subject: str, message: str, *args: Any, exc_info: bool = False) -> None:
    """Log ``message`` at ``level`` once per ``(key, subject)`` in this process."""
    with _WARNED_LOCK:
        if (key, subject) in _WARNED:
            return
        _WARNED.add((key, subject))
    logger.log(level, message, *args, exc_info=exc_info)


def warn_missing_hooks(proxy_cls: type) -> None:
    """One WARNING per hook of ``REQUIRED_HOOKS`` that ``proxy_cls`` lacks."""
    base = getattr(proxy_cls, "_liveness_base", proxy_cls)
    features = detect_features(base)
    subject = f"{base.__module__}.{base.__qualname__}"
    for name in features.missing_hooks:
        warn_once(name, subject, "liveness: %s has no %s: %s is not covered", subject, name, REQUIRED_HOOKS[name])
    for name, instead in REPLACED_HOOKS.items():
        if not features.has(name):
            logger.debug("liveness: %s has no %s: %s", subject, name, instead)


# Hooks of the MPI session whose absence costs coverage: name -> what is then not covered.
SESSION_HOOKS: Mapping[str, str] = {
    "release_exit_joins": "releasing mpi4py's exit join after a death for a session the proxy does not own "
                          "(the extension releases it for owned sessions only; without it the interpreter may "
                          "hang at exit after a death unless exit_on_fatal)",
    "abandon": "abandoning an owned session whose upstream shutdown() is still blocked after the workers were "
               "stopped: the interpreter may wait at exit",
}


def warn_session_hooks(session: Any, *, owned: bool | None = None) -> None:
    """One WARNING per missing session hook that the extension cannot replace (once per process
    and session class). ``owned``: whether the proxy created the session (None: unknown, then a
    missing ``release_exit_joins`` is not judged)."""
    if session is None:
        warn_once("mpi_session", "None", "liveness: the proxy has no mpi_session: worker identities and the "
                  "proxy-death watch are not covered")
        return
    subject = type(session).__qualname__
    if not callable(getattr(session, "submit", None)):
        warn_once("submit", subject, "liveness: the MPI session %s has no submit(): worker identities and the "
                  "proxy-death watch are not covered", subject)
    # Only a session with an mpi4py pool (MpiPoolSession's mpi_pool) has a pool thread to join at exit.
    if owned is False and getattr(session, "mpi_pool", None) is not None \
            and not callable(getattr(session, "release_exit_joins", None)):
        warn_once("release_exit_joins", subject, "liveness: the MPI session %s has no release_exit_joins(), so %s "
                  "is not covered", subject, SESSION_HOOKS["release_exit_joins"])


# Routes of GenerationExecutor.create that do not build an MPI GenerationExecutorProxy.
UNCOVERED_ROUTES: Mapping[str, str] = {
    "rpc": "the RPC orchestrator (GenerationExecutorRpcProxy): its workers are not watched, deaths are "
           "seen only by upstream's own checks",
    "ray": "the Ray orchestrator (RayExecutor): its actors are not watched; upstream catches a dead actor "
           "only at start-up",
    "single-process": "the single-process worker (return_logits or TLLM_WORKER_USE_SINGLE_PROCESS): the "
                      "worker runs in this process, no MPI ranks to watch",
}


def route_of(kwargs: Mapping[str, Any]) -> str:
    """Which orchestrator ``GenerationExecutor.create(**kwargs)`` uses: ``rpc``, ``ray`` or ``mpi``.

    The single-process worker is a branch inside the MPI route whose condition (world size, session,
    environment) only ``create`` itself evaluates: the create hook warns when it is taken
    (``use_worker``), not guessed from the arguments here."""
    llm_args = kwargs.get("llm_args")
    orchestrator = kwargs.get("orchestrator_type", getattr(llm_args, "orchestrator_type", None))
    if orchestrator in ("rpc", "ray"):
        return str(orchestrator)
    return "mpi"


def warn_route(route: str) -> None:
    """One WARNING per uncovered route in this process (naming it and what is not covered)."""
    if route in UNCOVERED_ROUTES:
        warn_once("route", route, "liveness: GenerationExecutor.create takes the %s route: %s is not covered "
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


# Session kinds whose ranks upstream main does not register (docs/upstream-contract.md, "Sessions").
UNREGISTERED_SESSION_KINDS = frozenset({"MpiCommSession", "RemoteMpiCommSessionClient"})


def upstream_skips_registration(session: Any) -> bool:
    return any(cls.__name__ in UNREGISTERED_SESSION_KINDS for cls in type(session).__mro__)
