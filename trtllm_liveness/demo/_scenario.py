"""Fault-injection scenarios on the reference executor: the engine of the demo, tests and benchmark.

Run as ``python -m trtllm_liveness.demo._scenario '<json options>'`` in a child process
started with ``start_new_session=True`` (an MPI launcher may kill its whole process group); the
parent side is :func:`run_scenario`. The child prints one JSON line per iteration (a
:class:`~._scenario_records.ScenarioResult`'s ``to_dict()``) and a final ``{"done": true}`` line, then ends
with ``os._exit`` so no MPI/atexit join can hang it (except for the endings below, whose point is
the real interpreter exit). Every wait is bounded by the options.

A scenario: start the executor (mode ``1.2`` or ``main``, liveness on or off, configured through
``TRTLLM_WORKER_LIVENESS`` as a server would be), stream requests, inject the fault into one rank,
then time detection, health, failed requests and shutdown. The executor (``via``): the reference
proxy (``class``), or upstream's API of the ``tensorrt_llm`` on ``sys.path``, in the tests the
upstream-shaped fakes (``executor_cls``, ``autoload``, ``plain``): ``GenerationExecutor.create(
FakeEngine(...), model_world_size=N)``, whose ranks announce their identities (``announce_dir``) and
arm the in-rank faults (``fault``) as the reference's do, so every fault below runs on both; on
upstream's API one iteration per process (``ScenarioOptions``).
Faults: ``kill`` (SIGKILL; ``fault_ranks`` kills several at once), ``segv`` (SIGSEGV), ``stop``
(SIGSTOP), ``wedge`` (cgroup v1 freezer: real ``D`` state), ``exit0`` (the rank calls
``os._exit(0)`` mid-request), ``oom`` (the rank, in a memory-limited cgroup v1, allocates until the
kernel OOM killer ends it) and ``none`` (``control_s`` > 0: a no-fault control under request
load). Phases: ``serving``, ``init`` (during the model build) and ``shutdown`` (while
``shutdown()`` runs). Without liveness, the hang is observed for ``observe_s`` and the workers are
then killed by the harness (the executor itself would wait forever). For signal faults the harness
also times the kernel's floor on the same kill (a bare pidfd on the victim, ``Detection.floor_ms``).

Endings (``ending``): ``shutdown`` (default); ``serve_until_sigint``, a server: after the fault it
waits (up to ``observe_s``) for the SIGINT of the exit guard (``exit_on_fatal``), then shuts down
gracefully and leaves through a normal interpreter exit, so the guard's exit status is the one the
parent sees; ``interpreter_exit``, an LLM API script: it serves its requests and simply ends, without
``shutdown()``; the record is printed from an ``atexit`` hook registered before the executor's own,
so it runs after them (a hook that ends the process first leaves no record: the exit status says why).

Hardening probes: ``health_threads`` calls ``check_health()`` from that many threads during the
fault and counts answers inconsistent with the first False; ``watcher_fault`` makes the
monitor's watcher thread die before the fault, so only the synchronous path can see it. Each
iteration reports the pidfds this process still holds afterwards (``pidfds_open``).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import gc
import itertools
import json
import logging
import os
import select
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..process import _pidfd, _procfs
from ..process._identity import ProcessIdentity
from ..stop._bounded_stop import stop_processes
from ._cgroup_faults import FREEZER_ROOT, FreezerGroup, MemoryGroup
from ._executor_worker import read_announced_identities
from ._fuse_stall import FuseStall
from ._mpi_env import PRTE_TMPDIR_VAR, configure_mpi_env, remove_private_prte_tmpdir
from ._scenario_records import (
    FAULTS,
    ControlOutcome,
    Detection,
    EndingOutcome,
    EventRecord,
    HealthProbeOutcome,
    InitOutcome,
    ScenarioOptions,
    ScenarioResult,
    ScenarioRun,
    ShutdownOutcome,
    StopReportRecord,
    Victim,
    WatcherFaultOutcome,
)

__all__ = ["FAULTS", "FREEZER_ROOT", "ScenarioOptions", "ScenarioResult", "ScenarioRun", "kill_session",
           "run_scenario", "session_members"]

LIVENESS_ENV_VAR = "TRTLLM_WORKER_LIVENESS"
_SIGNALS = {"kill": signal.SIGKILL, "segv": signal.SIGSEGV, "stop": signal.SIGSTOP}


def _emit(record: Mapping[str, Any]) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def liveness_env(opts: ScenarioOptions) -> str:
    """The ``TRTLLM_WORKER_LIVENESS`` value that configures the extension as ``opts`` asks."""
    settings: dict[str, Any] = {
        "d_state_timeout_s": opts.d_state_timeout_s, "scan_interval_s": opts.scan_interval_s,
        "shutdown_grace_s": opts.shutdown_grace_s, "shutdown_term_s": opts.shutdown_term_s,
        "shutdown_kill_s": opts.shutdown_kill_s,
    }
    if opts.exit_on_fatal:
        settings.update(exit_on_fatal=1, exit_code=opts.exit_code, exit_timeout_s=opts.exit_timeout_s)
    return ",".join(f"{key}={value}" for key, value in settings.items())


@dataclass
class _Draft:
    """What one iteration has found so far; frozen into a :class:`ScenarioResult` at its end."""

    phase: str
    proxy_class: str | None = None
    ready_ms: float | None = None
    pids: list[int] = field(default_factory=list)
    victims: list[Victim] = field(default_factory=list)
    in_flight: int | None = None
    tokens_ok: bool | None = None
    fault_at: float | None = None
    events: list[EventRecord] = field(default_factory=list)
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
    survivors: list[int] = field(default_factory=list)
    survivors_while_frozen: list[int] = field(default_factory=list)
    oom_kills: int | None = None
    freezer_path: str | None = None
    memory_cgroup_path: str | None = None
    critical_logs: list[str] = field(default_factory=list)
    thread_exceptions: list[str] = field(default_factory=list)

    def record_fatal(self, proxy: Any, fatal: Any) -> None:
        """The executor's events and fatal error, as they stand."""
        self.events = [EventRecord.from_dict(event.to_dict()) for event in getattr(proxy, "liveness_events", [])]
        self.fatal_error = None if fatal is None else str(fatal)
        self.fatal_error_type = None if fatal is None else type(fatal).__name__

    def freeze(self, opts: ScenarioOptions, iteration: int) -> ScenarioResult:
        return ScenarioResult(
            iteration=iteration, options=opts, phase=self.phase, proxy_class=self.proxy_class,
            ready_ms=self.ready_ms, pids=tuple(self.pids), victims=tuple(self.victims), in_flight=self.in_flight,
            tokens_ok=self.tokens_ok, fault_at=self.fault_at, events=tuple(self.events),
            fatal_error=self.fatal_error, fatal_error_type=self.fatal_error_type,
            pending_not_done=self.pending_not_done, detection=self.detection, shutdown=self.shutdown,
            init=self.init, control=self.control, health_probe=self.health_probe, watcher=self.watcher,
            ending=self.ending, survivors=tuple(self.survivors),
            survivors_while_frozen=tuple(self.survivors_while_frozen), oom_kills=self.oom_kills,
            freezer_path=self.freezer_path, memory_cgroup_path=self.memory_cgroup_path,
            critical_logs=tuple(self.critical_logs), thread_exceptions=tuple(self.thread_exceptions),
        )


