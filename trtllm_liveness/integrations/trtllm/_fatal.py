"""The fatal path: what happens, in this order, on the first fatal event of an engine.

0. where ``trtllm-liveness launch`` asked for it (``TRTLLM_LIVENESS_OUTCOME``), the error is recorded
   for the launcher's wrapper (:mod:`trtllm_liveness.exit._outcome`), before anything else;
1. (exit guard on) upstream's shutdown flags ``doing_shutdown`` and ``_shutdown_signal_sent`` are
   set first, so that the guard's SIGINT is the only one (docs/upstream-contract.md "trtllm-serve
   ``/health``" says why each flag, and what happens where the latch lives on the frontend object);
   :func:`~trtllm_liveness.exit._exit_guard.interrupt_self_once` makes the guard's process-wide
   single, and ``_engine_shutdown.arm_exit_guard`` skips it once the executor's ``shutdown()`` began;
2. publish: upstream's ``_set_fatal_error`` where present, ``_fatal_error`` in any case (Dynamo
   reads it);
3. fail pending work: every pending request (upstream's ``_mark_engine_dead`` where present, an
   ``ErrorResponse`` per request otherwise), then removed from ``_results`` so that upstream's
   ``pre_shutdown()`` sends no ``CancellingRequest`` for it (a response still in flight for one
   is dropped: :class:`~._upstream_teardown.FailedResults`); on 1.2.x mpi4py's exit join of
   the pool thread is released (main's ``_mark_engine_dead`` does that itself) when the proxy
   owns the session; then the one
   ERROR line, with the evidence read from ``/proc`` now (:func:`fatal_evidence`), which also goes
   to the termination log (Kubernetes' ``terminationMessagePath``, config ``termination_log``)
   from a daemon thread; the snapshot that follows (:func:`report_snapshot`) adds itself there;
4. trigger the exit guard (``exit_on_fatal``), after ``exit_delay_s`` (or at once when the engine's
   liveness is released first: its shutdown ran), from its own thread;
5. upstream's ``pre_shutdown()`` in a helper thread: where a hang (a blocking send to a dead peer)
   stops nothing. Nobody waits on it without a bound. The helper thread does not own
   upstream's request socket once a caller's ``submit()`` used it (ZMQ sockets are not
   thread-safe; upstream's debug mode raises on such a send), so then the worker futures (the
   mirrors) are failed *before* it, and upstream, seeing no pending future, sends no stop sentinel
   (a leader still alive is ended by the bounded stop instead; see ``_mixin.pre_shutdown``).
   Otherwise they are failed after it returns, or after ``PRE_SHUTDOWN_WAIT_S``. (With the exit
   guard on, step 1 set ``doing_shutdown``, so upstream's ``pre_shutdown()`` returns at its first
   check: the send that may hang exists only without ``exit_on_fatal``.)

Steps 1-3 never block (no socket send, no join); they run in the thread that delivered the event
(the monitor's watcher, or a ``check_health()`` caller that found it). The threads of steps 4 and 5 are the engine's
(``FatalPath.threads``), joined with their bounds when it is released; the records' writes
and the quarantine are the process's ending's (:mod:`trtllm_liveness.exit`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from ..._config import LivenessConfig
from ..._events import EventKind, WorkerEvent, WorkerFailedError
from ...diagnose._diagnosis_text import fatal_line, instant_evidence, snapshot_record
from ...diagnose._stalled_rank import stalled_rank_now
from ...exit._outcome import record_outcome, record_snapshot, record_unrestartable
from ...exit._termination_log import MESSAGE_LIMIT_BYTES, amend_termination_message, write_termination_message
from ._features import find_symbol, warn_once
from ._state import EngineLiveness
from ._upstream_teardown import forget_late_responses, release_exit_joins

if TYPE_CHECKING:
    from ...diagnose._diagnosis import Diagnosis

logger = logging.getLogger(__name__.rpartition(".")[0])

OBSERVERS_FIRST_S = 0.002
"""How long the fatal path's cleanup thread waits before upstream's ``pre_shutdown()`` (see there)."""

PRE_SHUTDOWN_WAIT_S = 0.5
"""How long any caller waits for another thread's run of upstream's ``pre_shutdown()``."""

THREAD_END_S = 1.0
"""What a fatal-path thread may take beyond its own waits before its owner stops waiting for it."""

FATAL_HELPER_BOUND_S = OBSERVERS_FIRST_S + 3 * PRE_SHUTDOWN_WAIT_S + THREAD_END_S
"""The ``pre_shutdown()`` helper: the send lock (``PRE_SHUTDOWN_WAIT_S``), then upstream's
``pre_shutdown()`` (twice that), then the futures failed."""

DELIVERY_WAIT_S = 0.5
"""How long a health check or a clean stop waits for the delivery of a known failure that another
thread (the monitor's watcher, another health check) is making: the fatal path's first steps."""


def run_fatal_path(proxy: Any, state: EngineLiveness, error: WorkerFailedError) -> None:
    """Steps 1-5 of the module docstring. Never blocks; never raises."""
    # First: a launcher that reports success after a host crash kills this process within ms.
    record_outcome(str(error), error.restartable,
                   state.config.exit_code if error.restartable else state.config.exit_code_unrestartable)
    if state.exit_guard is not None:
        # Plain attribute stores: upstream reads both without a lock.
        for name in ("doing_shutdown", "_shutdown_signal_sent"):
            with contextlib.suppress(Exception):
                setattr(proxy, name, True)
    setter = getattr(proxy, "_set_fatal_error", None)  # publish: upstream's setter, _fatal_error in any case
    if callable(setter):
        try:
            setter(error)
        except Exception:
            logger.exception("liveness: upstream _set_fatal_error raised")
    if getattr(proxy, "_fatal_error", None) is None:
        proxy._fatal_error = error
    fail_requests(proxy, error)
    release_exit_joins(proxy, state)
    # The line's evidence reads every rank's thread states (milliseconds for 8 ranks of 100
    # threads): after the requests are failed, never before.
    line = fatal_line(error.event, fatal_evidence(state, error.event))
    logger.error("liveness: fatal: %s", line)
    fatal_path = state.fatal_path
    fatal_path.line = line
    write_termination_message(state.config.termination_log, f"trtllm-liveness: fatal engine error: {line}\n")
    if state.exit_guard is not None:
        fatal_path.threads.start(_trigger_exit_guard, name="trtllm-liveness-exit",
                                 bound_s=state.config.exit_delay_s + THREAD_END_S, args=(state, error))
    fatal_path.threads.start(_pre_shutdown_helper, name="trtllm-liveness-fatal", bound_s=FATAL_HELPER_BOUND_S,
                             args=(proxy, state, error))


OBSERVED_SNAPSHOT_BOUND_S = 6.0
"""How long observe mode's line may wait for its snapshot (the diagnosis' own bounds, and then some)."""


def observe_verdict(state: EngineLiveness, event: WorkerEvent) -> None:
    """Observe mode's whole reaction to a verdict (``observe=1``): it is remembered and counted by
    kind, and for the engine's first verdict ONE WARNING ``liveness: would fail: ...`` says what the
    fatal path would have said (the fatal line with its evidence, read now) with the verdict's
    snapshot, logged from a thread the engine owns once the snapshot is taken; a later verdict, which
    enforcing would not have reached, is one INFO line. Nothing else: no request failed, health
    unchanged, nothing stopped, no exit, no quarantine. Never blocks; never raises."""
    if not state.fatal_path.observe(event):
        # Enforcing, the first verdict would have stopped the engine: what comes after it is its
        # consequence (a rank ending with the engine), said once at INFO.
        logger.info("liveness: observed after the first verdict: %s (observe=1: nothing done)", event.message)
        return
    line = fatal_line(event, fatal_evidence(state, event))
    diagnoser = state.diagnoser

    def report() -> None:
        snapshot = ""
        if diagnoser is not None:
            try:
                diagnosis = diagnoser.take(snapshot=True)
            except Exception:
                logger.debug("liveness: observe mode's snapshot failed", exc_info=True)
            else:
                snapshot = f"; snapshot: {diagnosis.summary()}" if diagnosis is not None else ""
        logger.warning("liveness: would fail: %s%s (observe=1: nothing done)", line, snapshot)

    threads = state.fatal_path.threads
    if threads.start(report, name="trtllm-liveness-observe", bound_s=OBSERVED_SNAPSHOT_BOUND_S) is None:
        logger.warning("liveness: would fail: %s (observe=1: nothing done)", line)


def fatal_evidence(state: EngineLiveness, event: WorkerEvent | None = None) -> str:
    """The fatal line's evidence, known at once: the ranks' thread states read from ``/proc`` now
    and their reported iterations (:func:`~trtllm_liveness.diagnose._stalled_rank.stalled_rank_now`,
    microseconds per thread; a rank in ``D`` is read without touching its memory). The snapshot,
    which takes a CPU window and the stacks, follows in its own line (:func:`report_snapshot`).
    A stall's line keeps the evidence its naming read, other hosts' ranks included (their agents')."""
    try:
        named = state.stall.named if state.stall is not None else None
        if event is not None and event.kind is EventKind.STALLED and named is not None \
                and named.rank == event.identity.rank:
            return instant_evidence(named)
        return instant_evidence(stalled_rank_now(state.identities, iterations=state.iteration_counts() or None))
    except Exception:  # the line goes out whatever the evidence does
        logger.debug("liveness: the fatal line's evidence could not be read", exc_info=True)
        return "none read"


def report_snapshot(state: EngineLiveness, reason: str, diagnosis: Diagnosis) -> None:
    """The fatal verdict's snapshot, taken before the bounded stop: one WARNING line with every
    rank (state, wait channel, CPU class, iterations, stack source), and the whole record in the
    outcome record and the termination message (after the fatal line). Never raises."""
    try:
        record = snapshot_record(diagnosis, reason, hosts={who.rank: who.hostname for who in state.identities},
                                 iterations=state.iteration_counts())
        state.fatal_path.snapshot = record
        logger.warning("liveness: diagnosis (%s): %s", reason, record.summary())
        record_snapshot(record)
        if state.fatal_path.line:
            head = f"trtllm-liveness: fatal engine error: {state.fatal_path.line}\nsnapshot: "
            room = MESSAGE_LIMIT_BYTES - len(head.encode()) - 1
            amend_termination_message(state.config.termination_log, f"{head}{record.to_json(room)}\n")
    except Exception:
        logger.warning("liveness: reporting the fatal verdict's snapshot failed (%s)", reason, exc_info=True)


def report_later_event(state: EngineLiveness, event: WorkerEvent) -> None:
    """Log an event that is not the engine's failure (the monitor leaves that to this engine): a
    death once the engine has failed or is stopping is a consequence (INFO); a death otherwise is a
    WARNING, and a wedge or an unkillable rank, a fact about the host, an ERROR."""
    if event.kind is not EventKind.DIED:
        logger.error("liveness: %s", event.message)
    elif state.fatal_path.failed_or_stopping:
        who = event.identity
        logger.info("liveness: MPI worker rank %d (pid %d) on host %s exited after the engine's failure or stop "
                    "began: %s", who.rank, who.pid, who.hostname, event.cause)
    else:
        logger.warning("liveness: %s", event.message)


def check_host(config: LivenessConfig) -> None:
    """Start-up's quarantine check (:func:`~trtllm_liveness.quarantine._host_policy.check_host_at_start`):
    raises ``HostQuarantinedError`` on a host where an earlier engine's worker is still stuck."""
    if not config.quarantine_dir and not config.quarantine_devices:
        return
    from ...quarantine._host_policy import check_host_at_start  # only with liveness on

    check_host_at_start(config)


def note_unrestartable(state: EngineLiveness, events: Iterable[WorkerEvent]) -> None:
    """Any event of ``events`` that is not restartable (a wedge, an unkillable rank, also one the
    bounded stop reports after a death) makes the exit status ``exit_code_unrestartable`` and
    quarantines the host (marker, actions: :func:`~trtllm_liveness.quarantine._host_policy.quarantine_host`,
    in a thread the process's ending awaits). Never blocks; never raises."""
    unrestartable = [event for event in events if not event.restartable]
    if not unrestartable:
        return
    if state.exit_guard is not None:
        state.exit_guard.mark_unrestartable()
    # After a recorded failure: the wrapper's status turns to "do not restart here" too.
    record_unrestartable(unrestartable[0].message, state.config.exit_code_unrestartable)
    try:
        from ...quarantine._host_policy import quarantine_host  # imported on the first such failure only

        quarantine_host(state.config, unrestartable)
    except Exception:
        logger.exception("liveness: could not quarantine the host")


def fail_requests(proxy: Any, error: WorkerFailedError) -> None:
    """Fail every pending request with the engine's error and forget it; never blocks."""
    results: Any = getattr(proxy, "_results", None)
    forget_late_responses(results)  # before any is forgotten: a late response for one is dropped
    mark_dead = getattr(proxy, "_mark_engine_dead", None)
    if callable(mark_dead):
        try:
            mark_dead(error)
        except Exception:
            logger.exception("liveness: upstream _mark_engine_dead failed; failing requests directly")
        else:
            if isinstance(results, dict):
                results.clear()  # each has its EngineDeadError; no CancellingRequest to a dead peer
            return
    if isinstance(results, dict):
        for client_id in list(results):
            fail_request(proxy, client_id, error)


def fail_request(proxy: Any, client_id: Any, error: BaseException) -> None:
    results: Any = getattr(proxy, "_results", {})
    result = results.pop(client_id, None)
    if result is None:
        return
    response_cls = getattr(proxy, "_error_response_cls", None) or find_symbol(
        ["ErrorResponse"], ["tensorrt_llm.executor.utils"])
    try:
        item: Any = error
        if response_cls is not None:
            item = response_cls(client_id, str(error), getattr(result, "request_id", client_id))
        result.queue.put(item)
        _notify_async(result.queue)
    except Exception:
        logger.exception("liveness: could not fail request %r", client_id)


def _trigger_exit_guard(state: EngineLiveness, error: WorkerFailedError) -> None:
    guard = state.exit_guard
    if guard is not None:
        # Let health endpoints answer 503 (and logs say why) before the server goes away; no
        # longer once the engine's shutdown released it (the server is going away already).
        state.fatal_path.closing.wait(state.config.exit_delay_s)
        guard.trigger(error)


def _pre_shutdown_helper(proxy: Any, state: EngineLiveness, error: WorkerFailedError) -> None:
    # pre_shutdown() runs in a thread of its own, waited on for PRE_SHUTDOWN_WAIT_S at most: it
    # may hang for good in a send to a dead peer. The worker futures are failed after it (1.2.x
    # sends its stop sentinel, which lets a live leader return, only while every future is
    # pending) or after the bound, whichever comes first: upstream's start-up loop and its
    # shutdown() wait on them without a timeout. (Where this thread does not own the request
    # socket, the mixin's pre_shutdown() fails them first, so that no sentinel is sent from here.)
    def run() -> None:
        # Cleanup yields first: the threads that observe the failure (health probes, the readers
        # of the requests just failed) are waiting for the GIL right now, and upstream's
        # pre_shutdown() is pure Python that would hold it for the next switch interval.
        time.sleep(OBSERVERS_FIRST_S)
        # Never while a caller's submit() is inside a send on the same (unlocked) socket.
        if not state.send_lock.acquire(timeout=PRE_SHUTDOWN_WAIT_S):
            logger.warning("liveness: a submit() is still inside a send on upstream's request socket; upstream "
                           "pre_shutdown() is left to shutdown() (no concurrent send from this thread)")
            return
        try:
            proxy.pre_shutdown()
        except Exception:
            logger.exception("liveness: pre_shutdown() raised after the fatal error")
        finally:
            state.send_lock.release()

    worker = state.fatal_path.threads.start(run, name="trtllm-liveness-pre-shutdown", bound_s=2 * PRE_SHUTDOWN_WAIT_S)
    if worker is not None:
        worker.join(2 * PRE_SHUTDOWN_WAIT_S)
        if worker.is_alive():
            logger.warning("liveness: upstream pre_shutdown() still blocked after %.1fs (a send to a dead peer?); "
                           "left in its daemon thread", 2 * PRE_SHUTDOWN_WAIT_S)
    state.fail_worker_futures(error)
    state.fatal_path.done.set()


def dead_error(proxy: Any, error: WorkerFailedError) -> BaseException:
    """Upstream's ``EngineDeadError(error)`` where it exists, else ``error``."""
    base = getattr(type(proxy), "_liveness_base", type(proxy))
    engine_dead = find_symbol(["EngineDeadError"], [base.__module__, "tensorrt_llm.executor.utils",
                                                    "tensorrt_llm.executor.result"])
    if isinstance(engine_dead, type) and issubclass(engine_dead, BaseException):
        with contextlib.suppress(Exception):
            return engine_dead(error)
    return error


def _notify_async(item_queue: Any) -> None:
    """Wake an asyncio consumer of upstream's ``_SyncQueue`` (it is woken explicitly upstream)."""
    loop = getattr(item_queue, "loop", None)
    notify = getattr(type(item_queue), "notify_many", None)
    if loop is None:
        return  # a synchronous consumer: the put itself wakes it
    if not callable(notify):
        warn_once("notify_many", type(item_queue).__qualname__, "liveness: %s has a loop but no notify_many(): "
                  "asyncio consumers of a failed request may not be woken", type(item_queue).__qualname__)
        return
    try:
        notify(loop, [item_queue])
    except Exception:
        warn_once("notify_many", "raised", "liveness: notify_many() raised: asyncio consumers of a failed request "
                  "may not be woken", exc_info=True)
