"""Fault-injection scenarios on the reference executor: the engine of the demo, tests and benchmark.

Run as ``python -m trtllm_liveness.reference._scenario '<json options>'`` in a child process
started with ``start_new_session=True`` (an MPI launcher may kill its whole process group). It
prints one JSON line per iteration and a final ``{"done": true}`` line, then ends with
``os._exit`` so no MPI/atexit join can hang it. Every wait is bounded by the options.

A scenario: start the executor (mode ``1.2`` or ``main``, liveness on or off), stream requests,
inject the fault into one rank, then time detection, health, failed requests and shutdown.
Faults: ``kill`` (SIGKILL; ``fault_ranks`` kills several at once), ``segv`` (SIGSEGV), ``stop``
(SIGSTOP), ``wedge`` (cgroup v1 freezer: real ``D`` state), ``exit0`` (the rank calls
``os._exit(0)`` mid-request), ``oom`` (the rank, in a memory-limited cgroup v1, allocates until the
kernel OOM killer ends it) and ``none`` (``control_s`` > 0: a no-fault control under request
load). Phases: ``serving``, ``init`` (during the model build) and ``shutdown`` (while
``shutdown()`` runs). Without liveness, the hang is observed for ``observe_s`` and the workers are
then killed by the harness (the executor itself would wait forever).

Hardening probes: ``health_threads`` calls ``check_health()`` from that many threads during the
fault and counts answers inconsistent with the first False; ``watcher_fault`` makes the
monitor's watcher thread die before the fault, so only the synchronous path can see it. Each
iteration reports the pidfds this process still holds afterwards (``pidfds_open``).
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from types import SimpleNamespace
from typing import Any

from .. import _pidfd, _procfs
from .._identity import ProcessIdentity
from .._shutdown import stop_processes
from ._env import PRTE_TMPDIR_VAR, configure_mpi_env, remove_private_prte_tmpdir
from ._faults import FREEZER_ROOT, FreezerGroup, MemoryGroup
from ._fuse_stall import FuseStall
from ._worker import read_announced_identities

__all__ = ["FREEZER_ROOT", "FAULTS", "ScenarioOptions", "kill_session", "run_in_child", "session_members"]

# "wedge": the whole rank frozen (cgroup v1 freezer); "fuse": one helper thread of the rank stuck in
# a FUSE lookup nobody answers (real D, wchan request_wait_answer). "spawn": MPI_Comm_spawn fails for
# real (PRRTE's session base is a regular file), at start-up.
FAULTS = ("kill", "segv", "stop", "wedge", "fuse", "exit0", "oom", "spawn", "none")
_SIGNALS = {"kill": signal.SIGKILL, "segv": signal.SIGSEGV, "stop": signal.SIGSTOP}


@dataclass
class ScenarioOptions:
    mode: str = "main"
    workers: int = 2
    liveness: bool = True
    fault: str = "kill"  # one of FAULTS
    fault_rank: int = 1
    fault_ranks: list[int] = field(default_factory=list)  # several at once (kill, segv, stop)
    fault_phase: str = "serving"  # serving | init | shutdown
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
    iterations: int = 1
    # How the executor is built: "class" (reference proxy class, mixed in directly);
    # "executor_cls" / "autoload" / "plain" go through an importable ``tensorrt_llm`` (the test
    # fakes): liveness_executor_class(GenerationExecutor).create(...), the import hook, or none.
    via: str = "class"


def _emit(record: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def _victims(opts: ScenarioOptions, identities: list[ProcessIdentity]) -> list[ProcessIdentity]:
    return [identities[rank] for rank in (opts.fault_ranks or [opts.fault_rank])]


def _inject(opts: ScenarioOptions, victims: list[ProcessIdentity], freezer: FreezerGroup | None,
            announce: str) -> float:
    """Inject the fault; returns its time (``time.monotonic()``, system-wide)."""
    if opts.fault == "wedge":
        assert freezer is not None
        t0 = time.monotonic()
        freezer.freeze([v.pid for v in victims])
        return t0
    if opts.fault in ("exit0", "oom", "fuse"):
        # The victim rank itself does it (see _worker._arm_fault) and records when.
        record = os.path.join(announce, "fault.json")
        with open(os.path.join(announce, "trigger"), "w"):
            pass
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError), open(record) as handle:
                return float(json.load(handle)["at"])
            time.sleep(0.001)
        raise TimeoutError("the fault-injection hook did not fire within 10 s")
    fds: list[int] = []
    try:
        for victim in victims:  # opened and verified first: never a recycled pid
            fds.append(_pidfd.open_verified_pidfd(victim.pid, victim.start_time))
        t0 = time.monotonic()
        for fd in fds:
            _pidfd.send_signal(fd, _SIGNALS[opts.fault])
        return t0
    finally:
        for fd in fds:
            os.close(fd)


def _build(opts: ScenarioOptions, worker_kwargs: dict[str, Any]) -> Any:
    if opts.via == "class":
        return _proxy_class(opts)(worker_kwargs, model_world_size=opts.workers)
    if opts.via == "autoload":
        import importlib

        importlib.import_module("trtllm_liveness.integrations.trtllm_autoload")
    from tensorrt_llm.executor.executor import GenerationExecutor  # the test fakes

    executor_cls: Any = GenerationExecutor
    if opts.via == "executor_cls":
        from ..integrations.trtllm import liveness_executor_class

        executor_cls = liveness_executor_class(GenerationExecutor)
    return executor_cls.create(model_world_size=opts.workers, **worker_kwargs)


def _proxy_class(opts: ScenarioOptions) -> type:
    from ._proxy import PROXY_CLASSES

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


def run_once(opts: ScenarioOptions, iteration: int) -> dict[str, Any]:
    with _ThreadExceptions() as thread_exceptions:
        out = _run_once(opts, iteration, thread_exceptions)
    out["thread_exceptions"] = thread_exceptions.messages
    return out


def _run_once(opts: ScenarioOptions, iteration: int, thread_exceptions: _ThreadExceptions) -> dict[str, Any]:
    announce = tempfile.mkdtemp(prefix="trtllm-scenario-")
    llm_args = SimpleNamespace(worker_liveness={
        "d_state_timeout_s": opts.d_state_timeout_s, "scan_interval_s": opts.scan_interval_s,
        "shutdown_grace_s": opts.shutdown_grace_s, "shutdown_term_s": opts.shutdown_term_s,
        "shutdown_kill_s": opts.shutdown_kill_s,
    } if opts.liveness else False)
    worker_kwargs = {"token_delay_s": opts.token_delay_s, "init_delay_s": opts.init_delay_s,
                     "announce_dir": announce, "llm_args": llm_args}
    out: dict[str, Any] = {"iteration": iteration, "mode": opts.mode, "liveness": opts.liveness,
                           "fault": opts.fault, "fault_rank": opts.fault_rank, "phase": opts.fault_phase}
    freezer = FreezerGroup(opts.cgroup_prefix) if opts.fault == "wedge" else None
    if freezer is not None:
        out["freezer_path"] = freezer.path
    memory = MemoryGroup(opts.oom_limit_mb << 20, opts.cgroup_prefix) if opts.fault == "oom" else None
    if memory is not None:
        out["memory_cgroup_path"] = memory.path
    stall = FuseStall().__enter__() if opts.fault == "fuse" else None
    if opts.fault in ("exit0", "oom", "fuse"):
        worker_kwargs["fault"] = {"kind": opts.fault, "rank": opts.fault_rank,
                                  "trigger": os.path.join(announce, "trigger"),
                                  "record": os.path.join(announce, "fault.json"),
                                  "cgroup": None if memory is None else memory.path,
                                  "path": None if stall is None else stall.new_path()}
    identities: list[ProcessIdentity] = []
    proxy: Any = None
    critical = _CriticalLog()
    logging.getLogger("trtllm_liveness").addHandler(critical)
    try:
        t_start = time.monotonic()
        if opts.fault == "spawn":
            return _run_spawn_failure(opts, worker_kwargs, out, thread_exceptions)
        if opts.fault_phase == "init":
            return _run_init_fault(opts, worker_kwargs, announce, freezer, out, identities)
        if opts.fault_phase == "shutdown" and opts.fault not in ("kill", "segv"):
            raise ValueError("fault_phase 'shutdown' takes a signal fault (kill, segv)")
        proxy = _build(opts, worker_kwargs)
        out["proxy_class"] = type(proxy).__name__
        out["ready_ms"] = (time.monotonic() - t_start) * 1e3
        identities.extend(read_announced_identities(announce, opts.workers, 10))
        out["pids"] = [identity.pid for identity in identities]
        _emit({"pids": out["pids"], "iteration": iteration})
        results = [proxy.generate_async([rank] * opts.tokens) for rank in range(opts.requests)]
        for result in results:
            result.started.wait(10)
        out["in_flight"] = sum(1 for result in results if result.started.is_set() and not result.done)
        if opts.fault == "none" and opts.control_s > 0:
            _control(opts, proxy, results, out)
        elif opts.fault == "none":
            out["tokens_ok"] = all(r.result(30) == [i] * opts.tokens for i, r in enumerate(results))
        elif opts.fault_phase == "shutdown":
            _run_shutdown_fault(opts, proxy, identities, announce, out)
            return out
        else:
            victims = _victims(opts, identities)
            out["victim"] = {"rank": victims[0].rank, "pid": victims[0].pid}
            out["victims"] = [{"rank": v.rank, "pid": v.pid} for v in victims]
            if opts.watcher_fault:
                _kill_watcher(proxy, out)
            hammer = _HealthHammer(proxy, opts.health_probe, opts.health_threads) if opts.health_threads else None
            try:
                t0 = _inject(opts, victims, freezer, announce)
                _observe(opts, proxy, results, t0, out)
            finally:
                if hammer is not None:
                    hammer.finish(out)
        _finish(opts, proxy, identities, out)
        return out
    finally:
        logging.getLogger("trtllm_liveness").removeHandler(critical)
        out["critical_logs"] = critical.messages
        if memory is not None:
            out["oom_kills"] = memory.oom_kills()
            memory.remove()
        released = False
        if freezer is not None:
            freezer.remove()
            released = True
        if stall is not None:
            stall.release()
            released = True
        if released:
            if out.get("survivors"):
                # An unkillable (frozen or FUSE-stuck) rank dies as soon as it is released: wait for that.
                out["survivors_while_frozen"] = frozen = out["survivors"]
                deadline = time.monotonic() + 5
                left = [i for i in identities if i.pid in frozen]
                while left and time.monotonic() < deadline:
                    time.sleep(0.01)
                    left = [i for i in left if _alive(i)]
                out["survivors"] = [i.pid for i in left]
        shutil.rmtree(announce, ignore_errors=True)


def _kill_watcher(proxy: Any, out: dict[str, Any]) -> None:
    """Make the monitor's watcher thread die (a tick raises once), as a bug or resource error would."""
    monitor = proxy.liveness_monitor if hasattr(proxy, "liveness_monitor") else proxy._liveness_monitor

    def broken_tick(*args: Any) -> None:
        del monitor._run_tick  # raise once; the class's method is back for anyone else
        raise RuntimeError("injected watcher failure")

    monitor._run_tick = broken_tick
    monitor._res.wake()
    deadline = time.monotonic() + 10
    while monitor.watcher_alive and time.monotonic() < deadline:
        time.sleep(0.005)
    out["watcher_alive_at_fault"] = monitor.watcher_alive
    out["watcher_error"] = repr(monitor.watcher_error)