def _victims(opts: ScenarioOptions, identities: list[ProcessIdentity]) -> list[ProcessIdentity]:
    return [identities[rank] for rank in (opts.fault_ranks or (opts.fault_rank,))]


# The floor's timer: a bare process blocked in poll() on the victim's pidfd (inherited), printing
# time.monotonic() (system-wide) when it turns readable. A process of its own, not a thread here:
# a thread would wait for the GIL behind the very watcher it is the baseline for (up to the 5 ms
# switch interval), and measure the scenario's scheduling instead of the kernel's.
_FLOOR_TIMER = (
    "import select, sys, time\n"
    "fd, timeout_ms = int(sys.argv[1]), int(sys.argv[2])\n"
    "poller = select.poll()\n"
    "poller.register(fd, select.POLLIN)\n"
    "print('armed', flush=True)\n"
    "ready = poller.poll(timeout_ms)\n"
    "print(repr(time.monotonic()) if ready else 'none', flush=True)\n"
)


class _PidfdFloor:
    """The kernel's floor on one kill: signal -> a bare pidfd on the victim readable, timed by a
    separate process blocked in ``poll()`` on it (see ``_FLOOR_TIMER``). The pidfd is the one the
    harness opened and verified against the start time just before the signal, so it times the
    very kill the package is detecting. Every wait is bounded; :meth:`close` is idempotent."""

    def __init__(self, pidfd: int, timeout_s: float = 10.0) -> None:
        import subprocess

        self._proc = subprocess.Popen(
            [sys.executable, "-S", "-c", _FLOOR_TIMER, str(pidfd), str(int(timeout_s * 1000))],
            pass_fds=(pidfd,), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
        self.armed = self._line(5.0) == "armed"

    def _line(self, timeout: float) -> str | None:
        assert self._proc.stdout is not None
        ready, _, _ = select.select([self._proc.stdout], [], [], timeout)
        return self._proc.stdout.readline().decode().strip() if ready else None

    def elapsed_ms(self, t0: float, timeout: float = 2.0) -> float | None:
        """Signal (``t0``) -> readable in ms, waiting up to ``timeout``; None if it never became so."""
        try:
            line = self._line(timeout) if self.armed else None
            return round((float(line) - t0) * 1e3, 3) if line and line != "none" else None
        except ValueError:
            return None
        finally:
            self.close()

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
        with contextlib.suppress(Exception):
            self._proc.wait(5)
        if self._proc.stdout is not None:
            self._proc.stdout.close()


def _inject(opts: ScenarioOptions, victims: list[ProcessIdentity], freezer: FreezerGroup | None,
            announce: str) -> tuple[float, _PidfdFloor | None]:
    """Inject the fault; returns its time (``time.monotonic()``, system-wide) and, for the signals
    that end a process, the floor timer on the first victim."""
    if opts.fault == "wedge":
        assert freezer is not None
        t0 = time.monotonic()
        freezer.freeze([v.pid for v in victims])
        return t0, None
    if opts.fault in ("exit0", "oom", "fuse"):
        # The victim rank itself does it (see _executor_worker._arm_fault) and records when.
        record = os.path.join(announce, "fault.json")
        with open(os.path.join(announce, "trigger"), "w"):
            pass
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError), open(record) as handle:
                return float(json.load(handle)["at"]), None
            time.sleep(0.001)
        raise TimeoutError("the fault-injection hook did not fire within 10 s")
    fds: list[int] = []
    try:
        for victim in victims:  # opened and verified first: never a recycled pid
            fds.append(_pidfd.open_verified_pidfd(victim.pid, victim.start_time))
        floor = _PidfdFloor(fds[0]) if opts.fault in ("kill", "segv") else None
        t0 = time.monotonic()
        for fd in fds:
            _pidfd.send_signal(fd, _SIGNALS[opts.fault])
        return t0, floor
    finally:
        for fd in fds:
            os.close(fd)


def _build(opts: ScenarioOptions, worker_kwargs: dict[str, Any]) -> Any:
    """The executor: the reference proxy (``via="class"``), else upstream's ``create()`` of the
    ``tensorrt_llm`` on ``sys.path`` (the upstream-shaped test fakes), given a ``FakeEngine``."""
    if opts.via == "class":
        return _proxy_class(opts)(worker_kwargs, model_world_size=opts.workers)
    import importlib

    if opts.via == "autoload":
        importlib.import_module("trtllm_liveness.integrations.trtllm_autoload")
    from tensorrt_llm.executor.executor import GenerationExecutor  # the test fakes

    executor_cls: Any = GenerationExecutor
    if opts.via == "executor_cls":
        from ..integrations.trtllm import liveness_executor_class

        executor_cls = liveness_executor_class(GenerationExecutor)
    # The fakes' shared module, on sys.path once their tensorrt_llm is imported.
    engine = importlib.import_module("_trtllm_fake_common").FakeEngine(
        token_delay_s=opts.token_delay_s, init_delay_s=opts.init_delay_s,
        announce_dir=worker_kwargs["announce_dir"], fault=worker_kwargs.get("fault"))
    return executor_cls.create(engine, model_world_size=opts.workers)


