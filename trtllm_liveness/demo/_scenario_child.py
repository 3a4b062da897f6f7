"""Fault-injection scenarios, the child's side: one process runs the executor and its faults.

Run as ``python -m trtllm_liveness.demo._scenario_child '<json options>'`` in a child process
started with ``start_new_session=True`` (an MPI launcher may kill its whole process group); the
parent side is :func:`._scenario_launcher.run_scenario`. The child prints one JSON line per
iteration (a :class:`~._scenario_records.ScenarioResult`'s ``to_dict()``) and a final
``{"done": true}`` line, then ends with ``os._exit`` so no MPI/atexit join can hang it (except for
the endings below, whose point is the real interpreter exit). Every wait is bounded by the options.

A scenario: start the executor (mode ``1.2`` or ``main``, liveness on or off, configured through
``TRTLLM_WORKER_LIVENESS`` as a server would be), stream requests, inject the fault into one rank,
then time detection, health, failed requests and shutdown. The executor (``via``): the reference
proxy (``class``), or upstream's API of the ``tensorrt_llm`` on ``sys.path`` (``executor_cls``,
``autoload``, ``plain``): ``GenerationExecutor.create(engine, model_world_size=N)`` with the engine
the ``engine`` option's factory makes, whose ranks announce their identities (``announce_dir``) and
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

Probes of the extension under load: ``health_threads`` calls ``check_health()`` from that many
threads during the fault and counts answers inconsistent with the first False; ``watcher_fault``
makes the monitor's watcher thread die before the fault, so only the synchronous path can see it.
Each iteration reports the pidfds this process still holds afterwards (``pidfds_open``).

Here: the process and one iteration while serving. The executor under test is built and asked in
:mod:`._scenario_executor`; the faults come from :mod:`._scenario_faults`; what follows them is
watched by :mod:`._scenario_observe`; the faults outside serving run in :mod:`._scenario_phases`;
the endings and the record's output are in :mod:`._scenario_endings`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
import traceback
from typing import Any

from .._config import ENV_VAR as LIVENESS_ENV_VAR
from ..process._identity import ProcessIdentity
from ._cgroup_faults import FreezerGroup, MemoryGroup
from ._fuse_stall import FuseStall
from ._mpi_env import PRTE_TMPDIR_VAR, configure_mpi_env, remove_private_prte_tmpdir
from ._scenario_endings import SIGINTS, AtExitReport, emit, open_fds, serve_until_sigint
from ._scenario_executor import (
    build_executor,
    expected_tokens,
    fatal_fields,
    shutdown_outcome,
    submit,
    upstream_api,
)
from ._scenario_faults import alive, announce_ranks, inject, kill_watcher, settle_ranks, victims_of
from ._scenario_observe import CriticalLog, HealthHammer, ThreadExceptions, observe, run_control, snapshot_of_ranks
from ._scenario_phases import run_init_fault, run_shutdown_fault, run_spawn_failure
from ._scenario_records import ResultInProgress, ScenarioOptions, ScenarioResult, ShutdownOutcome

__all__ = ["LIVENESS_ENV_VAR", "liveness_env", "main", "run_once"]


def liveness_env(opts: ScenarioOptions) -> str:
    """The ``TRTLLM_WORKER_LIVENESS`` value that configures the extension as ``opts`` asks."""
    settings: dict[str, Any] = {
        "d_state_timeout_s": opts.d_state_timeout_s, "scan_interval_s": opts.scan_interval_s,
        "shutdown_grace_s": opts.shutdown_grace_s, "shutdown_term_s": opts.shutdown_term_s,
        "shutdown_kill_s": opts.shutdown_kill_s, "diagnosis_before_stop_s": opts.diagnosis_before_stop_s,
    }
    if opts.exit_on_fatal:
        settings.update(exit_on_fatal=1, exit_code=opts.exit_code, exit_timeout_s=opts.exit_timeout_s)
    return ",".join(f"{key}={value}" for key, value in settings.items())


def run_once(opts: ScenarioOptions, iteration: int, at_exit: AtExitReport | None = None) -> ScenarioResult | None:
    """One iteration; None for ``ending="interpreter_exit"`` (``at_exit`` reports it later)."""
    draft = ResultInProgress(iteration, opts, opts.fault_phase)
    with ThreadExceptions() as thread_exceptions:
        _run_once(opts, thread_exceptions, draft, at_exit)
    draft.update(thread_exceptions=tuple(thread_exceptions.messages))
    return None if at_exit is not None else draft.result


def _run_once(opts: ScenarioOptions, thread_exceptions: ThreadExceptions, draft: ResultInProgress,
              at_exit: AtExitReport | None) -> None:
    iteration = draft.result.iteration
    announce = tempfile.mkdtemp(prefix="trtllm-scenario-")
    worker_kwargs: dict[str, Any] = {"token_delay_s": opts.token_delay_s, "init_delay_s": opts.init_delay_s,
                                     "announce_dir": announce}
    freezer = FreezerGroup(opts.cgroup_prefix) if opts.fault == "wedge" else None
    memory = MemoryGroup(opts.oom_limit_mb << 20, opts.cgroup_prefix) if opts.fault == "oom" else None
    draft.update(freezer_path=None if freezer is None else freezer.path,
                 memory_cgroup_path=None if memory is None else memory.path)
    stall = FuseStall().__enter__() if opts.fault == "fuse" else None
    if opts.fault in ("exit0", "oom", "fuse"):
        worker_kwargs["fault"] = {"kind": opts.fault, "rank": opts.fault_rank,
                                  "trigger": os.path.join(announce, "trigger"),
                                  "record": os.path.join(announce, "fault.json"),
                                  "cgroup": None if memory is None else memory.path,
                                  "path": None if stall is None else stall.new_path()}
    identities: list[ProcessIdentity] = []
    critical = CriticalLog()
    logging.getLogger("trtllm_liveness").addHandler(critical)
    stop_reading = threading.Event()  # ends the readers of requests on upstream's API (submit)
    try:
        t_start = time.monotonic()
        if opts.fault == "spawn":
            run_spawn_failure(opts, worker_kwargs, draft, thread_exceptions)
            return
        if opts.fault_phase == "init":
            run_init_fault(opts, worker_kwargs, announce, freezer, draft, identities)
            return
        if opts.fault_phase == "shutdown" and opts.fault not in ("kill", "segv"):
            raise ValueError("fault_phase 'shutdown' takes a signal fault (kill, segv)")
        proxy = build_executor(opts, worker_kwargs)
        if at_exit is not None:
            at_exit.draft, at_exit.proxy = draft, proxy
        draft.update(proxy_class=type(proxy).__name__, ready_ms=(time.monotonic() - t_start) * 1e3)
        announce_ranks(opts, announce, draft, identities)
        results = [submit(opts, proxy, rank, stop_reading) for rank in range(opts.requests)]
        for result in results:
            result.started.wait(10)
        draft.update(in_flight=sum(1 for result in results if result.started.is_set() and not result.done))
        if opts.fault == "none" and opts.control_s > 0:
            control, fatal, pending = run_control(opts, proxy, results, stop_reading)
            draft.update(control=control, pending_not_done=pending, **fatal_fields(proxy, fatal))
        elif opts.fault == "none":
            draft.update(tokens_ok=all(r.result(30) == expected_tokens(opts, i) for i, r in enumerate(results)),
                         pending_not_done=sum(1 for r in results if not r.done))
            if opts.ending == "interpreter_exit":
                return  # the script just ends: no shutdown(), the record comes from the atexit hook
        elif opts.fault_phase == "shutdown":
            run_shutdown_fault(opts, proxy, identities, announce, draft)
            return
        else:
            victims = victims_of(opts, identities, draft)
            if opts.watcher_fault:
                draft.update(watcher=kill_watcher(proxy))
            hammer = HealthHammer(proxy, opts.health_probe, opts.health_threads) if opts.health_threads else None
            try:
                t0, floor = inject(opts, victims, freezer, announce)
                draft.update(fault_at=t0)
                emit({"fault_at": t0, "iteration": iteration})
                detection, fatal, pending = observe(opts, proxy, results, t0, floor)
                draft.update(detection=detection, pending_not_done=pending, **fatal_fields(proxy, fatal))
                if opts.fault == "stop" and detection.stall_detected_ms is not None:
                    draft.update(snapshot=snapshot_of_ranks(proxy, f"stall after SIGSTOP of rank {victims[0].rank}"))
                # Before anything that may end the process (the harness's kill of the ranks after a
                # wedge or stop without liveness can make MPI abort it): what was seen, for the demo.
                emit({"observed": {"pending_not_done": pending, "in_flight": draft.result.in_flight,
                                   "health_false_ms": detection.health_false_ms}, "iteration": iteration})
            finally:
                if hammer is not None:
                    draft.update(health_probe=hammer.finish())
            if opts.ending == "serve_until_sigint":
                serve_until_sigint(opts, draft, t0)
        _finish(opts, proxy, identities, draft)
        ending = draft.result.ending
        if ending is not None and SIGINTS.times:
            draft.update(ending=dataclasses.replace(
                ending, graceful_ms=round((time.monotonic() - SIGINTS.times[0]) * 1e3, 3)))
    finally:
        stop_reading.set()
        logging.getLogger("trtllm_liveness").removeHandler(critical)
        draft.update(critical_logs=tuple(critical.messages))
        if memory is not None:
            draft.update(oom_kills=memory.oom_kills())
            memory.remove()
        if freezer is not None:
            freezer.remove()
        if stall is not None:
            stall.release()
        frozen = draft.result.survivors
        if (freezer is not None or stall is not None) and frozen:
            # An unkillable (frozen or FUSE-stuck) rank dies as soon as it is released: wait for that.
            deadline = time.monotonic() + 5
            left = [i for i in identities if i.pid in frozen]
            while left and time.monotonic() < deadline:
                time.sleep(0.01)
                left = [i for i in left if alive(i)]
            draft.update(survivors_while_frozen=frozen, survivors=tuple(i.pid for i in left))
        shutil.rmtree(announce, ignore_errors=True)


def _finish(opts: ScenarioOptions, proxy: Any, identities: list[ProcessIdentity], draft: ResultInProgress) -> None:
    """Shut the executor down and time it; without liveness (it would wait forever) the harness
    ends the ranks instead."""
    hang = not (opts.liveness or opts.fault == "none")
    if hang:
        draft.update(shutdown=ShutdownOutcome(shutdown_ms=None, by_harness=True))
    else:
        t = time.monotonic()
        proxy.shutdown()
        shutdown_ms = round((time.monotonic() - t) * 1e3, 3)
        fatal = getattr(proxy, "liveness_fatal_error", None)
        state = getattr(proxy, "liveness_state", None)  # how many calls reached upstream's pre_shutdown()
        outcome = shutdown_outcome(proxy, shutdown_ms=shutdown_ms,
                                   pre_shutdown_calls=getattr(state, "pre_shutdown_entries", None),
                                   fatal_restartable=None if fatal is None else fatal.restartable)
        draft.update(shutdown=dataclasses.replace(
            outcome, restartable=None if outcome.report is None else outcome.report.restartable))
        if os.path.isdir(getattr(proxy, "_ipc_dir", "")):  # upstream's shutdown was abandoned
            with contextlib.suppress(Exception):
                proxy._close_queues()
    cleanups = [lambda: proxy.mpi_session.shutdown()]
    if not upstream_api(opts):
        # Upstream's queues are left open: its dispatch thread is still inside a receive on one
        # (ZMQ sockets are not thread-safe); the scenario process ends with os._exit anyway.
        cleanups.append(lambda: proxy._close_queues())
    settle_ranks(identities, draft, hang, *cleanups)


def main(argv: list[str]) -> None:
    """The scenario child: ``argv[0]`` is the options' JSON (``ScenarioOptions.from_dict``)."""
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
        SIGINTS.install()
    at_exit = AtExitReport(options) if options.ending == "interpreter_exit" else None
    code = 0
    try:
        for iteration in range(options.iterations):
            record = run_once(options, iteration, at_exit)
            if record is not None:
                emit(dataclasses.replace(record, **open_fds()).to_dict())
        if at_exit is None:
            emit({"done": True})
    except BaseException:
        emit({"error": traceback.format_exc()})
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
