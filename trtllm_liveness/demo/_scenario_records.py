"""Typed records of fault-injection scenarios: what the demo, tests, benchmarks and matrix share.

A scenario child (:mod:`._scenario_child`) builds one :class:`ScenarioResult` per iteration and prints
it as one JSON line (``to_dict()``); the parent turns the lines back into records
(``ScenarioResult.from_dict``) and returns them in a :class:`ScenarioRun`, with what only the
parent can see (the child's exit status and time, the processes its session left behind).

Every record is a frozen dataclass whose JSON form is its fields
(:class:`~trtllm_liveness._record_fields.JsonRecord`: read back strictly); the executor's events
and its stop report are the package's own :class:`~trtllm_liveness.WorkerEvent` and
:class:`~trtllm_liveness.StopReport`, in their own JSON form. Sections that only some scenarios fill are ``None``
when the scenario did not run that part: ``detection`` (a fault while serving), ``shutdown``,
``init`` (a fault before READY, or a failed spawn), ``control`` (no-fault load), ``health_probe``
(concurrent ``check_health()`` callers), ``watcher`` (the watcher thread made to die first) and
``ending`` (a process that ends like a server or a script rather than through ``shutdown()``).
Times are milliseconds after the fault (``fault_at``, ``time.monotonic()``, which is system-wide on Linux).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .._events import WorkerEvent
from .._record_fields import JsonRecord
from ..exit._snapshot_record import FatalSnapshot
from ..stop._stop_report import StopReport

__all__ = [
    "ControlOutcome",
    "Detection",
    "EndingOutcome",
    "HealthProbeOutcome",
    "InitOutcome",
    "ResultInProgress",
    "ScenarioOptions",
    "ScenarioResult",
    "ScenarioRun",
    "ShutdownOutcome",
    "Victim",
    "WatcherFaultOutcome",
]

# "wedge": the whole rank frozen (cgroup v1 freezer); "fuse": one helper thread of the rank stuck in
# a FUSE lookup nobody answers (real D, wchan request_wait_answer). "spawn": MPI_Comm_spawn fails for
# real (PRRTE's session base is a regular file), at start-up.
FAULTS = ("kill", "segv", "stop", "wedge", "fuse", "exit0", "oom", "spawn", "none")
PHASES = ("serving", "init", "shutdown")
# How the scenario process ends: "shutdown" (it calls shutdown(), then os._exit: the default);
# "serve_until_sigint" (like trtllm-serve: waits for SIGINT, then shuts down gracefully and leaves
# through a normal interpreter exit, so atexit hooks and the exit guard run); "interpreter_exit"
# (like an LLM API script that ends without shutdown(): upstream's exit hooks do the rest).
ENDINGS = ("shutdown", "serve_until_sigint", "interpreter_exit")
VIAS = ("class", "executor_cls", "autoload", "plain")

def _check_factory_name(option: str, value: Any) -> None:
    """``value`` is "module:attribute" (dotted identifiers), else ``ValueError`` naming ``option``."""
    module, sep, attribute = value.partition(":") if isinstance(value, str) else ("", "", "")
    if not sep or not all(part.isidentifier() for part in (*module.split("."), *attribute.split("."))):
        raise ValueError(f"scenario option {option}={value!r}: expected 'module:attribute' naming an importable "
                         "callable (e.g. 'package.module:Factory')")


@dataclass(frozen=True)
class ScenarioOptions(JsonRecord):
    """What one scenario child does; see :mod:`._scenario_child` for the faults and phases."""

    mode: str = "main"
    workers: int = 2
    liveness: bool = True
    fault: str = "kill"  # one of FAULTS
    fault_rank: int = 1
    fault_ranks: tuple[int, ...] = ()  # several at once (kill, segv, stop)
    fault_phase: str = "serving"  # one of PHASES
    control_s: float = 0.0  # fault "none": keep requests flowing this long, counting alarms
    oom_limit_mb: int = 64
    health_threads: int = 0
    watcher_fault: bool = False
    cgroup_prefix: str = "trtllm-liveness-scenario"  # a caller's own prefix lets it clean up after a crash
    requests: int = 4
    tokens: int = 400
    token_delay_s: float = 0.01
    init_delay_s: float = 0.0
    observe_s: float = 10.0
    stall_timeout_s: float = 1.0
    health_probe: str = "check_health"  # check_health | fatal_error (upstream's loop alone)
    d_state_timeout_s: float = 1.0
    scan_interval_s: float = 0.1
    shutdown_grace_s: float = 5.0
    shutdown_term_s: float = 0.5
    shutdown_kill_s: float = 1.0
    diagnosis_before_stop_s: float = 0.3  # the package default: the stop waits this long for the snapshot
    exit_on_fatal: bool = False
    exit_code: int = 3
    exit_timeout_s: float = 10.0
    ending: str = "shutdown"  # one of ENDINGS
    iterations: int = 1
    # How the executor is built: "class" (reference proxy class, mixed in directly);
    # "executor_cls" / "autoload" / "plain" go through upstream's API of the ``tensorrt_llm`` on the
    # child's sys.path: liveness_executor_class(GenerationExecutor).create(engine, ...), the import
    # hook, or none, where ``engine`` is what the ``engine`` factory returns.
    via: str = "class"
    # For upstream's API only: "module:attribute" naming an importable callable that returns the
    # engine ``create()`` is given. It is imported in the child after ``tensorrt_llm`` and called
    # with keywords token_delay_s, init_delay_s, announce_dir (each rank writes its identity there,
    # see _executor_worker.read_announced_identities) and fault (the in-rank fault hook's settings).
    engine: str = ""

    def __post_init__(self) -> None:
        for name, value, allowed in (("fault", self.fault, FAULTS), ("fault_phase", self.fault_phase, PHASES),
                                     ("ending", self.ending, ENDINGS), ("via", self.via, VIAS),
                                     ("mode", self.mode, ("main", "1.2"))):
            if value not in allowed:
                raise ValueError(f"scenario option {name}={value!r}: expected one of {', '.join(allowed)}")
        if self.ending != "shutdown" and self.iterations != 1:
            raise ValueError(f"ending {self.ending!r} ends the process: iterations must be 1")
        if self.via != "class" and self.iterations != 1:
            # Upstream main's shutdown of a dead engine closes its queues after a 5 s join of its
            # dispatch thread, which is still blocked in a receive on one of them: libzmq aborts
            # the process (seen on the fake, a few seconds after an iteration ends).
            raise ValueError(f"via {self.via!r} (upstream's API): one iteration per process, iterations must be 1")
        if self.ending == "interpreter_exit" and self.fault != "none":
            raise ValueError("ending 'interpreter_exit' takes fault 'none' (a script that just ends)")
        if self.via == "class" and self.engine:
            raise ValueError(f"scenario option engine={self.engine!r} is for upstream's API (via executor_cls, "
                             "autoload or plain); via 'class' builds the reference executor")
        if self.via != "class":
            _check_factory_name("engine", self.engine)

    @classmethod
    def from_dict(cls, data: Any) -> ScenarioOptions:
        """Options from a JSON mapping that names some of them (lists become tuples); ``ValueError``
        naming an unknown key or a bad value."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown scenario option(s) {', '.join(unknown)}; valid: {', '.join(sorted(known))}")
        options: dict[str, Any] = {name: tuple(value) if isinstance(value, list) else value
                                   for name, value in data.items()}
        return cls(**options)