def _upstream_api(opts: ScenarioOptions) -> bool:
    """Whether the executor is upstream-shaped (the fakes' API) rather than the reference's."""
    return opts.via != "class"


class _UpstreamRequest:
    """A request on an upstream-shaped executor, seen through the reference result's surface
    (``started``, ``done``, ``tokens``, ``error``, ``finished_at``, ``wait``, ``result``).

    Upstream's ``GenerationResult`` advances only while its consumer reads it, so a daemon thread
    reads it here (each read bounded), until it finishes, fails, or ``stop`` is set (the end of
    the iteration: a request of a dead engine without liveness never finishes).
    """

    def __init__(self, result: Any, stop: threading.Event) -> None:
        self._result = result
        self._stop = stop
        self.tokens: list[int] = []
        self.error: BaseException | None = None
        self.finished_at: float | None = None
        self.started = threading.Event()
        self._event = threading.Event()
        self._last_delivery: float | None = None
        self._time_deliveries(getattr(result, "queue", None))
        threading.Thread(target=self._read, name="scenario-request", daemon=True).start()

    def _time_deliveries(self, item_queue: Any) -> None:
        # finished_at is when the final item (the last token, or the engine's error) was put into
        # the request's queue, by whichever thread put it: what the reference's results record
        # (they are completed where they are failed). When this harness thread then gets the GIL
        # to read it is the harness's cost, not the engine's.
        put = getattr(item_queue, "put", None)
        if not callable(put):
            return

        def timed_put(item: Any, *args: Any, **kwargs: Any) -> Any:
            self._last_delivery = time.monotonic()
            return put(item, *args, **kwargs)

        item_queue.put = timed_put

    @property
    def done(self) -> bool:
        return self._event.is_set()

    def _read(self) -> None:
        import queue

        while not self._result.finished and not self._stop.is_set():
            try:
                self._result._result_step(0.1)
            except queue.Empty:
                continue
            except BaseException as exc:  # the engine's error for this request (EngineDeadError, ...)
                self.error = exc
                break
            self.tokens = list(self._result.token_ids)
            self.started.set()
        if self.error is None and not self._result.finished:
            return  # stopped, not finished: stays pending
        self.finished_at = self._last_delivery if self._last_delivery is not None else time.monotonic()
        self._event.set()

    def wait(self, timeout: float) -> bool:
        return self._event.wait(timeout)

    def result(self, timeout: float) -> list[int]:
        if not self._event.wait(timeout):
            raise TimeoutError(f"request {self._result.request_id} not finished after {timeout}s")
        if self.error is not None:
            raise self.error
        return list(self.tokens)


def _submit(opts: ScenarioOptions, proxy: Any, prompt: int, stop: threading.Event) -> Any:
    """One request of ``opts.tokens`` tokens; the reference echoes its prompt, upstream's API
    takes ``max_tokens``."""
    if not _upstream_api(opts):
        return proxy.generate_async([prompt] * opts.tokens)
    return _UpstreamRequest(proxy.generate_async([prompt] * 4, max_tokens=opts.tokens, streaming=True), stop)


def _expected_tokens(opts: ScenarioOptions, prompt: int) -> list[int]:
    """What a healthy engine answers to :func:`_submit`: the reference echoes the prompt, the
    fakes' engine counts 1..n."""
    return list(range(1, opts.tokens + 1)) if _upstream_api(opts) else [prompt] * opts.tokens


def _pre_shutdown_runs(proxy: Any) -> int | None:
    """How often upstream's ``pre_shutdown()`` did its work (the reference's counter, or the
    fakes' instrumentation of it)."""
    for name in ("pre_shutdown_runs", "_fake_pre_shutdown_runs"):
        value = getattr(proxy, name, None)
        if isinstance(value, int):
            return value
    return None


def _bounded(action: Any, timeout: float = 5.0) -> None:
    """Run a harness clean-up step (``action()``) in a daemon thread, waiting at most ``timeout``:
    upstream's session and queue shutdowns wait without a bound on a dead world."""
    def run() -> None:
        with contextlib.suppress(Exception):
            action()

    thread = threading.Thread(target=run, name="scenario-cleanup", daemon=True)
    thread.start()
    thread.join(timeout)


def _proxy_class(opts: ScenarioOptions) -> type:
    from ._executor_proxy import PROXY_CLASSES

    base = PROXY_CLASSES[opts.mode]
    if not opts.liveness:
        return base
    from ..integrations.trtllm import liveness_proxy_class

    return liveness_proxy_class(base, default_enabled=True)


def _health(proxy: Any, probe: str) -> bool:
    if probe == "fatal_error":
        return getattr(proxy, "_fatal_error", None) is None
    check = getattr(proxy, "check_health", None)
    return bool(check()) if callable(check) else not proxy.is_shutdown()


class _CriticalLog(logging.Handler):
    """Collects CRITICAL records of the package (the watcher's death is logged so)."""

    def __init__(self) -> None:
        super().__init__(logging.CRITICAL)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


class _ThreadExceptions:
    """Records exceptions that end threads (mpi4py's manager thread, ours), then lets the previous
    hook print them as usual."""

    def __init__(self) -> None:
        self.messages: list[str] = []
        self.times: list[float] = []  # time.monotonic() of each
        self._previous = threading.excepthook

    def __enter__(self) -> _ThreadExceptions:
        threading.excepthook = self._hook
        return self

    def __exit__(self, *exc: object) -> None:
        threading.excepthook = self._previous

    def _hook(self, args: threading.ExceptHookArgs) -> None:
        name = args.thread.name if args.thread is not None else "?"
        self.times.append(time.monotonic())
        self.messages.append(f"{name}: {args.exc_type.__name__}: {args.exc_value}")
        self._previous(args)


