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
# switch may run there. ``typing`` is not imported for the same reason.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from ._config import LivenessConfig as LivenessConfig
    from ._errors import AccessDenied as AccessDenied
    from ._errors import InvalidIdentityError as InvalidIdentityError
    from ._errors import LivenessError as LivenessError
    from ._errors import PidReused as PidReused
    from ._errors import ProcessGone as ProcessGone
    from ._errors import ProcessZombie as ProcessZombie
    from ._events import EventKind as EventKind
    from ._events import MonitorMethod as MonitorMethod
    from ._events import RankStatus as RankStatus
    from ._events import WorkerEvent as WorkerEvent
    from ._events import WorkerFailedError as WorkerFailedError
    from ._events import WorkerState as WorkerState
    from .diagnose._diagnosis import Diagnosis as Diagnosis
    from .diagnose._diagnosis import diagnose as diagnose
    from .exit._exit_guard import FatalExitGuard as FatalExitGuard
    from .monitor._monitor import WorkerProcessMonitor as WorkerProcessMonitor
    from .monitor._stall_timer import StallDetector as StallDetector
    from .monitor._stall_timer import StallInfo as StallInfo
    from .process._identity import ProcessIdentity as ProcessIdentity
    from .process._identity import capture_identity as capture_identity
    from .process._identity import parse_identities as parse_identities
    from .quarantine._host_policy import HostQuarantinedError as HostQuarantinedError
    from .quarantine._host_policy import QuarantineCheck as QuarantineCheck
    from .quarantine._host_policy import check_host as check_host
    from .quarantine._host_policy import quarantine_host as quarantine_host
    from .quarantine._marker import QuarantinedProcess as QuarantinedProcess
    from .quarantine._marker import QuarantineMarker as QuarantineMarker
    from .quarantine._marker import read_marker as read_marker
    from .stop._bounded_stop import stop_processes as stop_processes
    from .stop._stop_report import StopOutcome as StopOutcome
    from .stop._stop_report import StoppedWorker as StoppedWorker
    from .stop._stop_report import StopReport as StopReport
    from .stop._stop_report import UnkillableWorker as UnkillableWorker

__version__ = "0.1.0"

__all__ = [
    "AccessDenied",
    "Diagnosis",
    "EventKind",
    "FatalExitGuard",
    "HostQuarantinedError",
    "InvalidIdentityError",
    "LivenessConfig",
    "LivenessError",
    "MonitorMethod",
    "PidReused",
    "ProcessGone",
    "ProcessIdentity",
    "ProcessZombie",
    "QuarantineCheck",
    "QuarantineMarker",
    "QuarantinedProcess",
    "RankStatus",
    "StallDetector",
    "StallInfo",
    "StopOutcome",
    "StopReport",
    "StoppedWorker",
    "UnkillableWorker",
    "WorkerEvent",
    "WorkerFailedError",
    "WorkerProcessMonitor",
    "WorkerState",
    "__version__",
    "capture_identity",
    "diagnose",
    "check_host",
    "parse_identities",
    "quarantine_host",
    "read_marker",
    "stop_processes",
]

# Public name -> the submodule that defines it.
_SOURCES = {
    "LivenessConfig": "_config",
    "Diagnosis": "diagnose._diagnosis",
    "diagnose": "diagnose._diagnosis",
    "StallDetector": "monitor._stall_timer",
    "StallInfo": "monitor._stall_timer",
    "AccessDenied": "_errors",
    "InvalidIdentityError": "_errors",
    "LivenessError": "_errors",
    "PidReused": "_errors",
    "ProcessGone": "_errors",
    "ProcessZombie": "_errors",
    "EventKind": "_events",
    "MonitorMethod": "_events",
    "RankStatus": "_events",
    "WorkerEvent": "_events",
    "WorkerFailedError": "_events",
    "WorkerState": "_events",
    "FatalExitGuard": "exit._exit_guard",
    "HostQuarantinedError": "quarantine._host_policy",
    "QuarantineCheck": "quarantine._host_policy",
    "check_host": "quarantine._host_policy",
    "quarantine_host": "quarantine._host_policy",
    "QuarantinedProcess": "quarantine._marker",
    "QuarantineMarker": "quarantine._marker",
    "read_marker": "quarantine._marker",
    "ProcessIdentity": "process._identity",
    "capture_identity": "process._identity",
    "parse_identities": "process._identity",
    "WorkerProcessMonitor": "monitor._monitor",
    "StopOutcome": "stop._stop_report",
    "StoppedWorker": "stop._stop_report",
    "StopReport": "stop._stop_report",
    "UnkillableWorker": "stop._stop_report",
    "stop_processes": "stop._bounded_stop",
}

if not TYPE_CHECKING:  # mypy sees the imports above instead, so a misspelt name stays an error

    def __getattr__(name: str) -> object:
        source = _SOURCES.get(name)
        if source is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        # importlib's module lock makes a concurrent first use safe; the value is then cached here.
        value = getattr(__import__(f"{__name__}.{source}", fromlist=[name]), name)
        globals()[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(globals()) | set(__all__))