def _control(opts: ScenarioOptions, proxy: Any, results: list[Any], out: dict[str, Any]) -> None:
    """No fault: keep ``requests`` requests in flight for ``control_s`` seconds; count alarms."""
    deadline = time.monotonic() + opts.control_s
    active = list(results)
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
            elif result.tokens != [result.tokens[0]] * opts.tokens:
                wrong += 1
            completed += 1
            prompt = completed % 1000
            active[index] = proxy.generate_async([prompt] * opts.tokens)
        time.sleep(0.005)
    for result in active:
        result.wait(30)
    events = list(getattr(proxy, "liveness_events", []))
    fatal = getattr(proxy, "_fatal_error", None)
    out.update(control_s=opts.control_s, requests_completed=completed, request_errors=errors,
               wrong_tokens=wrong, health_checks=checks, health_false=health_false,
               events=[event.to_dict() for event in events], fatal_error=None if fatal is None else str(fatal),
               pending_not_done=sum(1 for r in active if not r.done))
    out["alarms"] = health_false + len(events) + (fatal is not None) + errors


def _run_shutdown_fault(opts: ScenarioOptions, proxy: Any, identities: list[ProcessIdentity], announce: str,
                        out: dict[str, Any]) -> None:
    """Kill ``fault_rank`` while ``shutdown()`` runs: shutdown must stay bounded and account for it."""
    victims = _victims(opts, identities)
    out["victim"] = {"rank": victims[0].rank, "pid": victims[0].pid}
    done = threading.Event()

    def shut() -> None:
        try:
            proxy.shutdown()
        finally:
            done.set()

    t_start = time.monotonic()
    threading.Thread(target=shut, name="scenario-shutdown", daemon=True).start()
    with contextlib.suppress(Exception):  # the rank may already be gone: that is the race
        _inject(opts, victims, None, announce)
    finished = done.wait(opts.observe_s)
    out["shutdown_ms"] = round((time.monotonic() - t_start) * 1e3, 3) if finished else None
    out["shutdown_hung"] = not finished
    report = getattr(proxy, "liveness_shutdown_report", None)
    out["shutdown_report"] = None if report is None else report.to_dict()
    out["unkillable"] = [] if report is None else [u.pid for u in report.unkillable]
    events = list(getattr(proxy, "liveness_events", []))
    out["events"] = [event.to_dict() for event in events]
    fatal = _settled_fatal_error(proxy) if events else getattr(proxy, "_fatal_error", None)
    out["fatal_error"] = None if fatal is None else str(fatal)
    out["pre_shutdown_runs"] = proxy.pre_shutdown_runs
    if not finished or os.path.isdir(getattr(proxy, "_ipc_dir", "")):
        stop_processes(identities, grace_s=0.0, kill_s=2.0)
        with contextlib.suppress(Exception):
            proxy._close_queues()
    out["survivors"] = [i.pid for i in identities if _alive(i)]


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

    def finish(self, out: dict[str, Any], linger_s: float = 0.3) -> None:
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
        out.update(health_threads=len(self.threads), health_calls=len(flat),
                   health_false_answers=sum(1 for *_, answer in flat if not answer),
                   health_inconsistent=late_true + flips, health_errors=self.errors,
                   health_threads_alive=sum(1 for t in self.threads if t.is_alive()))