class _Sigints:
    """Counts SIGINTs as a server's handler would (uvicorn's sets ``should_exit``), instead of
    raising KeyboardInterrupt wherever the main thread happens to be."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.received = threading.Event()

    def install(self) -> None:
        signal.signal(signal.SIGINT, self._handler)

    def _handler(self, signum: int, frame: object) -> None:
        self.times.append(time.monotonic())
        self.received.set()


_SIGINTS = _Sigints()


class _AtExitReport:
    """For ``ending="interpreter_exit"``: prints the iteration's record when the interpreter ends.

    Registered before the executor is built: ``atexit`` runs hooks last-in first-out, so this one
    sees the state after upstream's exit hooks (``threading._register_atexit`` ones run even before).
    """

    def __init__(self, opts: ScenarioOptions) -> None:
        self.opts = opts
        self.draft: _Draft | None = None
        self.proxy: Any = None
        atexit.register(self.report)

    def report(self) -> None:
        if self.draft is None:
            return
        fatal = getattr(self.proxy, "_fatal_error", None)
        self.draft.record_fatal(self.proxy, fatal)
        self.draft.ending = EndingOutcome(ending=self.opts.ending, sigints=len(_SIGINTS.times), at_exit=True)
        self.draft.survivors = []  # the ranks may still be on their way out: the parent checks the session
        pidfds, fds = _open_fds(settle_s=0.5)
        _emit(dataclasses.replace(self.draft.freeze(self.opts, 0), pidfds_open=pidfds, fds_open=fds).to_dict())
        _emit({"done": True})


def run_once(opts: ScenarioOptions, iteration: int, at_exit: _AtExitReport | None = None) -> ScenarioResult | None:
    """One iteration; None for ``ending="interpreter_exit"`` (``at_exit`` reports it later)."""
    draft = _Draft(phase=opts.fault_phase)
    with _ThreadExceptions() as thread_exceptions:
        _run_once(opts, iteration, thread_exceptions, draft, at_exit)
    draft.thread_exceptions = thread_exceptions.messages
    if at_exit is not None:
        return None
    return draft.freeze(opts, iteration)


def _run_once(opts: ScenarioOptions, iteration: int, thread_exceptions: _ThreadExceptions, draft: _Draft,
              at_exit: _AtExitReport | None) -> None:
    announce = tempfile.mkdtemp(prefix="trtllm-scenario-")
    worker_kwargs: dict[str, Any] = {"token_delay_s": opts.token_delay_s, "init_delay_s": opts.init_delay_s,
                                     "announce_dir": announce}
    freezer = FreezerGroup(opts.cgroup_prefix) if opts.fault == "wedge" else None
    if freezer is not None:
        draft.freezer_path = freezer.path
    memory = MemoryGroup(opts.oom_limit_mb << 20, opts.cgroup_prefix) if opts.fault == "oom" else None
    if memory is not None:
        draft.memory_cgroup_path = memory.path
    stall = FuseStall().__enter__() if opts.fault == "fuse" else None
    if opts.fault in ("exit0", "oom", "fuse"):
        worker_kwargs["fault"] = {"kind": opts.fault, "rank": opts.fault_rank,
                                  "trigger": os.path.join(announce, "trigger"),
                                  "record": os.path.join(announce, "fault.json"),
                                  "cgroup": None if memory is None else memory.path,
                                  "path": None if stall is None else stall.new_path()}
    identities: list[ProcessIdentity] = []
    critical = _CriticalLog()
    logging.getLogger("trtllm_liveness").addHandler(critical)
    stop_reading = threading.Event()  # ends the readers of upstream-shaped requests (_UpstreamRequest)
    try:
        t_start = time.monotonic()
        if opts.fault == "spawn":
            _run_spawn_failure(opts, worker_kwargs, draft, thread_exceptions)
            return
        if opts.fault_phase == "init":
            _run_init_fault(opts, worker_kwargs, announce, freezer, draft, identities, iteration)
            return
        if opts.fault_phase == "shutdown" and opts.fault not in ("kill", "segv"):
            raise ValueError("fault_phase 'shutdown' takes a signal fault (kill, segv)")
        proxy = _build(opts, worker_kwargs)
        if at_exit is not None:
            at_exit.draft, at_exit.proxy = draft, proxy
        draft.proxy_class = type(proxy).__name__
        draft.ready_ms = (time.monotonic() - t_start) * 1e3
        identities.extend(read_announced_identities(announce, opts.workers, 10))
        draft.pids = [identity.pid for identity in identities]
        _emit({"pids": draft.pids, "iteration": iteration})
        results = [_submit(opts, proxy, rank, stop_reading) for rank in range(opts.requests)]
        for result in results:
            result.started.wait(10)
        draft.in_flight = sum(1 for result in results if result.started.is_set() and not result.done)
        if opts.fault == "none" and opts.control_s > 0:
            _control(opts, proxy, results, draft, stop_reading)
        elif opts.fault == "none":
            draft.tokens_ok = all(r.result(30) == _expected_tokens(opts, i) for i, r in enumerate(results))
            draft.pending_not_done = sum(1 for r in results if not r.done)
            if opts.ending == "interpreter_exit":
                return  # the script just ends: no shutdown(), the record comes from the atexit hook
        elif opts.fault_phase == "shutdown":
            _run_shutdown_fault(opts, proxy, identities, announce, draft)
            return
        else:
            victims = _victims(opts, identities)
            draft.victims = [Victim(v.rank, v.pid) for v in victims]
            if opts.watcher_fault:
                draft.watcher = _kill_watcher(proxy)
            hammer = _HealthHammer(proxy, opts.health_probe, opts.health_threads) if opts.health_threads else None
            try:
                t0, floor = _inject(opts, victims, freezer, announce)
                draft.fault_at = t0
                _emit({"fault_at": t0, "iteration": iteration})
                _observe(opts, proxy, results, t0, floor, draft)
                # Before anything that may end the process (the harness's kill of the ranks after a
                # wedge or stop without liveness can make MPI abort it): what was seen, for the demo.
                _emit({"observed": {"pending_not_done": draft.pending_not_done, "in_flight": draft.in_flight,
                                    "health_false_ms": None if draft.detection is None
                                    else draft.detection.health_false_ms}, "iteration": iteration})
            finally:
                if hammer is not None:
                    draft.health_probe = hammer.finish()
            if opts.ending == "serve_until_sigint":
                _serve_until_sigint(opts, draft, t0)
        _finish(opts, proxy, identities, draft)
        if draft.ending is not None and _SIGINTS.times:
            draft.ending = dataclasses.replace(
                draft.ending, graceful_ms=round((time.monotonic() - _SIGINTS.times[0]) * 1e3, 3))
    finally:
        stop_reading.set()
        logging.getLogger("trtllm_liveness").removeHandler(critical)
        draft.critical_logs = critical.messages
        if memory is not None:
            draft.oom_kills = memory.oom_kills()
            memory.remove()
        released = False
        if freezer is not None:
            freezer.remove()
            released = True
        if stall is not None:
            stall.release()
            released = True
        if released and draft.survivors:
            # An unkillable (frozen or FUSE-stuck) rank dies as soon as it is released: wait for that.
            draft.survivors_while_frozen = frozen = draft.survivors
            deadline = time.monotonic() + 5
            left = [i for i in identities if i.pid in frozen]
            while left and time.monotonic() < deadline:
                time.sleep(0.01)
                left = [i for i in left if _alive(i)]
            draft.survivors = [i.pid for i in left]
        shutil.rmtree(announce, ignore_errors=True)


def _serve_until_sigint(opts: ScenarioOptions, draft: _Draft, t0: float) -> None:
    """A server after the fault: wait (up to ``observe_s`` after it) for the graceful-shutdown
    SIGINT; the caller then shuts down, as uvicorn's return makes trtllm-serve do."""
    _SIGINTS.received.wait(max(0.0, t0 + opts.observe_s - time.monotonic()))
    first = _SIGINTS.times[0] if _SIGINTS.times else None
    draft.ending = EndingOutcome(ending=opts.ending, sigints=len(_SIGINTS.times),
                                 sigint_ms=None if first is None else round((first - t0) * 1e3, 3))


