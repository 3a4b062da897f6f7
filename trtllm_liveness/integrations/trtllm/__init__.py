"""TensorRT-LLM integration: worker identities, event-driven death/wedge handling, bounded shutdown.

Works with the released 1.2.x and with main; every upstream name is looked up lazily and
feature-detected (docs/upstream-contract.md lists each one, where it exists and what happens
when it is missing). ``tensorrt_llm`` is never imported at module import time.

Where each part lives::

    _features.py      what the installed TensorRT-LLM offers; one WARNING per missing hook/route
    _worker_spec.py   WorkerSpec: what the proxy hands every rank with its task, checked on the rank
    _worker_entry.py  every rank's entry: proxy-death watch, identities (1.2.x), then worker_main
    _side_channel.py  the proxy's end of the 1.2.x identity side channel
    _identities.py    per-element validation of identity payloads
    _shim.py          what upstream main sees as its _worker_process_monitor
    _state.py         EngineLiveness (one attribute on the proxy), its FatalPath and EngineStop
    _mixin.py         LivenessProxyMixin: the overrides of upstream's GenerationExecutorProxy
    _startup.py       an engine's start: its monitor, metrics on trtllm-serve's page, the "on" line,
                      the session's submit wrapped so every rank runs liveness_worker_entry
    _engine_shutdown.py  the bounded shutdown; the exit guard's graceful action and last resort
    _engine_stall.py  stall detection of an engine (progress in, stall out) and its diagnoses
    _progress.py      executor iterations as progress: the ranks' counter and the proxy's listener
    _fatal.py         the fatal path (publish, fail, guard, then pre_shutdown in a helper)
    _upstream_teardown.py  upstream's own teardown left nothing to wait for: the results table that
                      drops late responses, the worker futures and the dispatch thread's end marker
                      after the bounded stop, running upstream's shutdown
    _classes.py       liveness_proxy_class, liveness_executor_class, patch_tensorrt_llm
    _doctor.py        what ``trtllm-liveness doctor`` reports

Data flow::

    proxy __init__ -> EngineLiveness(monitor started, wedge verdicts held until READY)
    _start_executor_workers -> mpi_session.submit(liveness_worker_entry, ..., spec=WorkerSpec(worker_main, ...))
        rank: proxy-death watch (pidfd on the proxy) ; 1.2.x: gather identities -> side channel
        main: upstream's identities message -> shim.register -> monitor
    READY -> arm the wedge timer (and, with stall_timeout_s, the stall timer)
    monitor watcher: death / wedge -> fatal path (_fatal.py)
    rank iterations (HangDetector.checkpoint) / else output (dispatch thread activity, sampled) -> stall timer
        -> stalled: statuses + WARNING with diagnosis (report) or the fatal path (fatal)
    pre_shutdown() / shim.close() / healthy shutdown() -> expected exits (not deaths)
    fatal path -> requests failed and forgotten (a late response is dropped: FailedResults)
    shutdown() -> upstream's in a daemon thread, then stop_processes (bounded), then upstream's
        futures failed and its dispatch thread given the end marker: upstream's shutdown() has
        nothing left to wait for (_engine_shutdown.py)

**Exit on fatal** (``exit_on_fatal``): README.md "What it does to pods and jobs" and
docs/configuration.md give its timing and exit statuses. The code: ``_engine_shutdown.py`` arms a
:class:`~trtllm_liveness.exit._exit_guard.FatalExitGuard` (its graceful action and last resort);
``_fatal.py`` triggers it and keeps ``/health`` from sending a second SIGINT.

**Activation**: docs/configuration.md "Where settings come from" (the class, ``TRTLLM_WORKER_LIVENESS``
with the import hook of :mod:`trtllm_liveness.integrations.trtllm_autoload`, ``llm_args.env_overrides``).
The module attribute ``LivenessGenerationExecutor`` is ``liveness_executor_class()``, built lazily.

Limits: the rpc and ray orchestrators and the single-process worker get no liveness (one WARNING
names the route); a rank that dies before its entry ran is only seen by upstream's own checks;
ranks on other hosts are reported unmonitored, not dead, and have no proxy-death watch.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from .._pool_manager_watch import PoolManagerDiedError
    from ._classes import liveness_executor_class, liveness_proxy_class, patch_tensorrt_llm
    from ._features import UpstreamFeatures, detect_features
    from ._mixin import LivenessProxyMixin
    from ._state import EngineLiveness
    from ._worker_entry import PROXY_DIED_EXIT_STATUS, liveness_worker_entry

__all__ = ["PROXY_DIED_EXIT_STATUS", "EngineLiveness", "LivenessProxyMixin", "PoolManagerDiedError", "UpstreamFeatures",
           "detect_features", "liveness_executor_class", "liveness_proxy_class", "liveness_worker_entry",
           "patch_tensorrt_llm"]

_SOURCES = {
    ".._pool_manager_watch": ("PoolManagerDiedError",),
    "._classes": ("liveness_executor_class", "liveness_proxy_class", "patch_tensorrt_llm"),
    "._features": ("UpstreamFeatures", "detect_features"),
    "._mixin": ("LivenessProxyMixin",),
    "._state": ("EngineLiveness",),
    "._worker_entry": ("PROXY_DIED_EXIT_STATUS", "liveness_worker_entry"),
}

if not TYPE_CHECKING:
    from ..._lazy import lazy_exports

    _export, __dir__ = lazy_exports(__name__, _SOURCES, globals())

    def __getattr__(name: str) -> object:
        # ``LivenessGenerationExecutor``: ``liveness_executor_class()``, built on first use (which
        # imports tensorrt_llm only then) and cached; every other name is a lazy export.
        if name != "LivenessGenerationExecutor":
            return _export(name)
        globals()[name] = executor_cls = _export("liveness_executor_class")()
        return executor_cls