def _settled_fatal_error(proxy: Any, timeout: float = 2.0) -> Any:
    """The executor's recorded fatal error, waiting (bounded) for it to be published.

    The liveness extension turns ``check_health()`` False at once but publishes ``_fatal_error``
    only after ``pre_shutdown()`` has returned (see ``integrations/trtllm.py``), so a reader that
    just saw health turn False may be a few milliseconds early.
    """
    deadline = time.monotonic() + timeout
    fatal = getattr(proxy, "_fatal_error", None)
    while fatal is None and time.monotonic() < deadline:
        time.sleep(0.001)
        fatal = getattr(proxy, "_fatal_error", None)
    return fatal


def _observe(opts: ScenarioOptions, proxy: Any, results: list[Any], t0: float, out: dict[str, Any]) -> None:
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

    out["detected_ms"] = ms(events[0].detected_at) if events else None
    out["health_false_ms"] = ms(health_false)
    out["requests_failed_ms"] = ms(failed_all)
    out["e2e_ms"] = ms(max(health_false, failed_all)) if health_false and failed_all else None
    out["stall_detected_ms"] = ms(stalled)
    out["events"] = [event.to_dict() for event in events]
    fatal = _settled_fatal_error(proxy) if health_false is not None else getattr(proxy, "_fatal_error", None)
    out["fatal_error"] = None if fatal is None else str(fatal)
    out["fatal_error_type"] = None if fatal is None else type(fatal).__name__
    out["pending_errors"] = sorted({type(r.error).__name__ for r in results if r.error is not None})
    out["pending_not_done"] = sum(1 for r in results if not r.done)
    out["new_request_error"] = None
    if health_false is not None:
        try:
            proxy.generate_async([1, 2, 3])
        except Exception as exc:
            out["new_request_error"] = type(exc).__name__
    out["detection_window_s"] = opts.observe_s