def _kill_watcher(proxy: Any) -> WatcherFaultOutcome:
    """Make the monitor's watcher thread die (a tick raises once), as a bug or resource error would."""
    monitor = proxy.liveness_monitor if hasattr(proxy, "liveness_monitor") else proxy._liveness_monitor

    def broken_tick(*args: Any) -> None:
        del monitor._watch_handle  # raise once; the class's method is back for anyone else
        raise RuntimeError("injected watcher failure")

    monitor._watch_handle = broken_tick
    monitor._watcher.wake()
    deadline = time.monotonic() + 10
    while monitor.watcher_alive and time.monotonic() < deadline:
        time.sleep(0.005)
    return WatcherFaultOutcome(alive_at_fault=bool(monitor.watcher_alive), error=repr(monitor.watcher_error))


def _control(opts: ScenarioOptions, proxy: Any, results: list[Any], draft: _Draft, stop: threading.Event) -> None:
    """No fault: keep ``requests`` requests in flight for ``control_s`` seconds; count alarms."""
    deadline = time.monotonic() + opts.control_s
    active = list(results)
    prompts = list(range(len(results)))
    completed = errors = wrong = health_false = 0
    checks = 0
    while time.monotonic() < deadline:
        checks += 1
        if not _health(proxy, opts.health_probe):
            health_false += 1
        for index, result in enumerate(active):
            if not result.done:
                continue
            if result.error is not None:
                errors += 1
            elif result.tokens != _expected_tokens(opts, prompts[index]):
                wrong += 1
            completed += 1
            prompts[index] = completed % 1000
            active[index] = _submit(opts, proxy, prompts[index], stop)
        time.sleep(0.005)
    for result in active:
        result.wait(30)
    fatal = getattr(proxy, "_fatal_error", None)
    draft.record_fatal(proxy, fatal)
    draft.pending_not_done = sum(1 for r in active if not r.done)
    draft.control = ControlOutcome(
        control_s=opts.control_s, requests_completed=completed, request_errors=errors, wrong_tokens=wrong,
        health_checks=checks, health_false=health_false,
        alarms=health_false + len(draft.events) + (fatal is not None) + errors)


def _stop_report(proxy: Any) -> StopReportRecord | None:
    report = getattr(proxy, "liveness_shutdown_report", None)
    return None if report is None else StopReportRecord.from_dict(report.to_dict())


def _run_shutdown_fault(opts: ScenarioOptions, proxy: Any, identities: list[ProcessIdentity], announce: str,
                        draft: _Draft) -> None:
    """Kill ``fault_rank`` while ``shutdown()`` runs: shutdown must stay bounded and account for it."""
    victims = _victims(opts, identities)
    draft.victims = [Victim(v.rank, v.pid) for v in victims]
    done = threading.Event()

    def shut() -> None:
        try:
            proxy.shutdown()
        finally:
            done.set()

    t_start = time.monotonic()
    threading.Thread(target=shut, name="scenario-shutdown", daemon=True).start()
    with contextlib.suppress(Exception):  # the rank may already be gone: that is the race
        draft.fault_at, floor = _inject(opts, victims, None, announce)
        if floor is not None:
            floor.close()
    finished = done.wait(opts.observe_s)
    report = _stop_report(proxy)
    draft.shutdown = ShutdownOutcome(
        shutdown_ms=round((time.monotonic() - t_start) * 1e3, 3) if finished else None, hung=not finished,
        pre_shutdown_runs=_pre_shutdown_runs(proxy), report=report,
        unkillable=() if report is None else tuple(u.pid for u in report.unkillable))
    fatal = _settled_fatal_error(proxy) if getattr(proxy, "liveness_events", []) else getattr(
        proxy, "_fatal_error", None)
    draft.record_fatal(proxy, fatal)
    if not finished or os.path.isdir(getattr(proxy, "_ipc_dir", "")):
        stop_processes(identities, grace_s=0.0, kill_s=2.0)
        _bounded(proxy._close_queues)
    draft.survivors = [i.pid for i in identities if _alive(i)]