@dataclass(frozen=True)
class Victim(JsonRecord):
    rank: int
    pid: int


@dataclass(frozen=True)
class Detection(JsonRecord):
    """A fault while serving, from the fault (t0) on; None where it never happened in the window.

    ``floor_ms`` is the kernel's own floor on the same kill: a bare pidfd the harness opened on the
    (first) victim just before the signal, polled in a thread of its own, SIGKILL -> readable; None
    for faults that are not a signal from the harness or do not end the process.
    """

    detected_ms: float | None  # the package's first event
    health_false_ms: float | None
    requests_failed_ms: float | None  # every pending request failed
    e2e_ms: float | None  # both of the two above
    stall_detected_ms: float | None  # no token progress for stall_timeout_s
    floor_ms: float | None
    pending_errors: tuple[str, ...]
    new_request_error: str | None  # the error type of a request submitted after health turned False
    window_s: float


@dataclass(frozen=True)
class ShutdownOutcome(JsonRecord):
    """``shutdown()``: how long it took (None: it hung, or the harness ended the hang), what it did."""

    shutdown_ms: float | None
    hung: bool = False
    by_harness: bool = False  # liveness off: the harness killed the workers instead
    pre_shutdown_calls: int | None = None
    pre_shutdown_runs: int | None = None
    report: StopReport | None = None
    unkillable: tuple[int, ...] = ()
    restartable: bool | None = None
    fatal_restartable: bool | None = None


@dataclass(frozen=True)
class InitOutcome(JsonRecord):
    """A fault before READY (death during the build, or a failed spawn): did construction fail?"""

    hung: bool
    error_ms: float | None
    error_type: str | None
    error: str | None
    restartable: bool | None = None
    spawn_failed: bool | None = None  # fault "spawn": mpi4py's manager thread died in MPI_Comm_spawn


@dataclass(frozen=True)
class ControlOutcome(JsonRecord):
    """No fault, requests kept in flight for ``control_s``: every alarm here is a false one."""

    control_s: float
    requests_completed: int
    request_errors: int
    wrong_tokens: int
    health_checks: int
    health_false: int
    alarms: int


@dataclass(frozen=True)
class HealthProbeOutcome(JsonRecord):
    """``threads`` threads calling ``check_health()`` through the fault."""

    threads: int
    calls: int
    false_answers: int
    inconsistent: int  # True answers after the first False, and False -> True flips
    errors: tuple[str, ...]
    threads_alive: int


@dataclass(frozen=True)
class WatcherFaultOutcome(JsonRecord):
    alive_at_fault: bool
    error: str