def _finish(opts: ScenarioOptions, proxy: Any, identities: list[ProcessIdentity], out: dict[str, Any]) -> None:
    if opts.liveness or opts.fault == "none":
        t = time.monotonic()
        proxy.shutdown()
        out["shutdown_ms"] = round((time.monotonic() - t) * 1e3, 3)
        out["pre_shutdown_calls"] = getattr(proxy, "liveness_pre_shutdown_calls", None)
        out["pre_shutdown_runs"] = proxy.pre_shutdown_runs
        report = getattr(proxy, "liveness_shutdown_report", None)
        out["shutdown_report"] = None if report is None else report.to_dict()
        out["unkillable"] = [] if report is None else [u.pid for u in report.unkillable]
        out["restartable"] = None if report is None else report.restartable
        fatal = getattr(proxy, "liveness_fatal_error", None)
        out["fatal_restartable"] = None if fatal is None else fatal.restartable
        if os.path.isdir(getattr(proxy, "_ipc_dir", "")):  # upstream's shutdown was abandoned
            with contextlib.suppress(Exception):
                proxy._close_queues()
    else:
        # The executor would wait forever: the harness ends the hang itself.
        stop_processes(identities, grace_s=0.0, kill_s=2.0)
        with contextlib.suppress(Exception):
            proxy.mpi_session.shutdown()
        with contextlib.suppress(Exception):
            proxy._close_queues()
        out["shutdown_ms"] = None
    out["survivors"] = [i.pid for i in identities if _alive(i)]