class _HealthHammer:
    """``n`` threads calling ``check_health()`` in a loop, recording (called, returned, answer)."""

    def __init__(self, proxy: Any, probe: str, n: int) -> None:
        self.stop = threading.Event()
        self.calls: list[list[tuple[float, float, bool]]] = [[] for _ in range(n)]
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._loop, args=(proxy, probe, self.calls[i]),
                                         name=f"scenario-health-{i}", daemon=True) for i in range(n)]
        for thread in self.threads:
            thread.start()

    def _loop(self, proxy: Any, probe: str, calls: list[tuple[float, float, bool]]) -> None:
        while not self.stop.is_set():
            t_call = time.monotonic()
            try:
                answer = _health(proxy, probe)
            except Exception as exc:
                self.errors.append(repr(exc))
                return
            calls.append((t_call, time.monotonic(), answer))
            time.sleep(0.0002)

    def finish(self, linger_s: float = 0.3) -> HealthProbeOutcome:
        self.stop.wait(linger_s)  # keep asking for a moment after the fault was handled
        self.stop.set()
        for thread in self.threads:
            thread.join(5)
        flat = [call for calls in self.calls for call in calls]
        first_false = min((returned for _, returned, answer in flat if not answer), default=None)
        # A True answer to a call that began after the first False had been returned is inconsistent.
        late_true = 0 if first_false is None else sum(
            1 for called, _, answer in flat if answer and called > first_false)
        flips = sum(1 for calls in self.calls for a, b in itertools.pairwise(calls) if not a[2] and b[2])
        return HealthProbeOutcome(
            threads=len(self.threads), calls=len(flat), false_answers=sum(1 for *_, answer in flat if not answer),
            inconsistent=late_true + flips, errors=tuple(self.errors),
            threads_alive=sum(1 for t in self.threads if t.is_alive()))


def _settled_fatal_error(proxy: Any, timeout: float = 2.0) -> Any:
    """The executor's recorded fatal error, waiting (bounded) for it to be published.

    The liveness extension turns ``check_health()`` False at once but may publish ``_fatal_error``
    a few milliseconds later (after its fatal path's other steps), so a reader that just saw
    health turn False may be early.
    """
    deadline = time.monotonic() + timeout
    fatal = getattr(proxy, "_fatal_error", None)
    while fatal is None and time.monotonic() < deadline:
        time.sleep(0.001)
        fatal = getattr(proxy, "_fatal_error", None)
    return fatal


def _observe(opts: ScenarioOptions, proxy: Any, results: list[Any], t0: float, floor: _PidfdFloor | None,
             draft: _Draft) -> None:
    deadline = t0 + opts.observe_s
    health_false = failed_all = stalled = None
    last_progress = t0
    last_tokens = sum(len(r.tokens) for r in results)
    while time.monotonic() < deadline:
        now = time.monotonic()
        if health_false is None and not _health(proxy, opts.health_probe):
            health_false = now
        if failed_all is None and all(r.done and r.error is not None for r in results):
            failed_all = max(r.finished_at for r in results)
        tokens = sum(len(r.tokens) for r in results)
        if tokens != last_tokens:
            last_tokens, last_progress = tokens, now
        elif stalled is None and now - last_progress >= opts.stall_timeout_s and not all(r.done for r in results):
            stalled = now
        if health_false is not None and failed_all is not None:
            break
        if opts.fault == "stop" and stalled is not None:
            break
        time.sleep(0.0005)
    events = list(getattr(proxy, "liveness_events", []))

    def ms(value: float | None) -> float | None:
        return None if value is None else round((value - t0) * 1e3, 3)

    new_request_error = None
    if health_false is not None:
        try:
            proxy.generate_async([1, 2, 3])
        except Exception as exc:
            new_request_error = type(exc).__name__
    draft.detection = Detection(
        detected_ms=ms(events[0].detected_at) if events else None, health_false_ms=ms(health_false),
        requests_failed_ms=ms(failed_all),
        e2e_ms=ms(max(health_false, failed_all)) if health_false and failed_all else None,
        stall_detected_ms=ms(stalled), floor_ms=None if floor is None else floor.elapsed_ms(t0),
        pending_errors=tuple(sorted({type(r.error).__name__ for r in results if r.error is not None})),
        new_request_error=new_request_error, window_s=opts.observe_s)
    fatal = _settled_fatal_error(proxy) if health_false is not None else getattr(proxy, "_fatal_error", None)
    draft.record_fatal(proxy, fatal)
    draft.pending_not_done = sum(1 for r in results if not r.done)


def _finish(opts: ScenarioOptions, proxy: Any, identities: list[ProcessIdentity], draft: _Draft) -> None:
    if opts.liveness or opts.fault == "none":
        t = time.monotonic()
        proxy.shutdown()
        shutdown_ms = round((time.monotonic() - t) * 1e3, 3)
        report = _stop_report(proxy)
        fatal = getattr(proxy, "liveness_fatal_error", None)
        draft.shutdown = ShutdownOutcome(
            shutdown_ms=shutdown_ms, pre_shutdown_calls=getattr(proxy, "liveness_pre_shutdown_calls", None),
            pre_shutdown_runs=_pre_shutdown_runs(proxy), report=report,
            unkillable=() if report is None else tuple(u.pid for u in report.unkillable),
            restartable=None if report is None else report.restartable,
            fatal_restartable=None if fatal is None else fatal.restartable)
        if os.path.isdir(getattr(proxy, "_ipc_dir", "")):  # upstream's shutdown was abandoned
            with contextlib.suppress(Exception):
                proxy._close_queues()
    else:
        # The executor would wait forever: the harness ends the hang itself.
        stop_processes(identities, grace_s=0.0, kill_s=2.0)
        _bounded(proxy.mpi_session.shutdown)
        if not _upstream_api(opts):
            # Upstream's queues are not closed here: its dispatch thread is still inside a receive on
            # one (ZMQ sockets are not thread-safe); the scenario process ends with os._exit anyway.
            _bounded(proxy._close_queues)
        draft.shutdown = ShutdownOutcome(shutdown_ms=None, by_harness=True)
    draft.survivors = [i.pid for i in identities if _alive(i)]


