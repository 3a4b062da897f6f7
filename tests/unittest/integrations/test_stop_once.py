"""One bounded stop per engine, however many callers race it.

``shutdown()`` (a server's SIGINT handler, its ``finally``, a frontend's own call) and the
process's ending (the exit guard's watchdog runs the engine's STOP cleanup,
``_engine_shutdown.arm_exit_guard``'s, i.e. ``stop_workers``) may reach the bounded stop at the same
time after a fatal event. Here several threads call ``shutdown()`` and several the ending's stop
at once, right after a real death (SIGKILL) of one rank, while the other rank ignores SIGTERM (the
stop must SIGKILL it) or is really stuck in ``D`` (freezer or FUSE: left unkillable). Exactly
one stop runs: one INFO line for the rank it ended, one unrestartable note for the rank it could
not end, and every caller gets the one report the engine keeps.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.support.bare_proxy import BareUpstreamProxy
from tests.support.process_tracker import ProcessTracker
from tests.support.quarantine import config_for, fresh_quarantine_state  # noqa: F401 - an autouse fixture
from tests.support.stuck_processes import StuckChild
from tests.support.waits import WAIT_SCALE, wait_until
from trtllm_liveness._events import EventKind, WorkerEvent, WorkerState
from trtllm_liveness.integrations.trtllm import _engine_shutdown, liveness_proxy_class
from trtllm_liveness.integrations.trtllm._state import EngineLiveness, EngineStop
from trtllm_liveness.monitor._monitor import WorkerProcessMonitor
from trtllm_liveness.process._identity import capture_identity
from trtllm_liveness.stop._bounded_stop import StopOutcome, stop_processes

pytestmark = [pytest.mark.timeout(90), pytest.mark.real_process]

CALLERS = 4  # of each kind: shutdown() and the ending's stop


def _engine(tmp_path: Path) -> Any:
    config = config_for(tmp_path / "quarantine", d_state_timeout_s=30.0, scan_interval_s=0.02, termination_log="",
                        shutdown_grace_s=0.1, shutdown_term_s=0.2, shutdown_kill_s=0.5)
    return liveness_proxy_class(BareUpstreamProxy, config=config)({"llm_args": None})


def _race(proxy: Any) -> list[Any]:
    """``CALLERS`` threads call ``shutdown()`` and ``CALLERS`` the ending's stop, all released at once;
    returns what each ending's stop returned."""
    state: EngineLiveness = proxy.liveness_state
    start = threading.Barrier(2 * CALLERS, timeout=10 * WAIT_SCALE)
    reports: list[Any] = []
    errors: list[BaseException] = []

    def shut() -> None:
        try:
            start.wait()
            proxy.shutdown()
        except BaseException as exc:
            errors.append(exc)

    def ending_stop() -> None:
        try:
            start.wait()
            reports.append(_engine_shutdown.stop_workers(state))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=shut, name=f"shutdown-{n}") for n in range(CALLERS)]
    threads += [threading.Thread(target=ending_stop, name=f"ending-stop-{n}") for n in range(CALLERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60 * WAIT_SCALE)
    assert not any(thread.is_alive() for thread in threads), "a caller never returned"
    assert not errors, errors
    return reports


def _fail(proxy: Any, procs: ProcessTracker) -> None:
    """A real death of rank 1, awaited as a server's health probe would."""
    dead = procs.sleeper()
    proxy.liveness_monitor.register([capture_identity(1, dead.pid)])
    os.kill(dead.pid, signal.SIGKILL)
    assert wait_until(lambda: not proxy.check_health(), 10 * WAIT_SCALE)


def test_racing_shutdowns_and_the_endings_stop_run_one_stop(
        procs: ProcessTracker, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    proxy = _engine(tmp_path)
    stubborn = procs.sleeper(ignore_term=True)
    proxy.liveness_monitor.register([capture_identity(0, stubborn.pid)])
    _fail(proxy, procs)
    with caplog.at_level(logging.INFO, logger="trtllm_liveness"):
        reports = _race(proxy)
    state: EngineLiveness = proxy.liveness_state
    stopped = [record for record in caplog.records if record.getMessage().startswith(
        f"liveness: stopped rank 0 (pid {stubborn.pid})")]
    assert len(stopped) == 1, [record.getMessage() for record in stopped]
    assert "SIGKILL" in stopped[0].getMessage()
    report = state.stop.report
    assert report is not None and all(found is report for found in reports), "a stop report was replaced"


def test_a_rank_left_unkillable_is_noted_once_however_many_stops_race(
        stuck_child: StuckChild, procs: ProcessTracker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    notes: list[WorkerEvent] = []
    lock = threading.Lock()
    note = _engine_shutdown.note_unrestartable

    def counted(state: EngineLiveness, events: Any) -> None:
        events = list(events)
        with lock:
            notes.extend(event for event in events if event.kind is EventKind.UNKILLABLE)
        note(state, events)

    monkeypatch.setattr(_engine_shutdown, "note_unrestartable", counted)
    proxy = _engine(tmp_path)
    proxy.liveness_monitor.register([capture_identity(0, stuck_child.popen.pid)])
    _fail(proxy, procs)
    reports = _race(proxy)
    state: EngineLiveness = proxy.liveness_state
    assert len(notes) == 1, f"the unkillable rank was noted {len(notes)} times"
    report = state.stop.report
    assert report is not None and all(found is report for found in reports)
    assert [worker.pid for worker in report.unkillable] == [stuck_child.popen.pid]


def test_a_shutdown_whose_upstream_runner_cannot_start_still_stops_the_ranks_and_releases(
        procs: ProcessTracker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No thread can start (the interpreter's own shutdown refuses new threads): ``shutdown()`` of a
    failed engine still stops its ranks, once, and releases the engine's parts; a second call does
    nothing more."""
    proxy = _engine(tmp_path)
    rank = procs.sleeper()
    proxy.liveness_monitor.register([capture_identity(0, rank.pid)])
    _fail(proxy, procs)
    state: EngineLiveness = proxy.liveness_state
    start = type(state.fatal_path.threads).start

    def refuse_upstream(threads: Any, target: Any, *, name: str, bound_s: float, args: tuple[Any, ...] = ()) -> Any:
        if name == _engine_shutdown.UPSTREAM_SHUTDOWN_THREAD:
            return None  # as OwnedThreads.start does when Thread.start() raises
        return start(threads, target, name=name, bound_s=bound_s, args=args)

    monkeypatch.setattr(type(state.fatal_path.threads), "start", refuse_upstream)
    proxy.shutdown()
    proxy.shutdown()
    report = state.stop.report
    assert state.stop.done and report is not None
    assert rank.pid in [worker.pid for worker in report.workers]
    assert wait_until(lambda: rank.poll() is not None, 10 * WAIT_SCALE)
    assert state.fatal_path.closing.is_set()  # released


def test_a_stop_that_raised_is_never_run_again_and_keeps_the_hosts_reports_it_had() -> None:
    """The stop's promise holds when its body raises after the remote hosts answered (a log or
    quarantine step failing): no later caller runs it again (its ranks would be signalled twice),
    and the hosts' reports it had are kept (``liveness_state.host_stops``)."""
    stop = EngineStop()
    runs: list[int] = []
    reports = [object()]

    def failing(owner: EngineStop) -> Any:
        runs.append(1)
        owner.note_host_stops(reports)  # type: ignore[arg-type]  # only identity matters here
        raise RuntimeError("a step after the remote join failed")

    with pytest.raises(RuntimeError):
        stop.once(5, failing)
    assert stop.once(5, failing) is None
    assert runs == [1] and stop.done and stop.host_stops is reports


def test_a_second_caller_waits_as_long_as_the_stop_waits_for_the_hosts_snapshot(tmp_path: Path) -> None:
    """Where an agent hub runs, the stop first waits ``diagnosis_before_stop_hosts_s`` for the
    snapshot: a second caller's wait for the stop under way counts that, not the one-host bound, so
    it gets the stop's report rather than giving up before the stop could end."""
    config = config_for(tmp_path / "quarantine", d_state_timeout_s=30.0, termination_log="", shutdown_term_s=0.1,
                        shutdown_kill_s=0.1, diagnosis_before_stop_s=0.0, diagnosis_before_stop_hosts_s=30.0)
    proxy = liveness_proxy_class(BareUpstreamProxy, config=config)({"llm_args": None})
    state: EngineLiveness = proxy.liveness_state
    one_host_bound = 2 * (config.shutdown_term_s + config.shutdown_kill_s) + _engine_shutdown.STOP_MARGIN_S + 2.0
    report = object()
    held = threading.Event()

    def first_stop() -> None:  # the stop under way: its snapshot wait is longer than the one-host bound
        def stop(_stop: Any) -> Any:
            held.set()
            threading.Event().wait(one_host_bound + 1.0)
            return report

        state.stop.once(60, stop)

    state.hub = object()  # type: ignore[assignment]  # only its presence matters for the bound
    holder = threading.Thread(target=first_stop)
    holder.start()
    try:
        assert held.wait(10 * WAIT_SCALE)
        assert _engine_shutdown.stop_workers(state) is report
    finally:
        holder.join(60)
        state.hub, state.stop.report, state.stop.done = None, None, False  # the real stop (of no rank)
        proxy.shutdown()


def test_a_rank_gone_between_the_verdict_and_the_stop_is_one_info_line(
        procs: ProcessTracker, caplog: pytest.LogCaptureFixture) -> None:
    """Rank 1's death is the verdict (the monitor reports it); rank 0 then ends on its own (MPI's
    runtime) after the monitor began expecting exits, so no event names it, and the stop finds both
    gone. The stop's lines: one INFO for rank 0, none for rank 1 (its death has its own line); after
    a clean stop (no monitor given), none."""
    children = [procs.sleeper() for _ in range(2)]
    identities = [capture_identity(rank, child.pid) for rank, child in enumerate(children)]
    with WorkerProcessMonitor(scan_interval_s=0.02) as monitor:
        monitor.register(identities)
        monitor.start()
        os.kill(children[1].pid, signal.SIGKILL)
        assert wait_until(lambda: monitor.find_dead_worker() == identities[1], 10 * WAIT_SCALE)
        monitor.mark_expected_exits()
        os.kill(children[0].pid, signal.SIGKILL)
        assert wait_until(lambda: any(s.state is WorkerState.EXITED_EXPECTED for s in monitor.statuses()),
                          10 * WAIT_SCALE)
        report = stop_processes(identities, grace_s=0.1, kill_s=0.1)
        assert [w.outcome for w in report.workers] == [StopOutcome.ALREADY_GONE] * 2
        caplog.clear()  # the monitor's own line for the death
        with caplog.at_level(logging.INFO, logger="trtllm_liveness"):
            _engine_shutdown.log_stopped(report, None)
            assert caplog.records == []
            _engine_shutdown.log_stopped(report, monitor)
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 1 and caplog.records[0].levelno == logging.INFO, lines
    assert lines[0].startswith(f"liveness: MPI worker rank 0 (pid {children[0].pid}) on host ") and \
        "exited after the engine's failure or stop began" in lines[0], lines
    for child in children:
        child.wait(10)