def _alive(identity: ProcessIdentity) -> bool:
    try:
        _pidfd.verify_start_time(identity.pid, identity.start_time)
    except Exception:
        return False
    return True


def _build_in_thread(opts: ScenarioOptions, worker_kwargs: dict[str, Any]) -> tuple[threading.Thread, dict[str, Any]]:
    """Start building the executor in a daemon thread (construction blocks until READY, or
    forever); the dict gets ``proxy``, or ``error`` and ``at`` (``time.monotonic()`` of the raise)."""
    holder: dict[str, Any] = {}

    def build() -> None:
        try:
            holder["proxy"] = _build(opts, worker_kwargs)
        except BaseException as exc:
            holder["error"] = exc
            holder["at"] = time.monotonic()

    builder = threading.Thread(target=build, name="scenario-build", daemon=True)
    builder.start()
    return builder, holder


def _run_init_fault(opts: ScenarioOptions, worker_kwargs: dict[str, Any], announce: str,
                    freezer: FreezerGroup | None, out: dict[str, Any],
                    identities: list[ProcessIdentity]) -> dict[str, Any]:
    builder, holder = _build_in_thread(opts, worker_kwargs)
    identities.extend(read_announced_identities(announce, opts.workers, 10))
    _emit({"pids": [i.pid for i in identities], "iteration": out["iteration"]})
    time.sleep(min(0.2, opts.init_delay_s / 4))
    victims = _victims(opts, identities)
    out["victim"] = {"rank": victims[0].rank, "pid": victims[0].pid}
    t0 = _inject(opts, victims, freezer, announce)
    builder.join(opts.observe_s)
    out["init_hung"] = builder.is_alive()
    error = holder.get("error")
    out["init_error_ms"] = None if builder.is_alive() else round((time.monotonic() - t0) * 1e3, 3)
    out["init_error_type"] = None if error is None else type(error).__name__
    out["init_error"] = None if error is None else str(error)
    out["restartable"] = getattr(error, "restartable", None)
    if builder.is_alive() or "proxy" in holder:
        stop_processes(identities, grace_s=0.0, kill_s=2.0)
    out["survivors"] = [i.pid for i in identities if _alive(i)]
    return out