def _alive(identity: ProcessIdentity) -> bool:
    try:
        _pidfd.verify_start_time(identity.pid, identity.start_time)
    except Exception:
        return False
    return True


@dataclass
class _Build:
    """A build in a daemon thread: ``proxy``, or ``error`` and ``at`` (``time.monotonic()`` of the raise)."""

    thread: threading.Thread | None = None
    proxy: Any = None
    error: BaseException | None = None
    at: float | None = None


def _build_in_thread(opts: ScenarioOptions, worker_kwargs: dict[str, Any]) -> _Build:
    """Start building the executor in a daemon thread (construction blocks until READY, or forever)."""
    holder = _Build()

    def build() -> None:
        try:
            holder.proxy = _build(opts, worker_kwargs)
        except BaseException as exc:
            holder.error = exc
            holder.at = time.monotonic()

    holder.thread = threading.Thread(target=build, name="scenario-build", daemon=True)
    holder.thread.start()
    return holder


def _run_init_fault(opts: ScenarioOptions, worker_kwargs: dict[str, Any], announce: str,
                    freezer: FreezerGroup | None, draft: _Draft, identities: list[ProcessIdentity],
                    iteration: int) -> None:
    build = _build_in_thread(opts, worker_kwargs)
    assert build.thread is not None
    identities.extend(read_announced_identities(announce, opts.workers, 10))
    draft.pids = [i.pid for i in identities]
    _emit({"pids": draft.pids, "iteration": iteration})
    time.sleep(min(0.2, opts.init_delay_s / 4))
    victims = _victims(opts, identities)
    draft.victims = [Victim(v.rank, v.pid) for v in victims]
    t0, floor = _inject(opts, victims, freezer, announce)
    draft.fault_at = t0
    if floor is not None:
        floor.close()
    build.thread.join(opts.observe_s)
    hung = build.thread.is_alive()
    error = build.error
    draft.init = InitOutcome(
        hung=hung, error_ms=None if hung else round((time.monotonic() - t0) * 1e3, 3),
        error_type=None if error is None else type(error).__name__, error=None if error is None else str(error),
        restartable=getattr(error, "restartable", None))
    if hung or build.proxy is not None:
        stop_processes(identities, grace_s=0.0, kill_s=2.0)
    draft.survivors = [i.pid for i in identities if _alive(i)]


def _run_spawn_failure(opts: ScenarioOptions, worker_kwargs: dict[str, Any], draft: _Draft,
                       thread_exceptions: _ThreadExceptions) -> None:
    """Build while MPI_Comm_spawn fails (``main`` made PRRTE's session base unusable). The
    latency is from the death of mpi4py's manager thread to the constructor's error."""
    draft.phase = "init"
    build = _build_in_thread(opts, worker_kwargs)
    assert build.thread is not None
    build.thread.join(opts.observe_s)
    error = build.error
    spawn_died = next((t for t, m in zip(thread_exceptions.times, thread_exceptions.messages, strict=True)
                       if "MPI_ERR" in m), None)
    draft.init = InitOutcome(
        hung=build.thread.is_alive(),
        error_ms=None if build.at is None or spawn_died is None else round((build.at - spawn_died) * 1e3, 3),
        error_type=None if error is None else type(error).__name__, error=None if error is None else str(error),
        spawn_failed=spawn_died is not None)
    draft.survivors = []  # no rank was ever started


def _open_fds(settle_s: float = 2.0) -> tuple[int, int]:
    """(pidfds, all fds) this process holds; waits up to ``settle_s`` for pidfds a leaving
    watcher thread releases on its way out."""
    deadline = time.monotonic() + settle_s
    while True:
        gc.collect()
        links = []
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                links.append(os.readlink(f"/proc/self/fd/{name}"))
        pidfds = sum(1 for link in links if link == "anon_inode:[pidfd]")
        if pidfds == 0 or time.monotonic() >= deadline:
            return pidfds, len(links)
        time.sleep(0.02)


def main(argv: list[str]) -> None:
    options = ScenarioOptions.from_dict(json.loads(argv[0])) if argv else ScenarioOptions()
    blocker = None
    if options.fault == "spawn":
        # PRRTE cannot make prte.<pid>/ under a regular file: the spawn fails for real.
        fd, blocker = tempfile.mkstemp(prefix="trtllm-scenario-not-a-dir-")
        os.close(fd)
        os.environ[PRTE_TMPDIR_VAR] = blocker
    if options.liveness:  # what a server is configured with (trtllm-serve has no code hook)
        os.environ[LIVENESS_ENV_VAR] = liveness_env(options)
    configure_mpi_env()
    if options.ending == "serve_until_sigint":
        _SIGINTS.install()
    at_exit = _AtExitReport(options) if options.ending == "interpreter_exit" else None
    code = 0
    try:
        for iteration in range(options.iterations):
            record = run_once(options, iteration, at_exit)
            if record is not None:
                pidfds, fds = _open_fds()
                _emit(dataclasses.replace(record, pidfds_open=pidfds, fds_open=fds).to_dict())
        if at_exit is None:
            _emit({"done": True})
    except BaseException:
        _emit({"error": traceback.format_exc()})
        code = 1
        if at_exit is not None:
            at_exit.draft = None
    if blocker is not None:
        os.unlink(blocker)
    sys.stdout.flush()
    sys.stderr.flush()
    if options.ending != "shutdown":
        # The point of these endings: a real interpreter exit, with every atexit hook (upstream's,
        # the exit guard's, the PRRTE base's removal). The exit guard's watchdog bounds it when
        # exit_on_fatal is on; the parent's outer timeout otherwise.
        sys.exit(code)
    remove_private_prte_tmpdir()  # os._exit skips the atexit removal
    os._exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])


# ------------------------------------------------------------------- parent side (demo, bench, tests)


