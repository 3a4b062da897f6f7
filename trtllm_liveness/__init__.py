"""trtllm-liveness: notice, report and survive the death or wedge of an inference worker process.

The core is standard-library only and Linux-specific (pidfds, procfs). Public API:

- :class:`ProcessIdentity`, :func:`capture_identity`, :func:`parse_identities`: who a worker is.
- :class:`WorkerProcessMonitor`: event-driven death and ``D``-state wedge detection.
- :class:`WorkerEvent`, :class:`EventKind`, :class:`WorkerState`, :class:`RankStatus`,
  :class:`WorkerFailedError`: the health model.
- :func:`stop_processes` and :class:`StopReport`: a shutdown whose every wait has a deadline, which
  reports the workers SIGKILL could not reap (``D`` state) instead of hanging on them.
- :class:`FatalExitGuard`: after an engine death, one graceful shutdown, then a bounded non-zero exit.
- :class:`LivenessConfig`: the switch and knobs, from ``llm_args.worker_liveness`` or the
  ``TRTLLM_WORKER_LIVENESS`` environment variable, strictly validated.
- Errors: :class:`LivenessError` and its subclasses, :class:`InvalidIdentityError`.
"""

from ._config import LivenessConfig
from ._errors import (
    AccessDenied,
    InvalidIdentityError,
    LivenessError,
    PidReused,
    ProcessGone,
    ProcessZombie,
    StopTimeout,
)
from ._events import EventKind, RankStatus, WorkerEvent, WorkerFailedError, WorkerState
from ._exit_guard import FatalExitGuard
from ._identity import ProcessIdentity, capture_identity, parse_identities
from ._monitor import WorkerProcessMonitor
from ._shutdown import StopOutcome, StoppedWorker, StopReport, UnkillableWorker, stop_processes

__version__ = "0.1.0"

__all__ = [
    "AccessDenied",
    "EventKind",
    "FatalExitGuard",
    "InvalidIdentityError",
    "LivenessConfig",
    "LivenessError",
    "PidReused",
    "ProcessGone",
    "ProcessIdentity",
    "ProcessZombie",
    "RankStatus",
    "StopOutcome",
    "StopReport",
    "StopTimeout",
    "StoppedWorker",
    "UnkillableWorker",
    "WorkerEvent",
    "WorkerFailedError",
    "WorkerProcessMonitor",
    "WorkerState",
    "__version__",
    "capture_identity",
    "parse_identities",
    "stop_processes",
]
