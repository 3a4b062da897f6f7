"""trtllm-liveness: notice, report and survive the death or wedge of a TensorRT-LLM worker process.

Public API, what a user of the extension calls and reads (each name is imported on first use):

- :func:`liveness_executor_class`: the entry, ``LLM(model, executor_cls=liveness_executor_class())``:
  a ``GenerationExecutor`` whose MPI proxy has liveness on (``trtllm-serve`` and Dynamo switch it
  on with ``TRTLLM_WORKER_LIVENESS`` and the import hook instead).
- :class:`LivenessConfig`: the switch and knobs, from ``liveness_executor_class(config=...)``,
  ``TRTLLM_WORKER_LIVENESS`` (inline or ``@file``) or upstream main's ``env_overrides``, strictly
  validated.
- The errors an engine raises: :class:`WorkerFailedError`, its fatal error after a rank died,
  wedged, became unkillable, was lost or stalled (``restartable``: whether this host may run it
  again); :class:`HostQuarantinedError`, a start refused on a host where a worker of an earlier
  engine is still stuck; :class:`PoolManagerDiedError`, a start whose MPI pool's manager thread
  ended before the workers were up.
- The records the executor's ``liveness_*`` members return: :class:`WorkerEvent` (one fatal
  observation about a rank, of an :class:`EventKind`); :class:`RankStatus` (a rank's
  :class:`WorkerState` and how it is watched, its :class:`MonitorMethod`); :class:`Diagnosis` (where
  every rank was at a stall, a wedge or a fatal error); :class:`StopReport` (whom the bounded
  shutdown stopped, and whom it could not end).

The machinery is importable from its folder's face: :mod:`.process` (identities, pidfds, the
process errors), :mod:`.monitor`, :mod:`.stop`, :mod:`.exit`, :mod:`.quarantine`,
:mod:`.diagnose`, :mod:`.multihost`, :mod:`.integrations`. The core is standard-library only and
Linux-specific (pidfds, procfs).
"""

# Names resolve on first use (PEP 562, as ``concurrent.futures`` does): the autoload ``.pth`` imports
# this package in every interpreter of its environment, and with liveness off nothing but the
# switch may run there. Nothing is imported here, ``typing`` included, for the same reason.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from ._config import LivenessConfig
    from ._events import EventKind, MonitorMethod, RankStatus, WorkerEvent, WorkerFailedError, WorkerState
    from .diagnose._diagnosis import Diagnosis
    from .integrations._pool_manager_watch import PoolManagerDiedError
    from .integrations.trtllm._classes import liveness_executor_class
    from .quarantine._host_policy import HostQuarantinedError
    from .stop._stop_report import StopReport

__version__ = "0.1.0"

__all__ = ["Diagnosis", "EventKind", "HostQuarantinedError", "LivenessConfig", "MonitorMethod", "PoolManagerDiedError",
           "RankStatus", "StopReport", "WorkerEvent", "WorkerFailedError", "WorkerState", "liveness_executor_class"]

_SOURCES = {
    "._config": ("LivenessConfig",),
    "._events": ("EventKind", "MonitorMethod", "RankStatus", "WorkerEvent", "WorkerFailedError", "WorkerState"),
    ".diagnose._diagnosis": ("Diagnosis",),
    ".integrations._pool_manager_watch": ("PoolManagerDiedError",),
    ".integrations.trtllm._classes": ("liveness_executor_class",),
    ".quarantine._host_policy": ("HostQuarantinedError",),
    ".stop._stop_report": ("StopReport",),
}


if not TYPE_CHECKING:  # mypy sees the imports above instead, so a misspelt name stays an error

    def _install():  # the one mechanism (._lazy), loaded by the root's first lookup, never by its import
        from ._lazy import lazy_exports

        lookup, listing = lazy_exports(__name__, _SOURCES, globals())
        globals().update(__getattr__=lookup, __dir__=listing)
        return lookup, listing

    def __getattr__(name):
        return _install()[0](name)

    def __dir__():
        return _install()[1]()
