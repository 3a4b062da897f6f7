"""Bounded shutdown of one engine: what the proxy's ``shutdown()`` runs, what a failed start runs,
and the engine's part in the process's ending (the exit guard's graceful action; its ranks stopped
before the process ends), all bounded.

Data flow of :func:`shutdown_engine`::

    expected exits (a death the monitor already knows is delivered first)
    healthy: stop the watcher; (ZMQ debug, this thread owns the request socket) upstream pre_shutdown() here
    failed: the fatal verdict's snapshot awaited (diagnosis_before_stop_s at most; _hosts_s with a hub)
    upstream shutdown() in a daemon thread
      healthy: joined for shutdown_grace_s; own session: the ranks' exit awaited, then stop_workers
      failed:  stop_workers at once
      stop_workers: after a fatal verdict its snapshot first (the same bound);
                    the stopped ranks' exits expected (no deaths), one INFO line each
      after stop_workers: upstream's waits released (its futures failed, its dispatch thread
                          given the end marker: _upstream_teardown)
    upstream still blocked 1 s later: the session abandoned
    release (hub, channel, stall timer, monitor, metrics; the engine's threads and the
    diagnosis' threads joined, each until its deadline); the outcome marked clean, or the unkillable ranks
    recorded as the fatal error

    stop_workers: remote hosts' ranks (agent hub) in a thread, local ranks SIGTERM -> SIGKILL,
                  both bounded; a rank left unkillable quarantines the host

    the process's ending (exit_on_fatal): its STOP stage runs stop_workers for every engine not
    yet released (the ranks are not our children: nobody else reaps them once we are gone)
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import weakref
from collections.abc import Callable
from typing import Any, Protocol

from ..._errors import LivenessError
from ..._events import WorkerState
from ...exit._exit_guard import FatalExitGuard, interrupt_self_once
from ...exit._outcome import mark_clean
from ...exit._process_ending import Stage, process_ending
from ...monitor._monitor import WorkerProcessMonitor
from ...process._identity import ProcessIdentity, is_local
from ...process._pidfd import verify_start_time
from ...stop._bounded_stop import StopOutcome, StopReport
from ._fatal import PRE_SHUTDOWN_WAIT_S, note_unrestartable
from ._hosts import stop_remote_hosts
from ._state import EngineLiveness, EngineStop, state_of
from ._upstream_teardown import abandon_session, owns_session, release_upstream_waits


class EngineProxy(Protocol):
    """What the bounded shutdown calls on the proxy (the mixin's class over upstream's)."""

    _fatal_error: BaseException | None

    def _liveness_expected_exits(self) -> None: ...

    def pre_shutdown(self) -> None: ...

logger = logging.getLogger(__name__.rpartition(".")[0])

_UPSTREAM_SHUTDOWN_AFTER_STOP_S = 2.0
"""How long upstream's shutdown gets after the stop, in all: the end marker's tries
(``DISPATCH_END_S``) included."""
UPSTREAM_SHUTDOWN_THREAD = "trtllm-liveness-upstream-shutdown"
STOP_MARGIN_S = 2.0
"""What a second caller of :func:`stop_workers` allows beyond the stop's own waits before it stops
waiting for the first (the kernel-stack reads of unkillable ranks, a loaded host)."""


def shutdown_engine(proxy: EngineProxy, state: EngineLiveness, upstream_shutdown: Callable[[], None]) -> None:
    """The data flow of the module docstring; ``upstream_shutdown`` runs upstream's ``shutdown()``
    (never raises). Blocks for at most about ``shutdown_grace_s + shutdown_term_s +
    shutdown_kill_s + 2`` seconds. Idempotent: only the first call does anything."""
    proxy._liveness_expected_exits()  # a death already known is delivered first
    failed = state.fatal_path.begin_shutdown()
    if failed is None:
        return
    config = state.config
    owned = owns_session(proxy, state)
    assert state.monitor is not None
    if failed:
        state.fatal_path.done.wait(PRE_SHUTDOWN_WAIT_S)
        snapshot_first(state)  # before upstream's shutdown too: its session's teardown ends the ranks
    else:
        # Workers exiting now are expected: stop the watcher so they are not reported dead.
        state.monitor.stop()
        if os.environ.get("TLLM_LLMAPI_ZMQ_DEBUG", "0") != "0" and state.owns_request_socket():
            # Upstream's debug mode (the word as its ipc reads it, docs/upstream-contract.md) raises
            # on a send from a thread that does not own its request socket: this one does, so
            # upstream's pre_shutdown() (stop sentinel, cancellations) runs here; the shutdown()
            # below then finds it done. The engine is healthy, so these sends go to a live leader.
            proxy.pre_shutdown()
    # The engine's thread, bound 0: joined below until its own bound (the stop's end + 2 s), after
    # which it is abandoned with its WARNING; release() then only checks that it ended.
    # None: no thread can start (the interpreter's shutdown; its WARNING is written): the ranks are
    # still stopped and everything released, upstream's session abandoned as a blocked one's.
    upstream = state.fatal_path.threads.start(upstream_shutdown, name=UPSTREAM_SHUTDOWN_THREAD, bound_s=0.0)
    report = None
    if not failed:
        # A healthy engine gets the grace period to stop by itself; a dead world does not.
        deadline = time.monotonic() + config.shutdown_grace_s
        if upstream is not None:
            upstream.join(config.shutdown_grace_s)
        if owned:
            wait_exit(state, deadline)
            report = stop_workers(state)
        # else: the ranks belong to the caller's session (mpirun's job): they keep serving it
        # after this engine is gone, and are never signalled by a healthy shutdown.
    else:
        report = stop_workers(state)
    stopped_at = time.monotonic()
    if failed or owned:
        release_upstream_waits(proxy, state, report)
    if upstream is not None:
        upstream.join(max(0.0, stopped_at + _UPSTREAM_SHUTDOWN_AFTER_STOP_S - time.monotonic()))
        if upstream.is_alive():
            logger.warning("liveness: upstream shutdown still blocked after the workers were stopped; abandoned")
    if upstream is None or upstream.is_alive():
        abandon_session(proxy, state)
    release(state, reported=UPSTREAM_SHUTDOWN_THREAD)
    if state.fatal_path.fatal is None and not (report is not None and report.unkillable):
        mark_clean()
    events = report.events() if report is not None and report.unkillable else []
    if events:
        fatal = state.fatal_path.fail_after_stop(events[0])
        if getattr(proxy, "_fatal_error", None) is None:
            proxy._fatal_error = fatal


def wait_exit(state: EngineLiveness, deadline: float) -> None:
    """Wait until every registered rank has exited, or until ``deadline`` (monotonic)."""
    pending = state.identities
    while pending and time.monotonic() < deadline:
        pending = [identity for identity in pending if _is_running(identity)]
        if pending:
            time.sleep(0.01)


def stop_workers(state: EngineLiveness) -> StopReport | None:
    """Stop the engine's ranks, bounded, exactly once per engine: the remote hosts' through the
    agent hub (in a thread), the local ones with SIGTERM, then SIGKILL. None when there is nothing
    to stop. A rank the stop leaves unkillable quarantines the host.

    ``shutdown()``, the process's ending (the exit guard's watchdog, the STOP stage) and a failed
    start may all call it, from different threads at the same time: :meth:`~._state.EngineStop.once`
    runs it for the first; every other caller waits for it (at most the stop's own bound) and gets
    the same report, so no unkillable rank is noted twice either."""
    config = state.config
    bound = (snapshot_bound_s(state) + config.shutdown_term_s + config.shutdown_kill_s
             + STOP_MARGIN_S + (config.shutdown_term_s + config.shutdown_kill_s + 2.0 if state.hub is not None else 0))
    return state.stop.once(bound, lambda stop: _stop_workers_once(state, stop))


def _stop_workers_once(state: EngineLiveness, stop: EngineStop) -> StopReport | None:
    from ...stop._bounded_stop import stop_processes

    # Never signal an identity whose start time was not verified (a recycled pid).
    identities = [identity for identity in state.identities if identity.start_time is not None]
    if not identities and state.hub is None:
        return None
    config = state.config
    if not state.fatal_path.shutdown_started:  # shutdown() waited before it started upstream's shutdown
        snapshot_first(state)
    if state.monitor is not None:
        state.monitor.mark_expected_exits()  # the ranks this stop ends are no deaths
    remote = stop_remote_hosts(state.hub, config, state.fatal_path.threads) if state.hub is not None else None
    identities = [identity for identity in identities if is_local(identity)]
    report = stop_processes(identities, grace_s=config.shutdown_term_s, kill_s=config.shutdown_kill_s)
    if remote is not None:
        if remote[0] is not None:
            remote[0].join(config.shutdown_term_s + config.shutdown_kill_s + 2.0)
        stop.note_host_stops(list(remote[1]))
    log_stopped(report, state.monitor if state.fatal_path.fatal is not None else None)
    note_unrestartable(state, report.events())  # quarantine: ranks left unkillable by the stop
    return report


def snapshot_first(state: EngineLiveness) -> None:
    """After a fatal verdict, wait :func:`snapshot_bound_s` at most for its diagnosis' snapshot:
    it shows the ranks as the failure left them, not as the stop does."""
    if state.fatal_path.fatal is not None and state.diagnoser is not None:
        state.diagnoser.await_snapshot(snapshot_bound_s(state))


def snapshot_bound_s(state: EngineLiveness) -> float:
    """How long :func:`snapshot_first` waits at most: longer where an agent hub asks other hosts."""
    config = state.config
    return config.diagnosis_before_stop_hosts_s if state.hub is not None else config.diagnosis_before_stop_s


def log_stopped(report: StopReport, monitor: WorkerProcessMonitor | None) -> None:
    """One INFO line per rank the stop ended: what the extension does itself is no failure. After a
    fatal verdict (``monitor`` given), a rank found gone whose exit the monitor never reported (it
    ended between the verdict and the stop, the monitor then expecting exits) gets the
    consequence's INFO line instead; one it reported was logged with its event."""
    statuses = monitor.statuses() if monitor is not None else []
    reported = {status.identity.rank for status in statuses
                if status.state in (WorkerState.EXITED, WorkerState.ZOMBIE)}
    for worker in report.workers:
        if worker.outcome in (StopOutcome.EXITED_AFTER_TERM, StopOutcome.EXITED_AFTER_KILL):
            took = "" if worker.exited_after_s is None else f" after {worker.exited_after_s:.3f}s"
            logger.info("liveness: stopped rank %d (pid %s) on host %s: %s, exited%s", worker.rank, worker.pid,
                        worker.hostname, "+".join(worker.signals_sent) or "no signal", took)
        elif monitor is not None and worker.outcome is StopOutcome.ALREADY_GONE and worker.rank not in reported:
            logger.info("liveness: MPI worker rank %d (pid %s) on host %s exited after the engine's failure or stop "
                        "began: gone before the stop's signal", worker.rank, worker.pid, worker.hostname)


def release(state: EngineLiveness, reported: str = "") -> None:
    """Close what the engine's liveness holds (hub, side channel, stall timer, monitor, metrics),
    leave the process's ending, and join the engine's threads and the diagnosis, each until its
    deadline (the exit guard's trigger first stops waiting for ``exit_delay_s``). A thread still
    running then (``pre_shutdown()`` blocked on a dead peer) is named in one WARNING; ``reported``
    names a thread whose own WARNING said so already (upstream's shutdown, abandoned)."""
    state.fatal_path.closing.set()
    if state.stop_at_exit is not None:
        process_ending().discard_cleanup(state.stop_at_exit, Stage.STOP)
    for held in (state.hub, state.channel, state.stall, state.monitor, state.metrics):
        if held is not None:
            with contextlib.suppress(Exception):
                held.close()
    left = [name for name in state.fatal_path.threads.join() if name != reported]
    if state.diagnoser is not None:
        left += state.diagnoser.close()
    if left:
        logger.warning("liveness: threads still running after their bound, left to end with the process: %s",
                       ", ".join(left))


def abort_start(state: EngineLiveness) -> None:
    """The constructor fails, so nobody will call ``shutdown()``: stop what was started, bounded."""
    with contextlib.suppress(Exception):
        stop_workers(state)
    release(state)


def arm_exit_guard(state: EngineLiveness, ref: weakref.ReferenceType[Any]) -> None:
    """The exit policy's one way into the engine (``exit_on_fatal``): the exit guard, whose graceful
    action is ONE SIGINT per process, and none once this executor's ``shutdown()`` has begun (a
    SIGINT from trtllm-serve's ``/health`` got there first); and the engine's STOP cleanup of the
    process's ending: its ranks are not our children (prte spawned them), so nobody else reaps them
    once this process is gone; they are stopped first, bounded (a rank the stop leaves unkillable
    quarantines the host, awaited by the ending, and makes the exit status
    ``exit_code_unrestartable``). The cleanup holds the proxy by weakref; :func:`release` drops it."""
    def interrupt() -> None:
        if state.fatal_path.shutdown_started:
            logger.info("liveness: the executor is already shutting down; the exit guard sends no SIGINT")
            return
        if not interrupt_self_once():
            logger.info("liveness: graceful shutdown already requested by another exit guard of this process")

    def stop() -> None:
        proxy = ref()
        if proxy is not None:
            stop_workers(state_of(proxy))

    config = state.config
    state.exit_guard = FatalExitGuard(graceful=interrupt, timeout_s=config.exit_timeout_s, exit_code=config.exit_code,
                                      exit_code_unrestartable=config.exit_code_unrestartable)
    state.stop_at_exit = stop
    process_ending().add_cleanup(stop, Stage.STOP)


def _is_running(identity: ProcessIdentity) -> bool:
    """The rank is there, as itself; one whose state cannot be read counts as ended: the stop
    that follows verifies each rank before it signals it."""
    try:
        verify_start_time(identity.pid, identity.start_time)
    except (LivenessError, OSError):
        return False
    return True