def session_members(sid: int) -> list[int]:
    """PIDs whose session id is ``sid`` (the scenario child's session: it, prte and the workers)."""
    members = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as handle:
                data = handle.read()
        except OSError:
            continue
        fields = data[data.rfind(b")") + 2:].split()
        if len(fields) > 3 and int(fields[3]) == sid and fields[0] not in (b"Z", b"X"):
            members.append(int(name))
    return members


def kill_session(sid: int, timeout: float = 5.0) -> list[int]:
    """SIGKILL every live member of session ``sid`` (verified through a pidfd); return survivors.

    Only for a session this process created (``start_new_session=True``): its members are ours.
    """
    deadline = time.monotonic() + timeout
    while True:
        members = session_members(sid)
        if not members or time.monotonic() > deadline:
            return members
        for pid in members:
            with contextlib.suppress(Exception):
                fd = _pidfd.open_pidfd(pid)
                try:
                    # Verified after opening: the pid may have been recycled since the listing,
                    # and only a process still in this session is ours to kill.
                    info = _procfs.read_stat(pid)
                    if info.session == sid and info.state not in ("Z", "X"):
                        _pidfd.send_signal(fd, signal.SIGKILL)
                finally:
                    os.close(fd)
        time.sleep(0.05)


@dataclass
class _ChildOutput:
    lines: list[dict[str, Any]]
    stderr: str
    survivors: list[int]
    returncode: int | None
    exited_at: float | None
    timed_out: bool


class _ExitWatch:
    """When a process exits, seen through a pidfd in a thread of its own (without reaping it:
    ``Popen`` still does). ``communicate()`` alone would wait for the ranks too, which share its
    stdout."""

    def __init__(self, pid: int) -> None:
        self.exited_at: float | None = None
        self._stop = threading.Event()
        try:
            self._fd: int | None = _pidfd.open_pidfd(pid)
        except Exception:
            self._fd = None
        self._thread = threading.Thread(target=self._wait, name="scenario-exit-watch", daemon=True)
        self._thread.start()

    def _wait(self) -> None:
        if self._fd is None:
            return
        try:
            poller = select.poll()
            poller.register(self._fd, select.POLLIN)
            while not self._stop.is_set():
                if poller.poll(100):
                    self.exited_at = time.monotonic()
                    return
        finally:
            os.close(self._fd)

    def close(self) -> float | None:
        self._thread.join(1.0)  # the child has been waited for: the pidfd is readable by now
        self._stop.set()
        self._thread.join(1.0)
        return self.exited_at


def _run_child(options: Mapping[str, Any], timeout: float, env: Mapping[str, str] | None,
               program: Sequence[str] | None = None) -> _ChildOutput:
    import subprocess

    from ..quarantine._marker import QUARANTINE_DIR_VAR

    command = list(program) if program else [sys.executable, "-m", "trtllm_liveness.demo._scenario"]
    child_env = {**os.environ, **(env or {})}
    # A wedge scenario quarantines "the host" (a marker, see quarantine/_marker.py): the demo, the matrix
    # and the benchmarks keep that marker in a directory of the child's own, never the machine's
    # /run, unless the caller chose one.
    quarantine = None
    if QUARANTINE_DIR_VAR not in child_env:
        quarantine = tempfile.mkdtemp(prefix="trtllm-liveness-quarantine-")
        child_env[QUARANTINE_DIR_VAR] = quarantine
    try:
        child = subprocess.Popen([*command, json.dumps(options)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 start_new_session=True, env=child_env)
    except BaseException:
        if quarantine is not None:
            shutil.rmtree(quarantine, ignore_errors=True)
        raise
    watch = _ExitWatch(child.pid)
    timed_out = False
    try:
        stdout, stderr = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        kill_session(child.pid)
        stdout, stderr = child.communicate(timeout=10)
        stderr += b"\n[scenario timed out]"
    except BaseException:  # Ctrl-C: the session is ours and must not outlive us
        kill_session(child.pid)
        raise
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
        exited_at = watch.close()
        if quarantine is not None:  # only the scenario process itself writes a marker, and it is gone
            shutil.rmtree(quarantine, ignore_errors=True)
    # prte and the workers outlive a parent that exits: give them a moment, then kill them.
    deadline = time.monotonic() + 3
    while session_members(child.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    survivors = kill_session(child.pid)
    lines = []
    for line in stdout.decode(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            value = json.loads(line)
            if isinstance(value, dict):
                lines.append(value)
    return _ChildOutput(lines, stderr.decode(errors="replace")[-4000:], survivors, child.returncode,
                        exited_at, timed_out)


def run_scenario(options: ScenarioOptions | Mapping[str, Any], timeout: float,
                 env: Mapping[str, str] | None = None, program: Sequence[str] | None = None) -> ScenarioRun:
    """Run a scenario in a child process in a new session, with an outer ``timeout`` (seconds);
    always kill what it left in that session. Blocks up to ``timeout`` + ~15 s.

    ``options``: a :class:`ScenarioOptions` or its mapping form (``ValueError`` here, before
    anything starts, for an unknown key or bad value). ``env`` is added to this process's
    environment for the child. Returns what the child reported, its exit status and exit time
    and the pids of its session still alive after cleanup (should be none); a malformed record
    line is reported in ``error``, never raised. ``program``: another scenario program (argv
    before the options' JSON) that prints the same records, e.g. one driving an upstream-shaped
    ``tensorrt_llm`` through its own API; default this module.
    """
    opts = options if isinstance(options, ScenarioOptions) else ScenarioOptions.from_dict(options)
    out = _run_child(opts.to_dict(), timeout, env, program)
    try:
        results, other = ScenarioRun.parse(out.lines)
        error = next((str(line["error"]) for line in other if "error" in line), None)
    except (KeyError, TypeError, ValueError) as exc:  # a child of another version, or a bug: say so
        results, other, error = (), tuple(out.lines), f"malformed scenario record: {exc!r}"
    return ScenarioRun(
        results=results, survivors=tuple(out.survivors), done=any(line.get("done") for line in other),
        error=error, stderr=out.stderr, returncode=out.returncode, exited_at=out.exited_at,
        timed_out=out.timed_out, progress=tuple(line for line in other if "done" not in line and "error" not in line))