def _run_spawn_failure(opts: ScenarioOptions, worker_kwargs: dict[str, Any], out: dict[str, Any],
                       thread_exceptions: _ThreadExceptions) -> dict[str, Any]:
    """Build while MPI_Comm_spawn fails (``main`` made PRRTE's session base unusable). The
    latency is from the death of mpi4py's manager thread to the constructor's error."""
    out["phase"] = "init"
    builder, holder = _build_in_thread(opts, worker_kwargs)
    builder.join(opts.observe_s)
    error = holder.get("error")
    spawn_died = next((t for t, m in zip(thread_exceptions.times, thread_exceptions.messages, strict=True)
                       if "MPI_ERR" in m), None)
    out["init_hung"] = builder.is_alive()
    out["spawn_failed"] = spawn_died is not None
    out["init_error_ms"] = (None if error is None or spawn_died is None
                            else round((holder["at"] - spawn_died) * 1e3, 3))
    out["init_error_type"] = None if error is None else type(error).__name__
    out["init_error"] = None if error is None else str(error)
    out["survivors"] = []  # no rank was ever started
    return out


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
    options = ScenarioOptions(**json.loads(argv[0])) if argv else ScenarioOptions()
    if options.fault not in FAULTS:
        raise SystemExit(f"unknown fault {options.fault!r}")
    blocker = None
    if options.fault == "spawn":
        # PRRTE cannot make prte.<pid>/ under a regular file: the spawn fails for real.
        fd, blocker = tempfile.mkstemp(prefix="trtllm-scenario-not-a-dir-")
        os.close(fd)
        os.environ[PRTE_TMPDIR_VAR] = blocker
    configure_mpi_env()
    code = 0
    try:
        for iteration in range(options.iterations):
            record = run_once(options, iteration)
            record["options"] = asdict(options)
            record["pidfds_open"], record["fds_open"] = _open_fds()
            _emit(record)
        _emit({"done": True})
    except BaseException:
        _emit({"error": traceback.format_exc()})
        code = 1
    if blocker is not None:
        os.unlink(blocker)
    remove_private_prte_tmpdir()  # os._exit skips the atexit removal
    sys.stdout.flush()
    sys.stderr.flush()
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


def run_in_child(
    options: dict[str, Any], timeout: float, env: dict[str, str] | None = None
) -> tuple[list[dict[str, Any]], list[int]]:
    """Run a scenario in a new session with an outer ``timeout``; always kill what is left.

    Returns the JSON records it printed and the pids still alive after cleanup (should be none).
    """
    import subprocess

    child = subprocess.Popen(
        [sys.executable, "-m", "trtllm_liveness.reference._scenario", json.dumps(options)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
        env=None if env is None else {**os.environ, **env},
    )
    try:
        stdout, stderr = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
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
    # prte and the workers outlive a parent that exits: give them a moment, then kill them.
    deadline = time.monotonic() + 3
    while session_members(child.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    survivors = kill_session(child.pid)
    records = []
    for line in stdout.decode(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            records.append(json.loads(line))
    if not any(r.get("done") for r in records):
        records.append({"stderr": stderr.decode(errors="replace")[-4000:]})
    return records, survivors
