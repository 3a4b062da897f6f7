"""trtllm-liveness: notice, report and survive the death or wedge of an inference worker process.

The core is standard-library only and Linux-specific (pidfds, procfs). Public API:

- :class:`ProcessIdentity`, :func:`capture_identity`, :func:`parse_identities`: who a worker is.
- :class:`WorkerProcessMonitor`: event-driven death and ``D``-state wedge detection.
- :class:`WorkerEvent`, :class:`EventKind`, :class:`WorkerState`, :class:`RankStatus`,
  :class:`MonitorMethod`, :class:`WorkerFailedError`: the health model.
- :func:`stop_processes` and :class:`StopReport`: a shutdown whose every wait has a deadline, which
  reports the workers SIGKILL could not reap (``D`` state) instead of hanging on them.
- :class:`FatalExitGuard`: after an engine death, one graceful shutdown, then a bounded non-zero exit.
- :class:`LivenessConfig`: the switch and knobs, from the class's ``config=``,
  ``TRTLLM_WORKER_LIVENESS`` (inline or ``@file``) or upstream main's ``env_overrides``, strictly
  validated.
- Quarantine of a wedged host: :func:`quarantine_host` records a non-restartable failure in the
  host's marker (and runs the configured drain/cordon/hook), :func:`check_host` and
  :func:`read_marker` read it (:class:`QuarantineCheck`, :class:`QuarantineMarker`,
  :class:`QuarantinedProcess`); an engine start on a quarantined host raises
  :class:`HostQuarantinedError`.
- :class:`StallDetector` and :class:`StallInfo`: "alive but no progress" with a pending request,
  detected by a timer armed by progress (``stall_timeout_s`` of the TensorRT-LLM extension).
- :func:`diagnose` and :class:`Diagnosis`: a bounded snapshot of every rank (per-thread activity,
  wait channels, Python stacks with py-spy, the odd rank out), never blocked by a wedged rank.
- Errors: :class:`LivenessError` and its subclasses, :class:`InvalidIdentityError`.
"""

# Names resolve on first use (PEP 562, as ``concurrent.futures`` does): the autoload ``.pth`` imports
# this package in every interpreter of its environment, and with liveness off nothing but the
# switch may run there. Nothing is imported here, ``typing`` included, for the same reason.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, MutableMapping

    from ._config import LivenessConfig
    from ._errors import AccessDenied, InvalidIdentityError, LivenessError, PidReused, ProcessGone, ProcessZombie
    from ._events import EventKind, MonitorMethod, RankStatus, WorkerEvent, WorkerFailedError, WorkerState
    from .diagnose._diagnosis import Diagnosis, diagnose
    from .exit._exit_guard import FatalExitGuard
    from .monitor._monitor import WorkerProcessMonitor
    from .monitor._stall_timer import StallDetector, StallInfo
    from .process._identity import ProcessIdentity, capture_identity, parse_identities
    from .quarantine._host_policy import HostQuarantinedError, QuarantineCheck, check_host, quarantine_host
    from .quarantine._marker import QuarantinedProcess, QuarantineMarker, read_marker
    from .stop._bounded_stop import stop_processes
    from .stop._stop_report import StopOutcome, StoppedWorker, StopReport, UnkillableWorker

__version__ = "0.1.0"

__all__ = ["AccessDenied", "Diagnosis", "EventKind", "FatalExitGuard", "HostQuarantinedError", "InvalidIdentityError",
           "LivenessConfig", "LivenessError", "MonitorMethod", "PidReused", "ProcessGone", "ProcessIdentity",
           "ProcessZombie", "QuarantineCheck", "QuarantineMarker", "QuarantinedProcess", "RankStatus", "StallDetector",
           "StallInfo", "StopOutcome", "StopReport", "StoppedWorker", "UnkillableWorker", "WorkerEvent",
           "WorkerFailedError", "WorkerProcessMonitor", "WorkerState", "__version__", "capture_identity", "check_host",
           "diagnose", "parse_identities", "quarantine_host", "read_marker", "stop_processes"]

_SOURCES = {
    "._config": ("LivenessConfig",),
    "._errors": ("AccessDenied", "InvalidIdentityError", "LivenessError", "PidReused", "ProcessGone", "ProcessZombie"),
    "._events": ("EventKind", "MonitorMethod", "RankStatus", "WorkerEvent", "WorkerFailedError", "WorkerState"),
    ".diagnose._diagnosis": ("Diagnosis", "diagnose"),
    ".exit._exit_guard": ("FatalExitGuard",),
    ".monitor._monitor": ("WorkerProcessMonitor",),
    ".monitor._stall_timer": ("StallDetector", "StallInfo"),
    ".process._identity": ("ProcessIdentity", "capture_identity", "parse_identities"),
    ".quarantine._host_policy": ("HostQuarantinedError", "QuarantineCheck", "check_host", "quarantine_host"),
    ".quarantine._marker": ("QuarantineMarker", "QuarantinedProcess", "read_marker"),
    ".stop._bounded_stop": ("stop_processes",),
    ".stop._stop_report": ("StopOutcome", "StopReport", "StoppedWorker", "UnkillableWorker"),
}


def _lazy_exports(package: str, sources: "Mapping[str, tuple[str, ...]]", namespace: "MutableMapping[str, object]",
                  ) -> "tuple[Callable[[str], object], Callable[[], list[str]]]":
    """The module ``__getattr__`` and ``__dir__`` (PEP 562) of a package's face, the one mechanism
    every face of this package uses: ``sources`` maps each module (relative to ``package``, as
    ``importlib.import_module`` takes it) to the public names it defines. A name is imported on its
    first use and then cached in ``namespace`` (the face's ``globals()``), so importing one module
    of a folder never loads its siblings. Thread-safe through importlib's module lock. It lives in
    the root because the root may import nothing (not even a module of its own) when it loads."""
    where = {name: module for module, names in sources.items() for name in names}

    def __getattr__(name: str) -> object:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        import importlib

        value = getattr(importlib.import_module(module, package), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(where))

    return __getattr__, __dir__


if not TYPE_CHECKING:  # mypy sees the imports above instead, so a misspelt name stays an error
    __getattr__, __dir__ = _lazy_exports(__name__, _SOURCES, globals())