@dataclass(frozen=True)
class EndingOutcome(JsonRecord):
    """How a process that ends like a server or a script got there (the exit status is the
    parent's: :attr:`ScenarioRun.returncode`)."""

    ending: str
    sigints: int = 0  # SIGINTs received (the exit guard's graceful shutdown request)
    sigint_ms: float | None = None  # fault -> first SIGINT
    graceful_ms: float | None = None  # first SIGINT -> shutdown() returned
    at_exit: bool = False  # reported from an atexit hook (after upstream's exit hooks ran)


@dataclass(frozen=True)
class ScenarioResult(JsonRecord):
    """One iteration of a scenario."""

    iteration: int
    options: ScenarioOptions
    phase: str
    proxy_class: str | None = None
    ready_ms: float | None = None
    pids: tuple[int, ...] = ()
    victims: tuple[Victim, ...] = ()
    in_flight: int | None = None
    tokens_ok: bool | None = None  # fault "none" without control_s: every request returned its tokens
    fault_at: float | None = None  # time.monotonic() of the fault
    events: tuple[WorkerEvent, ...] = ()  # the executor's (WorkerEvent.from_dict: no monotonic times)
    fatal_error: str | None = None
    fatal_error_type: str | None = None
    pending_not_done: int | None = None
    detection: Detection | None = None
    shutdown: ShutdownOutcome | None = None
    init: InitOutcome | None = None
    control: ControlOutcome | None = None
    health_probe: HealthProbeOutcome | None = None
    watcher: WatcherFaultOutcome | None = None
    ending: EndingOutcome | None = None
    survivors: tuple[int, ...] = ()  # ranks alive after the iteration (after any release)
    survivors_while_frozen: tuple[int, ...] = ()  # ranks alive before the freezer/FUSE stall let go
    snapshot: FatalSnapshot | None = None  # fault "stop": the extension's snapshot of the ranks at the stall
    oom_kills: int | None = None
    freezer_path: str | None = None
    memory_cgroup_path: str | None = None
    critical_logs: tuple[str, ...] = ()
    thread_exceptions: tuple[str, ...] = ()
    pidfds_open: int | None = None  # in the scenario process after the iteration
    fds_open: int | None = None

    @property
    def victim(self) -> Victim | None:
        """The (first) rank the fault hit."""
        return self.victims[0] if self.victims else None


class ResultInProgress:
    """One iteration's :class:`ScenarioResult` while the scenario child finds it: the record itself,
    replaced by :meth:`update` as each part is known (``dataclasses.replace``: an unknown field is a
    ``TypeError``), read as :attr:`result`. Used by the child's one main thread and its exit hook."""

    def __init__(self, iteration: int, options: ScenarioOptions, phase: str) -> None:
        self.result = ScenarioResult(iteration=iteration, options=options, phase=phase)

    def update(self, **changes: Any) -> None:
        """Replace the named fields of :attr:`result` (sequences as tuples)."""
        self.result = dataclasses.replace(self.result, **changes)


@dataclass(frozen=True)
class ScenarioRun:
    """What the parent saw of one scenario child (:func:`._scenario_launcher.run_scenario`).

    ``results``: one record per finished iteration. ``survivors``: pids of the child's session
    still alive after cleanup (should be none). ``done``: the child reported it had finished every
    iteration. ``error``: its traceback, if it failed; ``stderr``: the tail of its stderr.
    ``returncode``: its exit status (negative: a signal; -9 after the outer timeout);
    ``exited_at``: ``time.monotonic()`` when it exited, seen through a pidfd; ``timed_out``: the
    outer timeout ended it.
    """

    results: tuple[ScenarioResult, ...]
    survivors: tuple[int, ...]
    done: bool
    error: str | None = None
    stderr: str = ""
    returncode: int | None = None
    exited_at: float | None = None
    timed_out: bool = False
    progress: tuple[Mapping[str, Any], ...] = field(default=(), repr=False)  # other JSON lines (pids, fault_at)

    @property
    def fault_at(self) -> float | None:
        """When the child injected its (last) fault, also if it never finished the iteration."""
        for line in reversed(self.progress):
            if isinstance(line.get("fault_at"), (int, float)):
                return float(line["fault_at"])
        return next((r.fault_at for r in reversed(self.results) if r.fault_at is not None), None)

    @property
    def exit_ms(self) -> float | None:
        """Fault -> the child process exited, when both are known."""
        at = self.fault_at
        return None if at is None or self.exited_at is None else round((self.exited_at - at) * 1e3, 3)

    def problems(self) -> list[str]:
        """Why the run is not a clean one: the child's error or stderr, and processes left behind."""
        found = [] if self.done else [self.error or self.stderr or "the scenario did not finish"]
        if self.survivors:
            found.append(f"processes left behind: {list(self.survivors)}")
        return found

    @staticmethod
    def parse(lines: Sequence[Mapping[str, Any]]) -> tuple[tuple[ScenarioResult, ...], tuple[Mapping[str, Any], ...]]:
        """Split a child's JSON lines into results and the rest (progress, done, error)."""
        results, other = [], []
        for line in lines:
            if "options" in line and "phase" in line:
                results.append(ScenarioResult.from_dict(line))
            else:
                other.append(line)
        return tuple(results), tuple(other)
